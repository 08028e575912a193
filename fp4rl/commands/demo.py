"""``fp4rl demo``: the built-in demo, RL on a tiny MoE at addition."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4rl.commands import add_cache_dir_argument, add_set_argument

HELP = "RL on a tiny MoE at addition, on any laptop (~2 min per seed on 2 CPU cores)"
DESCRIPTION = (
    "Warm up a tiny MoE on addition (cached), run GRPO from it with the NVFP4 engine and "
    "guided rounding, and print held-out accuracy before and after. Uses a CUDA GPU when one "
    "is present. Settings: fp4rl/configs/demo.toml. Every invocation writes new run "
    "directories, OUT_DIR/<UTC date-time>/seed<N> (config.toml, metrics.jsonl, checkpoints), so "
    "running it again starts afresh; a stopped one continues with "
    "`fp4rl train --resume OUT_DIR/<date-time>/seed<N>`, and `fp4rl report` draws it."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seeds", default="0", help="comma-separated seeds, one run each (default 0)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="GRPO steps (default: the config's)"
    )
    add_cache_dir_argument(parser)
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("runs/demo"),
        help="where each invocation makes its directory <UTC date-time>/seed<N> (default "
        "runs/demo)",
    )
    add_set_argument(parser)


def run(args: argparse.Namespace) -> None:
    from fp4rl import config, demo, metrics_log

    overrides = list(args.set) + ([f"run.steps={args.steps}"] if args.steps is not None else [])
    chosen = seeds(args.seeds)
    # Bad settings stop before a directory is made or a base policy is warmed up.
    if config.load(demo.CONFIG_FILE, overrides).run.tensorboard:
        metrics_log.check_tensorboard()
    out_dir = demo.new_run_dir(args.out_dir)
    demo.run(seeds=chosen, cache_dir=args.cache_dir, out_dir=out_dir, overrides=overrides)


def seeds(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated ints, got {text!r}") from None
    if any(s < 0 for s in values):
        raise ValueError(f"--seeds must be >= 0, got {text!r}")
    return values
