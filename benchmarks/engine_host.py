"""Where the engine's call spends host and GPU time: the host's share of a step, measured.

    python benchmarks/engine_host.py     # one H200: 12 layers, one prompt of 512 + 64 tokens
    python benchmarks/engine_host.py --device cpu --layers 2 --hidden 64 --prompt-len 16 \\
        --max-tokens 4 --repeats 1      # smoke check (host timers only)

The BF16 engine of `hf_generate.py` (the same random model and KV budget) completes ``--batch``
random prompts of ``--prompt-len`` tokens greedily. Reported:

1. wall time (median, min, max over ``--repeats`` synchronized calls after warm-up) of a call of
   one new token (the prompt's step and the first token) and of one of ``--max-tokens``;
2. host milliseconds spent in the engine's parts during those calls (`Engine.generate`,
   `Engine._launch`: a step's forward, or its graph's replay, and its sampling queued;
   `Engine._land`: the wait for a step's tokens and their bookkeeping; the sampler's host
   share), timed with no synchronization added;
3. on a GPU, the calls that made the host wait for the device in a call of 8 tokens
   (`torch.cuda.set_sync_debug_mode`; the read-back's event waits are not among them), each
   with the fp4rl frames it came from;
4. on a GPU, under `torch.profiler`, each call's kernels: how many, the span from the first to
   the last, the time some kernel ran (busy), and the gaps of more than 20 us where none ran
   (the GPU waiting for the host), the longest of them named by their neighbours.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
import time
import traceback
import warnings

import torch
from _timing import report, run_header
from hf_generate import engine_generate, make_engine, random_model

from fp4rl.model.presets import qwen3_30b_a3b
from fp4rl.rollout import engine as engine_module


def call_ms(run, repeats: int, sync) -> str:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return f"median {statistics.median(times):.2f}, min {min(times):.2f}, max {max(times):.2f}"


def host_timers(run, calls: int) -> list[str]:
    """Host ms inside the engine's parts over ``calls`` calls of ``run``."""
    spent = collections.defaultdict(list)
    parts = [(engine_module.Engine, name) for name in ("generate", "_launch", "_land")]
    parts.append((engine_module, "sample"))
    originals = []
    for owner, name in parts:
        fn = getattr(owner, name)
        originals.append((owner, name, fn))

        def timed(*args, _fn=fn, _name=name, **kwargs):
            start = time.perf_counter()
            out = _fn(*args, **kwargs)
            spent[_name].append((time.perf_counter() - start) * 1e3)
            return out

        setattr(owner, name, timed)
    try:
        for _ in range(calls):
            run()
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return [
        f"| {name} | {len(v) // calls} | {sum(v) / calls:.2f} | {statistics.median(v):.3f} "
        f"| {max(v):.3f} |"
        for name, v in spent.items()
    ]


def sync_points(run) -> list[str]:
    """The calls that made the host wait for the device during ``run``, with their frames."""
    seen = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack() if "fp4rl" in f.filename]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                            for f in frames[-1:-5:-1])  # fmt: skip
        if "synchronizing" in str(message):
            seen[where] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = shown
    found = [f"- {n} x {where or '(outside fp4rl)'}" for where, n in seen.most_common()]
    return found or ["- none"]


def kernel_gaps(run, label: str) -> tuple[list[str], list[str]]:
    """A table row of ``run``'s kernels under the profiler, and its three longest gaps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        run()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    first, last = events[0].time_range.start, max(e.time_range.end for e in events)
    busy, gaps, end = 0.0, [], events[0].time_range.start
    for before, e in zip([None, *events], events, strict=False):
        start = max(e.time_range.start, end)
        if before is not None and e.time_range.start - end > 20:
            gaps.append((e.time_range.start - end, before.name[:48], e.name[:48]))
        busy += max(0, e.time_range.end - start)
        end = max(end, e.time_range.end)
    gaps.sort(reverse=True)
    lines = [
        f"| {label} | {len(events)} | {(last - first) / 1e3:.2f} | {busy / 1e3:.2f} "
        f"| {sum(g for g, *_ in gaps) / 1e3:.2f} in {len(gaps)} |"
    ]
    return lines, [f"- {label}: {g:.0f} us after `{a}`, before `{b}`" for g, a, b in gaps[:3]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cuda", help="cpu runs a smoke check")
    parser.add_argument("--hidden", type=int, default=None, help="override (smoke checks)")
    args = parser.parse_args()
    for key in ("layers", "batch", "prompt_len", "max_tokens", "repeats"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shrink = {} if args.hidden is None else dict(
        hidden_size=args.hidden, vocab_size=1024, num_experts=16, moe_intermediate_size=64
    )  # fmt: skip
    config = qwen3_30b_a3b(
        num_hidden_layers=args.layers,
        max_position_embeddings=max(4096, args.prompt_len + args.max_tokens),
        **shrink,
    )
    torch.manual_seed(0)
    model = random_model(config, args.device)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (args.batch, args.prompt_len), generator=g)
    engine = make_engine(model, args.batch, args.prompt_len + args.max_tokens)
    one = engine_generate(engine, prompts, 1)
    full = engine_generate(engine, prompts, args.max_tokens)
    for run in (one, full, one, full):  # compiles kernels, captures graphs
        run()
    gc.collect()
    gc.disable()  # no collection inside a timed call
    lines = [
        run_header("python benchmarks/engine_host.py " + " ".join(sys.argv[1:])),
        "",
        f"{args.layers} layers, batch {args.batch}, prompts of {args.prompt_len} tokens, "
        f"greedy, BF16 experts and KV",
        "",
        f"- a call of 1 new token, ms: {call_ms(one, args.repeats, sync)}",
        f"- a call of {args.max_tokens} new tokens, ms: {call_ms(full, args.repeats, sync)}",
    ]
    for label, run in (("1 new token", one), (f"{args.max_tokens} new tokens", full)):
        lines += ["", f"Host ms per call of {label} (3 calls):", "",
                  "| part | calls per call | ms per call | median ms | max ms |",
                  "|---|---|---|---|---|", *host_timers(run, 3)]  # fmt: skip
    if cuda:
        lines += ["", "Calls that made the host wait for the device (a call of 8 tokens):", ""]
        lines += sync_points(engine_generate(engine, prompts, 8))
        rows, named = [], []
        sixteen = engine_generate(engine, prompts, 16)
        for label, run in (("1 new token", one), ("16 new tokens", sixteen)):
            run()
            r, n = kernel_gaps(run, label)
            rows, named = rows + r, named + n
        lines += ["", "Kernels under torch.profiler (ms):", "",
                  "| call | kernels | span | busy | idle gaps > 20 us |", "|---|---|---|---|---|",
                  *rows, "", "The longest gaps:", "", *named]  # fmt: skip
    gc.enable()
    report("engine_host.md", lines)


if __name__ == "__main__":
    main()
