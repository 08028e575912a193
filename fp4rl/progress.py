"""A progress bar on a terminal, nothing elsewhere: ``with Progress(total, "rollout") as bar:``
``bar.update(n)``. Redrawn at most ten times a second; silent when the stream is not a TTY, so
logs and captured test output stay clean."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, label: str, *, stream=None, width: int = 30) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.done, self.start, self.drawn = 0, time.perf_counter(), 0.0
        self.active = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if self.active and (now - self.drawn > 0.1 or self.done >= self.total):
            self.drawn = now
            filled = self.width * min(self.done, self.total) // self.total
            bar = "#" * filled + "." * (self.width - filled)
            seconds = now - self.start
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {seconds:.1f}s")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.active:
            self.stream.write("\r\033[K")  # erase the bar; the caller's summary line follows
            self.stream.flush()
