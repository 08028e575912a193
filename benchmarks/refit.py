"""Refit time of a Qwen3-30B-A3B-shaped MoE, trainer and engine colocated on one GPU.

    python benchmarks/refit.py                      # one H200: every layer that fits (48 do)
    python benchmarks/refit.py --device cpu --layers 2 --hidden 128 --repeats 1   # smoke check

The trainer is the QAT model in BF16 with every layer MoE and FP4 (no BF16 boundary layers);
each engine is built beside it, one at a time: BF16 experts, then NVFP4 experts (quantized at
load). A refit is ``RefitReceiver(engine).receive(refit_records(trainer, version, names=...))``
through the in-process path: every check, the quantization, the copies into the engine's
storage and the receiver's one host synchronization, timed with CUDA events from the first
record to the return; the median over ``--repeats`` after one warm-up refit (which also installs
the packed storage) is reported, for fp4rl's fused expert tensors and for the hub's per-expert
tensors. Measured in the same run:

- a plain device copy of the same BF16 bytes into the BF16 engine's parameters (the floor);
- NVFP4 quantization (one global scale per expert) of the routed-expert tensors of one layer,
  in one launch per tensor and in one launch per expert, against a device copy of the same
  tensors: bandwidth counted as BF16 bytes read per second, and as a fraction of the copy's.

``--layers auto`` takes as many layers as fit the trainer and the BF16 engine side by side; with
fewer than 48 the whole-model time is also given scaled by bytes (parameters) to 48 layers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _timing import median_ms, report, run_header

from fp4rl.model.checkpoint import parameter_shapes
from fp4rl.model.experts import PackedExperts
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import qwen3_30b_a3b
from fp4rl.model.transformer import build_model
from fp4rl.ops import quantize
from fp4rl.refit import RefitReceiver, refit_records
from fp4rl.rollout import Engine, EngineConfig

FULL_LAYERS = 48
HEADROOM = 8 << 30  # KV, one layer's staging, quantize outputs, allocator slack
ENGINE = EngineConfig(
    kv_memory_bytes=64 << 20, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=8
)


def shapes_of(config) -> tuple[int, int]:
    """``(bytes per decoder layer, bytes outside the layers)`` of the model in BF16."""
    shapes = parameter_shapes(config)
    per_layer = sum(2 * _numel(s) for n, s in shapes.items() if n.startswith("layers.0."))
    outside = sum(2 * _numel(s) for n, s in shapes.items() if not n.startswith("layers."))
    return per_layer, outside


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layers_that_fit(config, requested: str, cuda: bool) -> int:
    if requested != "auto":
        return int(requested)
    if not cuda:
        return 2
    per_layer, outside = shapes_of(config)
    free = torch.cuda.mem_get_info()[0]
    # The trainer and the BF16 engine hold the BF16 weights side by side.
    return max(1, min(FULL_LAYERS, (free - 2 * outside - HEADROOM) // (2 * per_layer)))


def timed_ms(fn, cuda: bool) -> float:
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_refits(engine, trainer, names, repeats, cuda, version) -> tuple[float, float, int]:
    """``(median ms, peak extra GiB, next version)`` of refits of ``engine`` from ``trainer``."""
    receiver = RefitReceiver(engine)
    receiver.receive(refit_records(trainer, version, names=names))  # warm-up
    version += 1
    times, peak = [], 0.0
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        records = refit_records(trainer, version, names=names)
        times.append(timed_ms(lambda r=records: receiver.receive(r), cuda))
        if cuda:
            peak = max(peak, (torch.cuda.max_memory_allocated() - base) / 2**30)
        version += 1
    return statistics.median(times), peak, version


@torch.no_grad()
def copy_all(pairs) -> None:
    for dst, src in pairs:
        dst.copy_(src)


def check_engine(engine, trainer) -> None:
    """The engine holds the trainer's weights (a spot check; tests/refit proves it in full)."""
    theirs = dict(trainer.named_modules())
    for name, m in engine.model.named_modules():
        if isinstance(m, PackedExperts):
            want = quantize(theirs[name].w13.detach(), scaling=2)
            assert m.w13_packed.equal(want), f"{name}.w13 differs from quantize(trainer)"
            break
    params = dict(trainer.named_parameters())
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, params[name]), f"{name} differs from the trainer's"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", default="auto", help="decoder layers, or 'auto'")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu runs a smoke check")
    parser.add_argument("--hidden", type=int, default=None, help="override (smoke checks)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    shrink = (
        {}
        if args.hidden is None
        else dict(
            hidden_size=args.hidden,
            vocab_size=1024,
            num_experts=16,
            moe_intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
        )
    )
    config = qwen3_30b_a3b(num_hidden_layers=1, max_position_embeddings=4096, **shrink)
    num_layers = layers_that_fit(config, args.layers, cuda)
    config = qwen3_30b_a3b(num_hidden_layers=num_layers, max_position_embeddings=4096, **shrink)
    per_layer, outside = shapes_of(config)
    model_bytes = num_layers * per_layer + outside
    full_bytes = FULL_LAYERS * per_layer + outside

    torch.manual_seed(0)
    all_fp4 = dict(bf16_first_layers=0, bf16_last_layers=0)
    trainer = build_model(config, PrecisionConfig(**all_fp4), fp4_experts="qat", device=args.device)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)

    rows, results, version = [], {}, 1
    for experts in ("bf16", "nvfp4"):
        precision = PrecisionConfig(experts=experts, **all_fp4)
        model = build_model(config, precision, fp4_experts="packed", device=args.device)
        engine = Engine(model, ENGINE)
        for names in ("fused", "hf"):
            ms, peak, version = time_refits(engine, trainer, names, args.repeats, cuda, version)
            results[experts, names] = ms
            rows.append((experts, names, ms, peak))
        check_engine(engine, trainer)
        if experts == "bf16":  # the floor: the same BF16 bytes copied, nothing else
            pairs = list(zip(model.parameters(), trainer.parameters(), strict=True))
            copy = [
                timed_ms(lambda pairs=pairs: copy_all(pairs), cuda)
                for _ in range(max(args.repeats, 3))
            ]
            results["copy"] = statistics.median(copy)
            del pairs  # it holds the BF16 engine's parameters, which must go before the next
        del engine, model
        if cuda:
            torch.cuda.empty_cache()

    base = results["bf16", "fused"]
    table = [
        "| engine | expert names | refit ms | vs BF16 engine (fused) | vs BF16 copy "
        f"| GB/s (BF16 bytes) | ms scaled to {FULL_LAYERS} layers | peak extra GiB |",
        "|---|---|---|---|---|---|---|---|",
        f"| (device copy of the BF16 bytes) | - | {results['copy']:.1f} | "
        f"{results['copy'] / base:.2f} | 1.00 | {model_bytes / results['copy'] / 1e6:,.0f} | "
        f"{results['copy'] * full_bytes / model_bytes:.1f} | - |",
    ]
    for experts, names, ms, peak in rows:
        table.append(
            f"| {experts} | {names} | {ms:.1f} | {ms / base:.2f} | {ms / results['copy']:.2f} | "
            f"{model_bytes / ms / 1e6:,.0f} | {ms * full_bytes / model_bytes:.1f} | {peak:.2f} |"
        )

    # Quantization of one layer's experts against a copy of the same tensors, same run.
    experts_of = [layer.mlp.experts for layer in trainer.layers]
    quant_rows = []
    for leaf in ("w13", "w2"):
        inputs = [getattr(e, leaf).detach() for e in experts_of[:4]]
        out = torch.empty_like(inputs[0])
        timing = dict(warmup=2, repeats=max(args.repeats, 3))
        copy_ms = median_ms(lambda w, out=out: out.copy_(w), inputs, **timing)
        batched_ms = median_ms(lambda w: quantize(w, scaling=2), inputs, **timing)
        per_expert_ms = median_ms(
            lambda w: [quantize(w[j : j + 1], scaling=2) for j in range(w.shape[0])],
            inputs,
            **timing,
        )
        nbytes = inputs[0].numel() * inputs[0].element_size()
        shape = "x".join(map(str, inputs[0].shape))
        for op, ms in (
            ("device copy", copy_ms),
            ("quantize, one launch", batched_ms),
            ("quantize, one launch per expert", per_expert_ms),
        ):
            quant_rows.append(
                f"| {leaf} [{shape}] | {op} | {ms:.3f} | {nbytes / ms / 1e6:,.0f} | "
                f"{copy_ms / ms:.2f} |"
            )
        del out

    report(
        "refit.md",
        [
            run_header("python benchmarks/refit.py " + " ".join(sys.argv[1:])),
            "",
            f"{num_layers} of {FULL_LAYERS} layers ({model_bytes / 2**30:.1f} GiB of BF16 "
            f"weights), every layer MoE with NVFP4 experts in the NVFP4 engine; in-process "
            f"refit, median of {args.repeats} after one warm-up",
            "",
            *table,
            "",
            "Per-expert quantization (one global scale per expert) vs a device copy of the same "
            "tensors; GB/s of BF16 read",
            "",
            "| tensor | op | ms | GB/s | vs copy |",
            "|---|---|---|---|---|",
            *quant_rows,
        ],
    )


if __name__ == "__main__":
    main()
