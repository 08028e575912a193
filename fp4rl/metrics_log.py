"""A run's metrics: ``metrics.jsonl`` read back, and mirrored to TensorBoard as the run writes it.

A run directory holds ``metrics.jsonl`` (`fp4rl.loop`: one JSON object per step, the last one
the final evaluation). This module owns:

- `read_metrics`: the entries of ``metrics.jsonl``, checked (a bad line is an error naming it);
  `series` and `scalars`, the numbers they recorded;
- `TensorBoardLog`: every numeric metric of a step as a TensorBoard scalar (``run.tensorboard``),
  written by the loop beside ``metrics.jsonl``; `check_tensorboard`, whether it can be.

It does not own which metrics exist (the loop, `fp4rl.train.observe`, `fp4rl.train.step`),
writing ``metrics.jsonl`` (`fp4rl.run_dir`) or the plots and summary of a run (`fp4rl.report`),
and imports nothing else of fp4rl. tensorboard is an optional extra, imported only when used.
"""

from __future__ import annotations

import json
from pathlib import Path

TENSORBOARD_EXTRA = "pip install 'fp4rl[tensorboard]'"


def is_number(value) -> bool:
    """Whether a metric's value is a number (an int or a float, not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def scalars(m: dict) -> dict[str, float]:
    """The numeric metrics of one entry (ints and floats, not bools), ``step`` left out."""
    return {k: float(v) for k, v in m.items() if k != "step" and is_number(v)}


def _summary_writer():
    """TensorBoard's ``SummaryWriter`` class; ModuleNotFoundError naming the extra to install
    when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ModuleNotFoundError(
            f"run.tensorboard = true needs the tensorboard package ({err}): {TENSORBOARD_EXTRA}",
            name="tensorboard",
        ) from None
    return SummaryWriter


def check_tensorboard() -> None:
    """Raise ValueError (a bad setting: ``fp4rl train`` says it in one line) when
    ``run.tensorboard = true`` cannot be honoured; the loop asks before it loads anything."""
    try:
        _summary_writer()
    except ModuleNotFoundError as err:
        raise ValueError(str(err)) from None


class TensorBoardLog:
    """TensorBoard event files under ``<run_dir>/tensorboard``: `write` adds every numeric
    metric of an entry as a scalar at the entry's ``step`` and flushes, so a killed run loses
    nothing it wrote to ``metrics.jsonl``.

    ``purge_step``: a run resumed at step ``s`` passes ``s``, and TensorBoard hides the events
    an earlier attempt wrote at steps >= ``s`` (those steps are run again); None for a new
    run."""

    def __init__(self, run_dir: str | Path, *, purge_step: int | None = None) -> None:
        summary_writer = _summary_writer()
        if purge_step is not None and (not isinstance(purge_step, int) or purge_step < 0):
            raise ValueError(f"purge_step must be an int >= 0 or None, got {purge_step!r}")
        self.path = Path(run_dir) / "tensorboard"
        self._writer = summary_writer(str(self.path), purge_step=purge_step)

    def write(self, m: dict) -> None:
        for tag, value in scalars(m).items():
            self._writer.add_scalar(tag, value, global_step=m["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The entries of ``<run_dir>/metrics.jsonl`` in order. Each line must be a JSON object
    whose ``step`` is an int larger than the line before's (a file holding two runs, or a
    torn last line, is an error naming the line)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: not a run directory")
    entries: list[dict] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        where = f"{path}:{number}"
        try:
            m = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not a JSON object ({err.msg}): {line[:60]!r}") from None
        if not isinstance(m, dict):
            raise ValueError(f"{where}: not a JSON object: {line[:60]!r}")
        step = m.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"{where}: 'step' must be an int >= 0, got {step!r}")
        if entries and step <= entries[-1]["step"]:
            raise ValueError(
                f"{where}: step {step} follows step {entries[-1]['step']}; steps must increase "
                "(does the file hold more than one run?)"
            )
        entries.append(m)
    if not entries:
        raise ValueError(f"{path} holds no entries")
    return entries


def series(entries: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of the entries that recorded ``key`` as a number."""
    pairs = [(m["step"], float(m[key])) for m in entries if key != "step" and is_number(m.get(key))]
    return [s for s, _ in pairs], [v for _, v in pairs]
