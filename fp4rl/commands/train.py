"""``fp4rl train``: GRPO from a TOML config."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4rl.commands import SET_HELP

HELP = "run GRPO from a config file"
DESCRIPTION = (
    "Run GRPO: rollouts on the NVFP4 engine, rewards of the task, updates of the QAT trainer "
    "with router replay and guided rounding, refit after every update. Writes config.toml and "
    "metrics.jsonl to run.out_dir."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, required=True, help="a TOML file (see fp4rl/configs/)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=SET_HELP
    )


def run(args: argparse.Namespace) -> None:
    from fp4rl import config, loop

    loop.train(config.load(args.config, args.set))
