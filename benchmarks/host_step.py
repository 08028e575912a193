"""The host's part of a graphed decode step between reading one step's tokens and launching the
next: the scheduler's step (`Scheduler.schedule` over every running sequence), the staging
of the input rows, each sequence's block table copied from its `BlockTable`'s int64 array,
against the same rows from Python lists (a copy of each table converted int by int, what every
step did before `BlockTable`), and the sampler's uniform numbers with the per-row values that
cross to the device with them: taken from each sequence's `Draws` (a block of 64 drawn at a
time) against one ``torch.rand`` per sequence and step, stacked (what every step did before
`Draws`; the two give the same numbers, checked). And the staging of a step that admits a
request while the others decode (a prompt of 128 tokens beside ``batch - 1`` decodes), the
prefill graph's inputs (`PrefillInputs.fill`), which the host writes before launching such a
step.

No GPU needed (host work only): ``python benchmarks/host_step.py``. Prints a markdown table
and writes it to ``$OUT/host_step.md`` when OUT is set; exits 1 if the two ways' rows differ.
Batches and contexts are the decode benchmark's (`benchmarks/decode.py`), pages of 16 tokens;
wall-clock milliseconds per step, median of 50 after 5 warm-ups.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import numpy as np
import torch
from _timing import report, run_header

from fp4rl.rollout.attention import Segment
from fp4rl.rollout.block_manager import BlockManager
from fp4rl.rollout.config import EngineConfig, SamplingParams
from fp4rl.rollout.graphs import TABLE, bucket_for, fill_rows
from fp4rl.rollout.prefill_graphs import PrefillInputs, prefill_bucket
from fp4rl.rollout.sampler import Draws, make_generator
from fp4rl.rollout.scheduler import Group, Scheduler
from fp4rl.rollout.sequence import Sequence

CASES = ((1, 1024), (64, 4096), (256, 2048))
PAGE = 16


def host_ms(fn, repeats: int = 50, warmup: int = 5) -> float:
    """Median wall-clock ms of ``fn()``: host time, which `_timing.median_ms` would measure with
    CUDA events on a GPU machine (the device's time, not the host's)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def schedule_ms(batch: int, context: int) -> float:
    """One step of `Scheduler.schedule` with ``batch`` sequences of ``context`` tokens running
    (each then takes a token, as a step's sampling does)."""
    steps = 55
    config = EngineConfig(block_size=PAGE, max_model_len=context + steps + PAGE,
                          max_num_seqs=batch, max_num_batched_tokens=batch * context)  # fmt: skip
    scheduler = Scheduler(config, BlockManager(batch * (context // PAGE + 5), PAGE))
    params = SamplingParams(max_tokens=context)
    for i in range(batch):
        prompt = list(range(context))
        seq = Sequence(i, i, 0, prompt, params, Draws(torch.Generator()), frozenset())
        scheduler.add(Group([seq]))
    scheduler.commit(scheduler.schedule())

    def step():
        for seq in scheduler.running:
            seq.completion_ids.append(1)
        scheduler.commit(scheduler.schedule())

    return host_ms(step, repeats=steps - 5)


def draws_ms(batch: int) -> tuple[float, float, bool]:
    """(ms per step of one draw per sequence, stacked, then the per-row values; ms of the same
    from `Draws`; whether the first step's values agree)."""
    rest = [1.0] * (4 * batch)  # temperatures, top-p, greedy flags, top-k: as the sampler's

    def single(generators):
        u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
        return torch.cat([u, torch.tensor(rest, dtype=torch.float64)])

    def blocks(draws):
        return torch.tensor([d.next() for d in draws] + rest, dtype=torch.float64)

    fresh = lambda: [make_generator(0, i, 0) for i in range(batch)]  # noqa: E731
    same = torch.equal(single(fresh()), blocks([Draws(g) for g in fresh()]))
    generators, draws = fresh(), [Draws(g) for g in fresh()]
    return host_ms(lambda: single(generators)), host_ms(lambda: blocks(draws)), same


def admission_ms(tables, context: int) -> float:
    """Staging a prefill graph's inputs for a prompt of 128 tokens beside one decode per table
    but the last, each at ``context`` tokens."""
    prompt, batch = 128, len(tables)
    segments = [Segment(tables[-1], 0, prompt)]
    segments += [Segment(t, context - 1, 1) for t in tables[:-1]]
    decodes = batch - 1
    slots = bucket_for(decodes) if decodes else 0
    inputs = PrefillInputs.of(prefill_bucket(prompt + decodes), slots, batch, 8, context // PAGE)
    buffer = np.zeros(inputs.size, dtype=np.int64)
    tokens = list(range(prompt + decodes))
    return host_ms(lambda: inputs.fill(buffer, segments, tokens, PAGE, 8, 0))


def main() -> None:
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        "| batch × context | schedule ms | blocks a row | staging from lists (copy + ints) ms "
        "| from BlockTable arrays ms | lists / arrays | draws one by one ms | from Draws ms "
        "| one by one / Draws | admission staging ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
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
        lists, arrays = host_ms(with_lists), host_ms(with_arrays)
        same = np.array_equal(rows["l"], rows["a"])
        single, drawn, same_draws = draws_ms(batch)
        failed |= not (same and same_draws)
        lines.append(
            f"| {batch} × {context} | {schedule_ms(batch, context):.3f} | {blocks} | {lists:.3f} | "
            f"{arrays:.3f} | "
            f"{lists / arrays:.1f}x{'' if same else ' (rows differ)'} | {single:.3f} | "
            f"{drawn:.3f} | {single / drawn:.1f}x{'' if same_draws else ' (values differ)'} | "
            f"{admission_ms(tables, context):.3f} |"
        )
        print(lines[-1], flush=True)
    report("host_step.md", lines)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
