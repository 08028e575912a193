"""Timing shared by the benchmarks: medians of CUDA-event timings over inputs rotated past L2.

Each repeat enqueues one call per input buffer between two events and keeps the mean per call,
so that no call finds its input in L2 (give enough distinct buffers to exceed the L2 together).
Eager calls include whatever time Python takes to launch them when that exceeds the GPU's;
replaying a CUDA graph of the calls measures the GPU alone. The median over repeats is reported.
On a machine without CUDA (smoke runs under TRITON_INTERPRET) wall-clock time stands in.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def median_ms(
    fn: Callable, inputs: Sequence, *, warmup: int, repeats: int, graph: bool = False
) -> float:
    """Median over ``repeats`` of the mean milliseconds of ``fn(inp)`` for inp in ``inputs``.

    With ``graph`` the calls are captured once in a CUDA graph and the graph is replayed, so the
    figure is the GPU's time alone, however long Python takes to launch each call.
    """
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    cuda = torch.cuda.is_available()
    run = lambda: [fn(inp) for inp in inputs]  # noqa: E731
    if cuda and graph:
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            run()
        run = captured.replay
        run()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / len(inputs))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3 / len(inputs))
    return statistics.median(times)


ROTATE_BYTES = 128 << 20  # distinct input buffers that together exceed the H200's 50 MB L2


def copy_bandwidth(device, sizes_mib=(1024, 256, 64), *, warm_up: bool = True) -> float:
    """Device-to-device copy GB/s, counting read and write: the best of copies of
    ``sizes_mib`` (each beyond the H200's 50 MB L2), launched plainly, median of 10 each (the
    same copies replayed from a CUDA graph measured 10-35 % slower on an H200, 2026-12-03).
    ``warm_up`` first runs a BF16 matmul that brings the clocks up from idle (a copy timed
    first on a GPU idling at 375 MHz ran at two thirds of its later rate). The figure the
    benchmarks' memory rooflines divide by; off the GPU, small copies (smoke runs)."""
    cuda = torch.device(device).type == "cuda"
    if warm_up:
        m = 8192 if cuda else 128
        a = torch.randn(m, m, device=device).to(torch.bfloat16)
        median_ms(lambda _: a @ a, [None], warmup=10, repeats=10)
    rates = []
    for mib in sizes_mib:
        src = torch.randn((mib << 20) // 2 if cuda else 1 << 16, device=device).to(torch.bfloat16)
        dst = torch.empty_like(src)
        ms = median_ms(dst.copy_, [src], warmup=5, repeats=10)
        rates.append(2 * src.nbytes / ms / 1e6)
        del src, dst
    sizes = "/".join(str(mib) for mib in sizes_mib)
    print(f"copy GB/s at {sizes} MiB: {[round(r) for r in rates]}", flush=True)
    return max(rates)


def rotation_count(bytes_per_input: int, *, most: int | None = None, cuda: bool = True) -> int:
    """How many distinct inputs of ``bytes_per_input`` to rotate over so that, together, they
    exceed the L2 (`ROTATE_BYTES`): at least 2, at most ``most``; 2 off the GPU (smoke runs)."""
    if not cuda:
        return 2
    count = max(2, -(-ROTATE_BYTES // bytes_per_input))
    return count if most is None else max(2, min(most, count))


def run_header(command: str) -> str:
    """Command, device, versions, date and commit: what a benchmark figure is quoted with."""
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()

    project = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(project), *args], capture_output=True, text=True, check=True
        ).stdout

    try:
        # A copy of the tree inside another checkout would otherwise name that checkout's commit.
        if Path(git("rev-parse", "--show-toplevel").strip()).resolve() != project:
            raise OSError("not a checkout of its own")
        commit = git("rev-parse", "--short", "HEAD").strip()
        if git("status", "--porcelain", "--untracked-files=no").strip():
            commit += " + uncommitted changes"  # the figures are not that commit's
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (not a git checkout of its own)"
    return (
        f"`{command}` on {device or 'CPU'}, torch {torch.__version__}, triton "
        f"{triton.__version__}, {datetime.date.today().isoformat()}, commit {commit}"
    )


def report(name: str, lines: Sequence[str]) -> None:
    """Print a result table and, where OUT is set (the GPU machine), write it to OUT/name."""
    table = "\n".join(lines)
    print(table)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            f.write(table + "\n")
