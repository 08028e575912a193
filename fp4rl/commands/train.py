"""``fp4rl train``: GRPO from a TOML config, or the continuation of a stopped run."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4rl.commands import SET_HELP

HELP = "run GRPO from a config file, or resume a run"
DESCRIPTION = (
    "Run GRPO: rollouts on the NVFP4 engine, rewards of the task, updates of the QAT trainer "
    "with router replay and guided rounding, refit after every update. Writes config.toml, "
    "metrics.jsonl and checkpoints (every run.checkpoint_every steps and after the last) to "
    "run.out_dir. --resume RUN_DIR continues a stopped run from its latest complete checkpoint, "
    "with the config it was started with."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="a TOML file (see fp4rl/configs/)")
    source.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest complete checkpoint; --set may then "
        "change only run.steps (to extend it), run.checkpoint_every, run.keep_checkpoints and "
        "run.tensorboard",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=SET_HELP
    )


def run(args: argparse.Namespace) -> None:
    from fp4rl import checkpoints, config, loop

    if args.resume is not None:
        loop.train(checkpoints.resume_config(args.resume, args.set), resume=True)
    else:
        loop.train(config.load(args.config, args.set))
