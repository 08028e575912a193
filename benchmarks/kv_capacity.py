"""KV tokens that fit on one GPU after the engine's weights: NVFP4 stack against BF16 stack.

    python benchmarks/kv_capacity.py                      # the GPU's own memory (CUDA)
    python benchmarks/kv_capacity.py --gpu-memory-gib 140 # the arithmetic, anywhere

The full 48-layer Qwen3-30B-A3B shape, built on the meta device (no memory): the engine's weight
bytes are its parameters plus, for packed experts, the NVFP4 layout the engine holds (codes at
4 bits, one E4M3 scale per 16 values, one FP32 global scale per expert and tensor); KV bytes per
token are the engine's own `KVCacheSpec.bytes_per_token`. Tokens = (GPU memory − weights) /
KV bytes per token. Activations, the CUDA context and graph pools come out of the same memory
for both stacks and are left out (on an H200 they are a few GiB against the ~80-120 GiB of KV).
"""

from __future__ import annotations

import argparse
import sys

import torch
from _timing import report, run_header

from fp4rl.fp4 import BLOCK_SIZE
from fp4rl.model.experts import PackedExperts
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import qwen3_30b_a3b
from fp4rl.model.transformer import build_model
from fp4rl.rollout.model_layout import ModelLayout

STACKS = {
    "BF16 experts, BF16 KV": PrecisionConfig(experts="bf16", kv_cache="bf16"),
    "NVFP4 experts, NVFP4 KV, every layer": PrecisionConfig(
        kv_cache="nvfp4", bf16_first_layers=0, bf16_last_layers=0
    ),
    "NVFP4 experts, NVFP4 KV, default plan": PrecisionConfig(kv_cache="nvfp4"),
}


def packed_bytes(experts: PackedExperts, hidden: int) -> int:
    """Bytes of the NVFP4 W13 [E, 2I, H] and W2 [E, H, I] the engine holds for one layer."""
    E, I = experts.num_experts, experts.intermediate
    values = E * (2 * I * hidden + hidden * I)
    return values // 2 + values // BLOCK_SIZE + 2 * E * 4


def weight_bytes(model, hidden: int) -> int:
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    packed = sum(packed_bytes(m, hidden) for m in model.modules() if isinstance(m, PackedExperts))
    return dense + packed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="memory to fill; default: the CUDA device's total (required without CUDA)",
    )
    args = parser.parse_args()
    if args.gpu_memory_gib is None:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: give --gpu-memory-gib")
        total = torch.cuda.mem_get_info()[1]
        where = torch.cuda.get_device_name()
    else:
        total = int(args.gpu_memory_gib * 2**30)
        where = f"{args.gpu_memory_gib} GiB given"
    config = qwen3_30b_a3b(num_hidden_layers=args.layers)
    rows, base = [], None
    for name, precision in STACKS.items():
        model = build_model(config, precision, fp4_experts="packed", device="meta")
        weights = weight_bytes(model, config.hidden_size)
        per_token = ModelLayout.of(model).kv.bytes_per_token()
        tokens = (total - weights) // per_token
        base = base or tokens
        rows.append(
            f"| {name} | {weights / 2**30:.1f} | {(total - weights) / 2**30:.1f} | "
            f"{per_token:,} | {tokens:,} | {tokens / base:.2f}x |"
        )
    report(
        "kv_capacity.md",
        [
            run_header("python benchmarks/kv_capacity.py " + " ".join(sys.argv[1:])),
            "",
            f"{args.layers} layers of Qwen3-30B-A3B, memory {total / 2**30:.1f} GiB ({where})",
            "",
            "| engine | weights GiB | left for KV GiB | KV bytes/token | tokens | vs BF16 |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
        ],
    )


if __name__ == "__main__":
    main()
