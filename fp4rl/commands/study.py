"""``fp4rl study``: the rollout variants compared by GRPO from one base policy, several seeds."""

from __future__ import annotations

import argparse
from pathlib import Path

from fp4rl.commands import add_cache_dir_argument, add_set_argument
from fp4rl.commands.demo import seeds as parse_seeds

HELP = "compare BF16, FP4 QAT, asymmetric and guided rollouts by GRPO (docs/results.md)"
DESCRIPTION = (
    "Warm up the size's base policy (cached), run GRPO from it for every variant and seed "
    "(one run directory each under --out; finished runs are skipped, stopped ones resumed), "
    "evaluate every run with the same BF16 evaluator, then write curves (PNG), summary.json "
    "and results.md to --out. Settings: fp4rl/configs/study.toml and fp4rl.study.SIZES."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--size",
        default="small",
        help="small (2 CPU cores, about an hour), long (small on 21-token running sums) or full "
        "(meant for one GPU); default small",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/study"),
        help="the study's directory (default runs/study)",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated variants (default all: bf16,nearest,asymmetric,guided-compact,"
        "guided-full)",
    )
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default the size's)")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at once, one process each (default 1)"
    )
    add_cache_dir_argument(parser)
    parser.add_argument(
        "--aggregate-only",
        action="store_true",
        help="only aggregate the finished runs already in --out",
    )
    add_set_argument(parser)


def run(args: argparse.Namespace) -> None:
    from fp4rl import study, study_results

    variants = tuple(study.VARIANTS) if args.variants is None else tuple(args.variants.split(","))
    unknown = [v for v in variants if v not in study.VARIANTS]
    if unknown:
        raise ValueError(
            f"--variants: unknown {unknown[0]!r}; variants: {', '.join(study.VARIANTS)}"
        )
    if args.size not in study.SIZES:
        raise ValueError(f"--size must be one of {', '.join(study.SIZES)}, got {args.size!r}")
    seeds = study.SIZES[args.size].seeds if args.seeds is None else parse_seeds(args.seeds)
    if args.aggregate_only:
        study_results.aggregate(args.out, variants=variants, seeds=seeds)
        return
    study.run(
        args.size,
        args.out,
        cache_dir=args.cache_dir,
        variants=variants,
        seeds=seeds,
        overrides=tuple(args.set),
        jobs=args.jobs,
    )
