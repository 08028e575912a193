"""Decode steps of the whole Qwen3-30B-A3B shape: NVFP4 engine against BF16 engine, with the
memory roofline of each step beside it.

    python benchmarks/decode.py                       # one H200: 48 layers, three cases
    python benchmarks/decode.py --device cpu --layers 2 --hidden 64 --cases 2x64   # smoke check
    python benchmarks/decode.py --device cpu --layers 2 --hidden 128 --cases 1x64 --steps 2 \\
        --repeats 1 --count-ops               # the aten ops of a decode step, per layer

Each case is ``BATCHxCONTEXT``: that many sequences, each with that many tokens already in the
cache, decoding one token per step. Prefill is not run: the KV pages are filled with random K/V
written through the cache's own write path (the NVFP4 pages quantized per token-head by the
recipe), so a case of 64 sequences at context 4k costs no 262k-token prefill. The engine's
decode-step graph (`fp4rl.rollout.graphs`) is then replayed for ``--steps`` consecutive
positions, ``--repeats`` times, timed with CUDA events; the median and the spread are reported.

Three times per step:
- ``GPU ms``: the graphs replayed back to back (inputs staged from the host between them, no
  wait for the device): what the GPU needs for a step;
- ``engine ms``: what an engine step costs end to end without the scheduler: stage, replay, the
  engine's check of the logits, the sampler on them (temperature 1; ``--cdf-orders`` times the
  draw of each `SamplingParams.cdf_order` given, a row each), the copy of the results to
  pinned host memory and the host reading them. As the engine runs by default
  (`EngineConfig.overlap_steps`), the next step is launched before a step's results are read,
  its tokens taken from that step's samples on the device; ``one at a time`` reads each step's
  results before launching the next;
- the memory roofline: bytes a step must move over the device-to-device copy bandwidth measured
  in the same run (`_timing.copy_bandwidth`, as the other benchmarks' rooflines). Bytes: the
  distinct experts the step's tokens routed to in each layer (counted from the step's routing
  record), each layer's dense weights (attention, norms, router), the final norm and lm_head,
  the KV of every context token in every layer, and the logits written.

Weights are random BF16 (std 0.02) in the BF16 engine; the NVFP4 engine loads the same weights
and quantizes its routed experts at load, every layer FP4 and every layer's KV NVFP4. The
NVFP4 engine runs all cases first, then is freed, so that the BF16 engine's larger KV fits. A
case whose pages do not fit beside an engine's weights (BF16's at 512 x 2048: 97 GiB) gets a
row that says so, and the other cases run.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time

import torch
from _decode_steps import count_ops, decode_step, profile_case
from _timing import copy_bandwidth, report, run_header

from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import qwen3_30b_a3b
from fp4rl.model.transformer import build_model
from fp4rl.model.weights import load_weights
from fp4rl.rollout import Engine, EngineConfig, SamplingParams
from fp4rl.rollout.attention import Segment
from fp4rl.rollout.block_manager import BlockTable
from fp4rl.rollout.capture import StepCapture
from fp4rl.rollout.device_memory import DriverError
from fp4rl.rollout.model_layout import ModelLayout
from fp4rl.rollout.read_back import bad_rows, queue_read_back
from fp4rl.rollout.sampler import Draws, make_generator, sample
from fp4rl.rollout.sequence import placeholder

BLOCK = 16


def parse_case(text: str) -> tuple[int, int]:
    try:
        batch, context = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(
            f"--cases takes BATCHxCONTEXT entries such as 64x4096, got {text!r}"
        ) from None
    if batch < 1 or context < 1:
        raise SystemExit(f"--cases entry {text!r} needs a batch and a context of at least 1")
    return batch, context


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_bytes(experts) -> int:
    """Bytes of one routed expert as the engine stores it (packed or BF16)."""
    packed = getattr(experts, "w13_packed", None)
    if packed is not None:
        total = nbytes(packed.tensors()) + nbytes(experts.w2_packed.tensors())
    else:
        total = nbytes(experts.parameters())
    return total // experts.num_experts


def dense_layer_bytes(layer) -> int:
    """A decoder layer's weights other than its routed experts."""
    experts = {id(t) for t in itertools.chain(layer.mlp.experts.parameters(),
                                              layer.mlp.experts.buffers())}  # fmt: skip
    return nbytes(
        t for t in itertools.chain(layer.parameters(), layer.buffers()) if id(t) not in experts
    )


def fill_cache(engine: Engine, num_slots: int, generator: torch.Generator) -> None:
    """Random K/V in the first ``num_slots`` slots of every layer, through the write path."""
    spec, cache = engine.layout.kv, engine.cache
    device = engine.layout.device
    chunk = 1 << 16
    for layer in range(len(spec.layer_formats)):
        for first in range(0, num_slots, chunk):
            slots = torch.arange(first, min(num_slots, first + chunk), device=device)
            shape = (len(slots), spec.num_kv_heads, spec.head_dim)
            k, v = (
                torch.randn(shape, generator=generator, device=device, dtype=spec.dtype)
                for _ in range(2)
            )
            cache.write(layer, slots, k, v)


class Clock:
    """CUDA events on the GPU, wall clock on the CPU (smoke checks)."""

    def __init__(self, device) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


def engine_steps(engine: Engine, segments, tokens, params, overlap: bool) -> None:
    """``len(tokens)`` decode steps as the engine takes them, without the scheduler: each step's
    logits checked and sampled, the results queued to pinned host memory and read there. With
    ``overlap`` a step is launched before the previous one's results are read, its tokens the
    previous step's samples on the device (placeholders), as `Engine.generate` does."""
    batch = len(tokens[0])
    generators = [Draws(make_generator(0, i, 0)) for i in range(batch)]  # as the engine draws
    ahead = [placeholder(i) for i in range(batch)]
    pending = None  # (samples, queued read-back) of a step not read yet

    def read(queued) -> None:
        host, landed = queued
        if landed is not None:
            landed.synchronize()
        host.tolist()

    for s, step_tokens in enumerate(tokens):
        sampled = None
        if pending is not None:  # this step's tokens are the previous step's samples
            step_tokens, sampled = ahead, pending[0].token_ids_B
        logits, _ = decode_step(engine, segments(s), step_tokens, sampled_S=sampled)
        out = sample(logits, params, generators)
        queued = queue_read_back(bad_rows(logits), out)
        if pending is not None:
            read(pending[1])
        pending = (out, queued)
        if not overlap:
            read(queued)
            pending = None
    if pending is not None:
        read(pending[1])


def time_case(engine: Engine, batch: int, context: int, steps: int, repeats: int, orders):
    """(GPU ms per step, {CDF order: engine ms per step}, {CDF order: engine ms per step one
    step at a time}: one entry per repeat; distinct experts per MoE layer in the first step).
    The engine steps sample at temperature 1 with each of ``orders`` (`SamplingParams.cdf_order`)
    in turn."""
    device = engine.layout.device
    per_seq = math.ceil((context + steps) / BLOCK)
    # The engine's own tables: staging copies their int64 arrays.
    tables = [BlockTable(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    generator = torch.Generator(device=device).manual_seed(batch * 7919 + context)
    fill_cache(engine, batch * per_seq * BLOCK, generator)
    vocab = engine.layout.vocab_size
    tokens = torch.randint(0, vocab, (steps, batch), generator=torch.Generator().manual_seed(1))
    tokens = tokens.tolist()
    params = {
        order: [SamplingParams(temperature=1.0, max_tokens=steps, cdf_order=order)] * batch
        for order in orders
    }

    def segments(step: int) -> list[Segment]:
        return [Segment(t, context + step, 1) for t in tables]

    with torch.inference_mode():
        capture = StepCapture(routing=True, guidance=None, keep=frozenset())
        _, out = decode_step(engine, segments(0), tokens[0], capture)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the records' copy to the host has landed
        distinct = [len(torch.unique(ids)) for ids in out.routing.values()]
        gpu = []
        overlapped = {order: [] for order in orders}
        one_at_a_time = {order: [] for order in orders}
        for _ in range(repeats + 1):  # the first pass warms the graphs and the sampler up
            with Clock(device) as clock:
                for s in range(steps):
                    decode_step(engine, segments(s), tokens[s])
            gpu.append(clock.ms / steps)
            for order in orders:
                for overlap, times in ((True, overlapped), (False, one_at_a_time)):
                    with Clock(device) as clock:
                        engine_steps(engine, segments, tokens, params[order], overlap)
                    times[order].append(clock.ms / steps)
    return (
        gpu[1:],
        {order: times[1:] for order, times in overlapped.items()},
        {order: times[1:] for order, times in one_at_a_time.items()},
        distinct,
    )


def make_engine(model, num_blocks: int, max_len: int, batch: int) -> Engine:
    """An engine whose KV budget buys exactly ``num_blocks`` blocks."""
    per_block = ModelLayout.of(model).kv.bytes_per_token() * BLOCK
    return Engine(
        model,
        EngineConfig(
            kv_memory_bytes=num_blocks * per_block,
            max_model_len=max_len,
            max_num_seqs=batch,
            block_size=BLOCK,
        ),
    )


def step_bytes(engine: Engine, distinct: list[int], batch: int, context: int) -> int:
    """Bytes one decode step must move at the least (see the module docstring)."""
    model = engine.model
    total = 0
    for layer in model.layers:
        total += dense_layer_bytes(layer)
    moe = [layer.mlp.experts for layer in model.layers if hasattr(layer.mlp, "experts")]
    total += sum(d * expert_bytes(e) for d, e in zip(distinct, moe, strict=True))
    total += nbytes(itertools.chain(model.norm.parameters(), model.lm_head.parameters()))
    total += batch * context * engine.layout.kv.bytes_per_token()
    total += batch * engine.layout.vocab_size * model.lm_head.weight.element_size()  # logits
    return total


def _spread(values: list[float]) -> float:
    """Half the spread, in percent of the median."""
    return 50 * (max(values) - min(values)) / statistics.median(values)


def _shrink(hidden: int) -> dict:
    return dict(hidden_size=hidden, vocab_size=1024, num_experts=16, moe_intermediate_size=64)


def build_models(config, device):
    """The BF16 engine's model (random weights) and the NVFP4 engine's, loaded from it."""
    bf16 = build_model(
        config,
        PrecisionConfig(experts="bf16", kv_cache="bf16", bf16_first_layers=0, bf16_last_layers=0),
        device=device,
    )
    torch.manual_seed(0)  # the same weights in every run of the script
    with torch.no_grad():
        for name, p in bf16.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    fp4 = build_model(
        config,
        PrecisionConfig(experts="nvfp4", kv_cache="nvfp4", bf16_first_layers=0, bf16_last_layers=0),
        fp4_experts="packed",
        device=device,
    )
    load_weights(fp4, bf16.state_dict())
    return {"nvfp4": fp4, "bf16": bf16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--cases", default="1x1024,64x4096,256x2048",
                        help="comma-separated BATCHxCONTEXT")  # fmt: skip
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu runs a smoke check")
    parser.add_argument("--hidden", type=int, default=None, help="override (smoke checks)")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engines' longest sequence, so their graphs' block tables (default: each case's "
        "context + steps; a rollout's engine is sized for its longest sequence, and the contexts "
        "fill part of the table)",
    )
    parser.add_argument(
        "--cdf-orders",
        default="probability",
        help="comma-separated SamplingParams.cdf_order values the engine steps sample with, "
        "each timed in turn (probability: the default draw, which sorts the vocabulary; token: "
        "no sort)",
    )
    parser.add_argument(
        "--profile", type=int, default=0, help="also print the N kernels that take most GPU time"
    )
    parser.add_argument(
        "--count-ops", action="store_true", help="also print the aten ops of a decode step"
    )
    parser.add_argument(
        "--plain-launches",
        action="store_true",
        help="launch every kernel plainly, not dependently (fp4rl.kernels.dependent_launch)",
    )
    parser.add_argument(
        "--early-dependents-max-batch",
        type=int,
        default=None,
        help="override fp4rl.rollout.graphs.EARLY_DEPENDENTS_MAX_BATCH (0: no graph early)",
    )
    parser.add_argument(
        "--store-at-exit-min-decodes",
        type=int,
        default=None,
        help="override fp4rl.rollout.attention.STORE_AT_EXIT_MIN_DECODES (a large value: the "
        "K/V store early like every other kernel)",
    )
    parser.add_argument(
        "--permuted-rows",
        action="store_true",
        help="the NVFP4 experts' GEMM rows stored as their register kernel reads them "
        "(fp4rl.kernels.moe_gemm.PERMUTED_ROWS, a trial switch)",
    )
    args = parser.parse_args()
    if args.permuted_rows:
        from fp4rl.kernels import moe_gemm

        moe_gemm.PERMUTED_ROWS = True
    if args.plain_launches:
        from fp4rl.kernels import dependent_launch

        dependent_launch.ENABLED = False
    if args.early_dependents_max_batch is not None:
        from fp4rl.rollout import graphs

        graphs.EARLY_DEPENDENTS_MAX_BATCH = args.early_dependents_max_batch
    if args.store_at_exit_min_decodes is not None:
        from fp4rl.rollout import attention

        attention.STORE_AT_EXIT_MIN_DECODES = args.store_at_exit_min_decodes
    cases = [parse_case(c) for c in args.cases.split(",")]
    orders = args.cdf_orders.split(",")
    for order in orders:
        SamplingParams(cdf_order=order)  # a misspelt order fails here, before the models load
    cuda = args.device == "cuda"
    shrink = {} if args.hidden is None else _shrink(args.hidden)
    max_len = max(max(c for _, c in cases) + args.steps + BLOCK, args.max_model_len or 0)
    config = qwen3_30b_a3b(num_hidden_layers=args.layers, max_position_embeddings=max_len, **shrink)
    bandwidth = copy_bandwidth(args.device) * 1e9 if cuda else float("nan")
    models = build_models(config, args.device)
    rows, results, unfit = [], {}, {}
    for name in ("nvfp4", "bf16"):
        model = models[name]
        for batch, context in cases:
            per_seq = math.ceil((context + args.steps) / BLOCK)
            table = max(per_seq * BLOCK, args.max_model_len or 0)
            try:
                engine = make_engine(model, max(batch * per_seq, table // BLOCK), table, batch)
            except (DriverError, torch.OutOfMemoryError) as err:
                if "out of memory" not in str(err):
                    raise
                # Pages for every sequence at full length do not fit beside this engine's
                # weights (BF16's at 512 x 2048): the case is reported as such, the rest run.
                unfit[(name, batch, context)] = str(err).splitlines()[0]
                print(f"{name} {batch}x{context}: does not fit: {unfit[(name, batch, context)]}")
                _empty_cache(cuda)
                continue
            gpu, step, serial, distinct = time_case(
                engine, batch, context, args.steps, args.repeats, orders
            )
            if args.profile:
                profile_case(engine, batch, context, args.profile, f"{name} {batch}x{context}")
            if args.count_ops:
                count_ops(engine, batch, context, f"{name} {batch}x{context}")
            moved = step_bytes(engine, distinct, batch, context)
            results[(name, batch, context)] = (gpu, step, serial, moved, distinct)
            del engine
            _empty_cache(cuda)
        del models[name], model
        _empty_cache(cuda)
    for (batch, context), order in itertools.product(cases, orders):
        bf16 = results.get(("bf16", batch, context))
        base = statistics.median(bf16[1][order]) if bf16 else None
        for name in ("bf16", "nvfp4"):
            if (name, batch, context) in unfit:
                rows.append(
                    f"| {batch} x {context} | {name} | {order} | its pages do not fit beside "
                    "the weights |" + " — |" * 9
                )
                continue
            gpu, step, serial, moved, distinct = results[(name, batch, context)]
            step, serial = step[order], serial[order]
            g, s = statistics.median(gpu), statistics.median(step)
            roof = moved / bandwidth * 1e3
            rows.append(
                f"| {batch} x {context} | {name} | {order} | {g:.2f} ±{_spread(gpu):.0f}% | "
                f"{s:.2f} ±{_spread(step):.0f}% | {statistics.median(serial):.2f} | "
                f"{batch / s * 1e3:,.0f} | {f'{base / s:.2f}x' if base else '—'} | "
                f"{moved / 2**30:.2f} | {roof:.2f} | {100 * roof / g:.0f} % | "
                f"{100 * (1 - g / s):.0f} % | {statistics.mean(distinct):.0f} |"
            )
    report(
        "decode.md",
        [
            run_header("python benchmarks/decode.py " + " ".join(sys.argv[1:])),
            "",
            f"{args.layers} layers, every layer FP4 in the nvfp4 engine; {args.steps} steps per "
            f"repeat, median of {args.repeats}; copy bandwidth {bandwidth / 1e9:,.0f} GB/s "
            "(read + write)"
            + ("; every kernel launched plainly" if args.plain_launches else "")
            + ("; the experts' rows stored permuted (PERMUTED_ROWS)" if args.permuted_rows else ""),
            "",
            "| batch x context | engine | CDF order | GPU ms/step | engine ms/step "
            "| one at a time ms/step | tok/s | vs bf16 | GiB/step | roofline ms | GPU at roofline "
            "| host share | experts/layer |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ],
    )


def _empty_cache(cuda: bool) -> None:
    if cuda:
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
