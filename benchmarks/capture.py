"""Host cost of the rollout's capture: a step's records to the host, and the assembly per sequence.

    python benchmarks/capture.py --device cpu     # runs anywhere: the host's share of the cost
    python benchmarks/capture.py                  # one GPU: the copies are real device -> host

Drives `StepCapture` and `CaptureLog` as `fp4rl.rollout.engine` does, with records shaped like
the 4-layer Qwen3-30B-A3B-shaped model of `benchmarks/generate.py` (hidden 2048, expert
intermediate 768, top-8 of 128 experts, 4 KV heads of 128; every layer MoE with NVFP4 experts
and KV; compact guidance keeps the latter half): ``--prompts`` prompts of ``--prompt-len``
tokens prefilled in one step, each sampled ``--n`` times, then ``--steps`` decode steps of one
token per sequence. Per mode it reports the median milliseconds of one decode step's
``to_host`` + ``CaptureLog.add`` (what an eager step pays after its forward), of the graphed
step's host work (`PackedRows.to_host` of the rows its graph packed: one copy), of the
end-of-call ``assemble``, and of reading the records it made (which stay in the call's rows:
`fp4rl.records.RowRecords`): the whole batch's gathered at once, as `fp4rl.records.collate`
does, and (as collate does with any other records) every sequence's read on its own, then
concatenated; each with the steps' rows copied into the host
rows the engine hands over to its records (`fp4rl.rollout.rows.HostRows`, so they lie joined
at the end) and, as the baseline, each step's rows into fresh memory of their own (joined by
``assemble``). The records' values
are computed once, outside the timing (on a GPU the model computes them inside the step's
forward or graph).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _timing import report, run_header

from fp4rl.ops import quantize
from fp4rl.records import RowRecords, plan_of, record_cat
from fp4rl.rollout.capture import CaptureLog, SequenceCapture, StepCapture, kept_layers
from fp4rl.rollout.rows import HostRows

LAYERS, HIDDEN, INTERMEDIATE, TOP_K, EXPERTS, KV_HEADS, HEAD_DIM = 4, 2048, 768, 8, 128, 4, 128
MODES = {"routing": (True, None), "compact": (True, "compact"), "full": (True, "full")}


def step_records(rows: int, device: str, g: torch.Generator):
    """Each layer's top-k ids and its four sites' NVFP4 records, for ``rows`` tokens."""
    shapes = {
        "expert_input": (rows, HIDDEN),
        "expert_hidden": (rows, TOP_K, INTERMEDIATE),
        "k": (rows, KV_HEADS, HEAD_DIM),
        "v": (rows, KV_HEADS, HEAD_DIM),
    }
    sites = {
        (layer, site): quantize(torch.randn(shape, generator=g).to(device), scaling="row")
        for layer in range(LAYERS)
        for site, shape in shapes.items()
    }
    ids = {layer: torch.randint(0, EXPERTS, (rows, TOP_K), generator=g) for layer in range(LAYERS)}
    return {layer: t.to(device) for layer, t in ids.items()}, sites


def filled(mode: str, records) -> StepCapture:
    """A step's capture after its forward: what the model's sites and routers recorded."""
    routing, guidance = MODES[mode]
    kept = kept_layers(guidance, tuple(range(LAYERS)), 0.5)
    capture = StepCapture(
        routing=routing, guidance=guidance, keep={key for key in records[1] if key[0] in kept}
    )
    for layer, ids in records[0].items():
        capture.record_routing(layer, ids)
    for (layer, site), t in records[1].items():
        capture.record(layer, site, t)
    return capture


def call(prefill, decode, args, sync, graphed: bool, into) -> tuple:
    """One generate call's capture: each decode step's host time, the assembly's and the two
    reads' (ms). The
    steps' rows go into ``into`` (a `HostRows`), or into memory of their own when None."""
    num_seqs = args.prompts * args.n
    seqs, log = [SequenceCapture() for _ in range(num_seqs)], CaptureLog(into)
    into = log.host_rows if into is not None else None
    length = args.prompt_len
    spans = [(s, p * length, (p + 1) * length) for p in range(args.prompts)
             for s in seqs[p * args.n : (p + 1) * args.n]]  # fmt: skip
    log.add(prefill.to_host(into=into), args.prompts * length, spans)
    packed = decode.pack() if graphed else None  # what a decode graph packs as it replays
    steps = []
    for _ in range(args.steps):
        spans = [(s, i, i + 1) for i, s in enumerate(seqs)]
        sync()
        t0 = time.perf_counter()
        if graphed:
            host = decode.holding(packed.to_host(num_seqs, into))
        else:
            host = decode.to_host(num_seqs, into)
        log.add(host, num_seqs, spans)
        sync()
        steps.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    out = log.assemble(seqs, tuple(range(LAYERS)), TOP_K)
    sync()
    assemble = (time.perf_counter() - t0) * 1e3
    guidance = [sites for _, sites in out]
    t0 = time.perf_counter()
    if plan_of(guidance) is not None:  # what `collate` does with a batch's records
        RowRecords.gather(guidance)
    batch = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    read = [dict(sites) for sites in guidance]  # every record read, sequence by sequence,
    for key in read[0] if read else ():  # then concatenated (collate's path for other records)
        record_cat([r[key] for r in read])
    return steps, assemble, batch, (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64, help="decode steps per call")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (median reported)")
    parser.add_argument("--modes", default="routing,compact,full")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the engine's host work is one Python thread
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    prefill_records = step_records(args.prompts * args.prompt_len, args.device, g)
    decode_records = step_records(args.prompts * args.n, args.device, g)
    lines = [
        run_header(
            "python benchmarks/capture.py "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
        ),  # fmt: skip
        "",
        "| mode | steps' rows | eager decode step ms | graphed decode step ms | assemble ms "
        "| batch gathered ms | read one by one, concatenated ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in args.modes.split(","):
        prefill, decode = filled(mode, prefill_records), filled(mode, decode_records)
        for into in (HostRows(), None):  # the engine's, then the baseline: each its own memory
            row = [mode, "kept host rows" if into is not None else "own memory (baseline)"]
            for graphed in (False, True):
                runs = [
                    call(prefill, decode, args, sync, graphed, into)
                    for _ in range(args.repeats + 1)
                ]
                row.append(f"{statistics.median(t for r in runs[1:] for t in r[0]):.3f}")
            row += [f"{statistics.median(r[i] for r in runs[1:]):.1f}" for i in (1, 2, 3)]
            lines.append("| " + " | ".join(row) + " |")
    report("capture.md", lines)


if __name__ == "__main__":
    main()
