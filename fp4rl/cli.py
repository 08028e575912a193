"""The ``fp4rl`` command. Each subcommand lives in `fp4rl.commands` (``NAMES`` lists them).
Bad input exits with status 2 and a one-line cause naming the offending value."""

from __future__ import annotations

import argparse
import importlib
import sys

from fp4rl import commands


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4rl",
        description="GRPO post-training of MoE language models with NVFP4 rollouts kept "
        "aligned with the trainer.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in commands.NAMES:
        module = importlib.import_module(f"fp4rl.commands.{name}")
        command = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        status = args.run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"fp4rl {args.command}: error: {err}", file=sys.stderr)
        return 2
    return status or 0
