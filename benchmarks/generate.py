"""Rollout throughput and the cost of alignment capture, on one GPU.

    python benchmarks/generate.py            # one H200: a 4-layer Qwen3-30B-A3B-shaped model
    python benchmarks/generate.py --prompts 16 --n 4 --repeats 1 --warmup-tokens 16 --profile 25 \
        --variants "nvfp4 experts, nvfp4 kv;+ routing + compact guidance"  # where capture costs

Generates the same prompts with the same seeds under several engine settings and reports
generated tokens/s and capture bytes per generated token, each against the BF16-expert engine
and the uncaptured NVFP4 engine measured in the same run: the median wall time of ``--repeats``
runs after a warm-up run of the same call (± half the spread), the rows' runs interleaved (so
every row's engine, its model and its ``--kv-gib`` of KV, is held at once). Every layer is MoE
with NVFP4 experts (no BF16 boundary layers). On the GPU packed experts go through the fused
NVFP4 grouped GEMM and attention through the paged kernels; steps replay CUDA graphs
(`fp4rl.rollout.graphs`, `fp4rl.rollout.prefill_graphs`: all but those of more than 2,048
tokens), except in the rows marked eager, and the engine launches the next decode step before
reading a step's tokens (`EngineConfig.overlap_steps`), except in the rows taken one step at a
time.
``--max-num-seqs fit`` gives each engine as many seats as its pages hold sequences of the full
length, rounded down to a graph's batch (the row's label says how many): at one KV budget the
NVFP4 engine runs about 5× as many sequences at once as the BF16 one, which is where FP4 KV
pays in a rollout.
The ratios are against the graphed, overlapped engines. ``--cdf-orders probability,token`` runs
every row with each `SamplingParams.cdf_order` (the default draw sorts the vocabulary each step;
"token" does not), each order's ratios against the baselines of that order. The column
"paired" is the ratio to the uncaptured NVFP4 row taken repeat by repeat (its median): a small
cost such as a capture's shows there through the machine's drift. "steps" and "eager steps"
count the last timed call's steps and those of them that ran eagerly, not from a CUDA graph;
"preemptions" the sequences it preempted for want of KV blocks (recomputed later),
"graphs" and "capture s" the CUDA graphs it captured (on first use of a step's shape) and the
wall seconds that took. ``--release-kv`` gives every engine's KV pages back and takes them again
before each timed call, as the colocated GRPO loop does between rollouts (`fp4rl.loop`), and
prints what the release and acquire took and the device memory free between them (after
`torch.cuda.empty_cache`); ``--keep-graphs 0`` makes each such timed call
capture its graphs again (`EngineConfig.keep_graphs`; 1, the default, keeps them over pages at
reserved addresses). ``--capture-warmups`` sets the eager calls before each capture
(`fp4rl.rollout.graphs.CAPTURE_WARMUPS`), ``--capture-warmups-seen`` those before capturing a
shape the engine captured in an earlier call (`CAPTURE_WARMUPS_SEEN`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch
from _timing import report, run_header

from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import qwen3_30b_a3b
from fp4rl.model.transformer import build_model
from fp4rl.model.weights import load_weights
from fp4rl.records import capture_bytes_per_generated_token
from fp4rl.rollout import Engine, EngineConfig, SamplingParams, graphs
from fp4rl.rollout.model_layout import ModelLayout

VARIANTS = {  # name: (experts, kv, capture_routing, guidance, cuda_graphs, overlap_steps)
    "bf16 experts, bf16 kv, eager": ("bf16", "bf16", False, None, False, True),
    "bf16 experts, bf16 kv": ("bf16", "bf16", False, None, True, True),
    "bf16 experts, bf16 kv, one step at a time": ("bf16", "bf16", False, None, True, False),
    "nvfp4 experts, nvfp4 kv, eager": ("nvfp4", "nvfp4", False, None, False, True),
    "nvfp4 experts, nvfp4 kv": ("nvfp4", "nvfp4", False, None, True, True),
    "nvfp4 experts, nvfp4 kv, one step at a time": ("nvfp4", "nvfp4", False, None, True, False),
    "+ routing record": ("nvfp4", "nvfp4", True, None, True, True),
    "+ routing + full guidance": ("nvfp4", "nvfp4", True, "full", True, True),
    "+ routing + compact guidance": ("nvfp4", "nvfp4", True, "compact", True, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median reported)")
    parser.add_argument("--device", default="cuda", help="cpu runs a smoke check")
    parser.add_argument("--hidden", type=int, default=None, help="override (smoke checks)")
    parser.add_argument(
        "--variants", default="all", help=f"rows to run, separated by ;: {'; '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--warmup-tokens", type=int, default=None, help="new tokens of the warm-up call "
        "(default: --max-tokens; fewer keeps a long rollout's warm-up short; with "
        "--spread-lengths, each request's drawn length cut at this)"
    )  # fmt: skip
    parser.add_argument("--kv-gib", type=float, default=8.0, help="KV budget of each engine")
    parser.add_argument(
        "--max-num-seqs", default="256", help="EngineConfig.max_num_seqs of every engine, or "
        "'fit': of each engine, as many sequences of the full length as its --kv-gib of pages "
        "holds, rounded down to a graph's batch (at most 512; the NVFP4 pages hold about 5x the "
        "BF16 pages' tokens)"
    )  # fmt: skip
    parser.add_argument(
        "--cdf-orders", default="probability", help="comma-separated SamplingParams.cdf_order "
        "values: every row runs with each"
    )  # fmt: skip
    parser.add_argument(
        "--spread-lengths", action="store_true", help="each of the prompts x n samples a request "
        "of its own, of a length drawn uniformly from [max-tokens / 8, max-tokens] (seeded), as "
        "responses that stop at their own end of sequence: the decode batch shrinks through "
        "sizes between the graphs' buckets"
    )  # fmt: skip
    parser.add_argument(
        "--release-kv", action="store_true", help="release and acquire each engine's KV pages "
        "before each timed call (the colocated loop's rollouts: graphs captured every call)"
    )  # fmt: skip
    parser.add_argument(
        "--keep-graphs", type=int, choices=(0, 1), default=1,
        help="EngineConfig.keep_graphs: 1 keeps the graphs across --release-kv, 0 drops them",
    )  # fmt: skip
    parser.add_argument(
        "--capture-warmups", type=int, default=None,
        help="override fp4rl.rollout.graphs.CAPTURE_WARMUPS (eager calls before a capture)",
    )  # fmt: skip
    parser.add_argument(
        "--capture-warmups-seen", type=int, default=None,
        help="override fp4rl.rollout.graphs.CAPTURE_WARMUPS_SEEN (eager calls before capturing "
        "a shape the engine captured before)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=int, default=0, help="also print, per row, the N ops that take most "
        "device time in one more call of --warmup-tokens new tokens (torch.profiler)"
    )  # fmt: skip
    args = parser.parse_args()
    chosen = list(VARIANTS) if args.variants == "all" else args.variants.split(";")
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown rows {unknown}; choose from {list(VARIANTS)}")
    if args.capture_warmups is not None:
        graphs.CAPTURE_WARMUPS = args.capture_warmups
    if args.capture_warmups_seen is not None:
        graphs.CAPTURE_WARMUPS_SEEN = args.capture_warmups_seen
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shrink = (
        {}
        if args.hidden is None
        else dict(
            hidden_size=args.hidden, vocab_size=1024, num_experts=16, moe_intermediate_size=64
        )
    )
    config = qwen3_30b_a3b(
        num_hidden_layers=args.layers,
        max_position_embeddings=max(4096, args.prompt_len + args.max_tokens),
        **shrink,
    )
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (args.prompts, args.prompt_len), generator=g)
    prompts = prompts.tolist()
    orders = args.cdf_orders.split(",")
    for order in orders:
        SamplingParams(cdf_order=order)  # a misspelt order fails here, before the models load
    sampling = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=1.0, seed=0, ignore_eos=True
    )
    # One set of BF16 weights; each engine's model loads it (packed experts quantize at load).
    source = build_model(config, PrecisionConfig(experts="bf16"), device=args.device)
    torch.manual_seed(0)  # the same weights in every run of the script
    with torch.no_grad():
        for name, p in source.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    weights = source.state_dict()
    rows, base, base_runs = [], {}, {}
    warmup = dataclasses.replace(sampling, max_tokens=args.warmup_tokens or args.max_tokens)
    lengths = f"{args.max_tokens} new tokens each"
    if args.spread_lengths:
        low = max(1, args.max_tokens // 8)
        drawn = torch.randint(low, args.max_tokens + 1, (args.prompts * args.n,), generator=g)
        prompts = [p for p in prompts for _ in range(args.n)]
        sampling = [dataclasses.replace(sampling, n=1, max_tokens=m) for m in drawn.tolist()]
        # The timed call's lengths, cut at --warmup-tokens: without the cut the warm-up meets
        # every batch size, and so every graph, the timed calls meet.
        cap = args.warmup_tokens or args.max_tokens
        warmup = [dataclasses.replace(p, max_tokens=min(p.max_tokens, cap)) for p in sampling]
        lengths = f"new tokens drawn uniformly from [{low}, {args.max_tokens}] per sample"
    max_model_len = -(-(args.prompt_len + args.max_tokens) // 16) * 16
    models, engines = {}, {}
    for name in chosen:
        experts, kv = VARIANTS[name][:2]
        precision = PrecisionConfig(
            experts=experts, kv_cache=kv, bf16_first_layers=0, bf16_last_layers=0
        )
        models[name] = build_model(config, precision, fp4_experts="packed", device=args.device)
        load_weights(models[name], weights)
    # The source weights go before any KV is allocated: at 48 layers a BF16 copy is 57 GiB.
    del source, weights, p
    if cuda:
        torch.cuda.empty_cache()
    seats = {}
    for name in chosen:
        experts, kv, routing, guidance, graphed, overlap = VARIANTS[name]
        seats[name] = _seats(models[name], args, max(1024, max_model_len))
        engines[name] = Engine(
            models.pop(name),
            EngineConfig(
                kv_memory_bytes=int(args.kv_gib * 2**30),
                max_model_len=max(1024, max_model_len),
                max_num_seqs=seats[name],
                capture_routing=routing,
                guidance=guidance,
                cuda_graphs=graphed,
                overlap_steps=overlap,
                keep_graphs=bool(args.keep_graphs),
            ),
        )
        # Warm-up: the call timed (shorter with --warmup-tokens), so kernels compile before the
        # clock runs.
        engines[name].generate(prompts, warmup)
    # Each repeat times every row once, in an order rotated by one per repeat, so that the
    # machine's drift over the run falls on all rows alike.
    runs = [(name, order) for name in chosen for order in orders]
    times, outs, stats = {run: [] for run in runs}, {}, {}
    swaps, free = [], []  # wall seconds of each release_kv + acquire_kv; free bytes between
    for r in range(args.repeats):
        for name, order in runs[r % len(runs) :] + runs[: r % len(runs)]:
            if args.release_kv:
                sync()
                start = time.perf_counter()
                engines[name].release_kv()
                if cuda:  # what a trainer could take meanwhile, the graphs' pool aside
                    sync()
                    torch.cuda.empty_cache()
                    free.append(torch.cuda.mem_get_info()[0])
                engines[name].acquire_kv()
                sync()
                swaps.append(time.perf_counter() - start)
            sync()
            start = time.perf_counter()
            stats[name, order] = {}  # the last run's
            outs[name, order] = engines[name].generate(
                prompts, _in_order(sampling, order), stats=stats[name, order]
            )
            sync()
            times[name, order].append(time.perf_counter() - start)
    for name, order in sorted(runs, key=lambda run: orders.index(run[1])):
        experts, kv, routing, guidance, graphed, overlap = VARIANTS[name]
        seconds = statistics.median(times[name, order])
        spread = (max(times[name, order]) - min(times[name, order])) / seconds
        out = outs[name, order]
        generated = sum(len(c.completion_ids) for c in out)
        tok_s = generated / seconds
        if (graphed or not cuda) and overlap:  # the baselines: graphed engines, uncaptured
            if experts == "bf16":
                base.setdefault((order, "bf16"), tok_s)
            elif not routing and guidance is None:
                base[order, "fp4"] = tok_s
                base_runs[order] = (times[name, order], generated)
        capture = capture_bytes_per_generated_token(out)
        last = stats[name, order]
        label = name if order == "probability" else f"{name}, {order}-order CDF"
        if args.max_num_seqs == "fit":
            label += f" ({seats[name]} seats)"
        rows.append(
            f"| {label} | {seconds:.2f} ±{100 * spread / 2:.0f}% | {tok_s:,.0f} | "
            f"{_ratio(tok_s, base.get((order, 'bf16')))} | "
            f"{_ratio(tok_s, base.get((order, 'fp4')))} | "
            f"{_paired(times[name, order], generated, base_runs.get(order))} | "
            f"{capture['routing']:,.0f} | {capture['guidance']:,.0f} | "
            f"{last['steps']:,} | {last['eager_steps']:,} | {last['preemptions']:,} | "
            f"{last['graphs_captured']} | {last['capture_seconds']:.2f} |"
        )
        if args.profile and order == orders[0]:
            profile_call(engines[name], prompts, _in_order(warmup, order), args.profile, name, cuda)
    report(
        "generate.md",
        [
            run_header("python benchmarks/generate.py " + " ".join(sys.argv[1:])),
            "",
            f"{args.layers} layers, {args.prompts} prompts x {args.prompt_len} tokens, "
            f"n={args.n}, {lengths}",
            "",
            "| engine | seconds | generated tok/s | vs bf16 | vs nvfp4 uncaptured "
            "| paired | routing B/tok | guidance B/tok | steps | eager steps | preemptions "
            "| graphs | capture s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            *(
                [
                    "",
                    f"release_kv + acquire_kv (keep_graphs={bool(args.keep_graphs)}): median "
                    f"{statistics.median(swaps):.3f} s, max {max(swaps):.3f} s over "
                    f"{len(swaps)}; device memory free between the two: "
                    f"{min(free, default=0) / 2**30:.2f} GiB",
                ]
                if swaps
                else []
            ),
        ],
    )


def _seats(model, args, max_model_len: int) -> int:
    """The engine's max_num_seqs: ``--max-num-seqs``, or with 'fit' the largest graph batch
    (`graphs.BUCKETS`) of sequences of ``max_model_len`` tokens that the KV budget holds."""
    if args.max_num_seqs != "fit":
        return int(args.max_num_seqs)
    tokens = int(args.kv_gib * 2**30) // ModelLayout.of(model).kv.bytes_per_token()
    held = tokens // max_model_len
    # Down to a graph's batch: 261 seats would pad every full step to the 288 graph (5 % slower
    # than 256 at equal lengths on one H200, BENCHMARKS.md "A whole rollout with the seats its
    # KV holds").
    return max((b for b in graphs.BUCKETS if b <= held), default=1)


def _in_order(sampling, order: str):
    """The call's SamplingParams (one, or one per prompt) with ``cdf_order=order``."""
    if isinstance(sampling, list):
        return [dataclasses.replace(p, cdf_order=order) for p in sampling]
    return dataclasses.replace(sampling, cdf_order=order)


def profile_call(engine, prompts, sampling, top: int, title: str, cuda: bool) -> None:
    """The ``top`` ops of one ``generate`` call by device time (by CPU time without a GPU), with
    the call's wall time and the device time summed over every kernel: where a capture's cost
    goes (its kernels inside the graphs, the step's concatenation and copy to pinned memory,
    the host's share)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        engine.generate(prompts, sampling)
        sync()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    key = "device_time_total" if cuda else "cpu_time_total"
    busy = sum(e.self_device_time_total for e in events) / 1e3 if cuda else float("nan")
    tokens = max(p.max_tokens for p in (sampling if isinstance(sampling, list) else [sampling]))
    print(f"### {title}: one call of up to {tokens} new tokens, {wall * 1e3:.1f} ms wall "
          f"(profiled), {busy:.1f} ms of kernels")  # fmt: skip
    print(events.table(sort_by=key, row_limit=top, max_name_column_width=70), flush=True)


def _paired(seconds: list[float], generated: int, base_run) -> str:
    """Against the uncaptured NVFP4 row repeat by repeat: the median over repeats of that
    repeat's tok/s ratio (the two runs of a repeat are neighbours in time, so the machine's
    drift largely cancels, which the ratio of the medians leaves in); a dash where that row was
    not run before."""
    if base_run is None:
        return "—"
    base_seconds, base_generated = base_run
    ratios = [
        (generated / t) / (base_generated / b) for t, b in zip(seconds, base_seconds, strict=True)
    ]
    return f"{statistics.median(ratios):.3f}"


def _ratio(tok_s: float, base: float | None) -> str:
    """Against a baseline row of the same run; a dash when that row was not run before."""
    return "—" if base is None else f"{tok_s / base:.3f}"


if __name__ == "__main__":
    main()
