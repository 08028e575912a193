"""``fp4rl train``: GRPO from a TOML config, or the continuation of a stopped run."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4rl.commands import add_set_argument

HELP = "run GRPO from a config file, or resume a run"
DESCRIPTION = (
    "Run GRPO: rollouts on the NVFP4 engine, rewards of the task, updates of the QAT trainer "
    "with router replay and guided rounding, refit after every update. Writes config.toml, "
    "metrics.jsonl and checkpoints (every run.checkpoint_every steps and after the last) to "
    "run.out_dir. --resume RUN_DIR continues a stopped run from its latest complete checkpoint, "
    "with the config it was started with. Started by torchrun (torchrun --nproc-per-node N -m "
    "fp4rl train ...), every process is one rank of one run: each generates for its share of "
    "the prompts, the trainer is sharded with FSDP2, rank 0 writes the run directory; a "
    "checkpoint of any number of ranks resumes on any number."
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
    add_set_argument(parser)


def run(args: argparse.Namespace) -> None:
    from fp4rl import config, distributed, loop, run_dir

    if args.resume is not None:
        run_config = run_dir.resume_config(args.resume, args.set)
    else:
        run_config = config.load(args.config, args.set)
    # Under torchrun, the process group of its ranks; otherwise None: one process.
    with distributed.launch(run_config.model.device) as ranks:
        loop.train(run_config, resume=args.resume is not None, ranks=ranks)
