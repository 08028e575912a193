"""``fp4rl eval``: held-out accuracy of a checkpoint under a precision."""

from __future__ import annotations

import argparse
import json
import sys

from fp4rl.commands import add_policy_arguments

HELP = "held-out accuracy of a checkpoint, BF16 or NVFP4"
DESCRIPTION = (
    "Evaluate a checkpoint directory, a run directory (its latest complete checkpoint and its "
    "config.toml) or the model.path of --config on the task's held-out set, as the training "
    "loop does: held_out_accuracy (run.eval_samples samples per problem at the rollout's "
    "temperature; a reward of 1.0 counts as correct) and held_out_greedy. Prints one JSON "
    "object."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_policy_arguments(parser)


def run(args: argparse.Namespace) -> None:
    from fp4rl import inference

    inference.check_precision(args.precision)
    config = inference.run_config(args.source, args.config, args.set)
    result = inference.evaluate_policy(
        config, args.precision, log=lambda line: print(line, file=sys.stderr)
    )
    print(json.dumps(result))
