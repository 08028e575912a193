"""``fp4rl export``: a policy checkpoint for serving, NVFP4 (compressed-tensors) or BF16."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4rl.commands import add_set_argument

HELP = "write a checkpoint for serving: NVFP4 routed experts (vLLM-loadable) or plain BF16"
DESCRIPTION = (
    "Export the policy of a Hugging Face checkpoint directory, or of a run directory (its "
    "latest complete checkpoints/step-NNNNNNNN/model), to the new directory OUT. nvfp4: the "
    "routed experts of the FP4 layers packed exactly as the rollout engine holds them, in "
    "compressed-tensors' nvfp4-pack-quantized layout (weight-only NVFP4A16 scheme); every "
    "other tensor BF16 and listed in quantization_config.ignore. bf16: the plain checkpoint. "
    "The precision plan and engine dtype come from the run's config.toml, or the defaults."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", type=Path, metavar="RUN_DIR|CHECKPOINT", help="a run or checkpoint directory"
    )
    parser.add_argument("out", type=Path, metavar="OUT", help="a new (or empty) directory")
    parser.add_argument(
        "--format", default="nvfp4", metavar="FORMAT", help="nvfp4 (default) or bf16"
    )
    add_set_argument(
        parser,
        help="override the run's precision (precision.bf16_last_layers=2) or the dtype the "
        "engine quantizes from (model.dtype=float32); repeatable; nvfp4 only",
    )
    parser.add_argument(
        "--device", default="cpu", help="where to quantize the experts: cpu (default) or cuda"
    )


def run(args: argparse.Namespace) -> None:
    from fp4rl.export import export

    print(export(args.source, args.out, format=args.format, overrides=args.set, device=args.device))
