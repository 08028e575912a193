"""The host's part of staging a graphed decode step: each sequence's input row, its block table
copied from the `BlockTable`'s int64 array, against the same rows from Python lists (a copy of
each table converted int by int, what every step did before `BlockTable`).

No GPU needed (host work only): ``python benchmarks/stage_rows.py``. Prints a markdown table
and writes it to ``$OUT/stage_rows.md`` when OUT is set; exits 1 if the two ways' rows differ.
Batches and contexts are the decode benchmark's (`benchmarks/decode.py`), pages of 16 tokens;
wall-clock milliseconds per step, median of 50 after 5 warm-ups.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import numpy as np
from _timing import report, run_header

from fp4rl.rollout.attention import Segment
from fp4rl.rollout.block_manager import BlockManager
from fp4rl.rollout.graphs import TABLE, fill_rows

CASES = ((1, 1024), (64, 4096), (256, 2048))
PAGE = 16


def median_ms(fn, repeats: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        "| batch × context | blocks a row | lists (copy + ints) ms | BlockTable arrays ms "
        "| lists / arrays |",
        "|---|---:|---:|---:|---:|",
    ]
    failed = False
    for batch, context in CASES:
        blocks = context // PAGE
        manager = BlockManager(num_blocks=batch * blocks, block_size=PAGE)
        tables = [manager.allocate(blocks) for _ in range(batch)]
        tokens = list(range(batch))
        rows = {name: np.zeros((batch, TABLE + blocks), dtype=np.int64) for name in "la"}

        def stage(out, copy, tables=tables, tokens=tokens, start=context - 1):
            segments = [Segment(list(t) if copy else t, start, 1) for t in tables]
            fill_rows(out, segments, tokens, PAGE)

        with_lists = functools.partial(stage, rows["l"], True)
        with_arrays = functools.partial(stage, rows["a"], False)
        lists, arrays = median_ms(with_lists), median_ms(with_arrays)
        same = np.array_equal(rows["l"], rows["a"])
        failed |= not same
        lines.append(
            f"| {batch} × {context} | {blocks} | {lists:.3f} | {arrays:.3f} | "
            f"{lists / arrays:.1f}x{'' if same else ' (rows differ)'} |"
        )
        print(lines[-1], flush=True)
    report("stage_rows.md", lines)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
