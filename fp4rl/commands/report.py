"""``fp4rl report``: plots and a summary of a run directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "plot a run's metrics and summarize it in report.md"
DESCRIPTION = (
    "Read RUN_DIR/metrics.jsonl (and config.toml) and write PNG plots of what the run recorded "
    "(reward and held-out accuracy, the trainer-vs-rollout gap, code agreement per layer and "
    "site kind, time per phase and tokens/s) and report.md, a short summary linking them. "
    "Needs matplotlib: pip install 'fp4rl[report]'."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run's out_dir")
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write (default RUN_DIR/report)"
    )


def run(args: argparse.Namespace) -> int | None:
    from fp4rl.report import write_report

    try:
        written = write_report(args.run_dir, args.out)
    except ModuleNotFoundError as err:
        if err.name != "matplotlib":
            raise
        # The optional extra is not installed: said in one line, like bad input.
        print(f"fp4rl report: error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return None
