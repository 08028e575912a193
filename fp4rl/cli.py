"""The ``fp4rl`` command: ``fp4rl train`` runs GRPO from a TOML config, ``fp4rl demo`` the
built-in demo. Bad input exits with status 2 and a one-line cause naming the offending value."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SET_HELP = (
    "override one setting, as section.key=value (repeatable); the value is read as TOML "
    "(3, 1e-5, true, [1, 2]) or else as a plain string, e.g. --set precision.kv_cache=nvfp4"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4rl",
        description="GRPO post-training of MoE language models with NVFP4 rollouts kept "
        "aligned with the trainer.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="run GRPO from a config file",
        description="Run GRPO: rollouts on the NVFP4 engine, rewards of the built-in task, "
        "updates of the QAT trainer with router replay and guided rounding, refit after "
        "every update. Writes config.toml and metrics.jsonl to run.out_dir.",
    )
    train.add_argument(
        "--config", type=Path, required=True, help="a TOML file (see fp4rl/configs/)"
    )
    train.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=SET_HELP
    )

    demo = sub.add_parser(
        "demo",
        help="RL on a tiny MoE at addition, on any laptop (~2 min per seed on 2 CPU cores)",
        description="Warm up a tiny MoE on addition (cached), run GRPO from it with the NVFP4 "
        "engine and guided rounding, and print held-out accuracy before and after. Uses a "
        "CUDA GPU when one is present. Settings: fp4rl/configs/demo.toml.",
    )
    demo.add_argument(
        "--seeds", default="0", help="comma-separated seeds, one run each (default 0)"
    )
    demo.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the config's)")
    demo.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "fp4rl",
        help="where base policies are kept and reused (default ~/.cache/fp4rl)",
    )
    demo.add_argument(
        "--out-dir",
        type=Path,
        default=Path("runs/demo"),
        help="run directories (default runs/demo)",
    )
    demo.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=SET_HELP
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            from fp4rl import config, loop

            loop.train(config.load(args.config, args.set))
        else:
            from fp4rl import demo

            seeds = _seeds(args.seeds)
            overrides = list(args.set) + (
                [f"run.steps={args.steps}"] if args.steps is not None else []
            )
            demo.run(
                seeds=seeds, cache_dir=args.cache_dir, out_dir=args.out_dir, overrides=overrides
            )
    except (ValueError, FileNotFoundError) as err:
        print(f"fp4rl {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated ints, got {text!r}") from None
    if any(s < 0 for s in seeds):
        raise ValueError(f"--seeds must be >= 0, got {text!r}")
    return seeds
