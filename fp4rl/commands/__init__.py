"""The subcommands of ``fp4rl``, one module each.

A command module defines ``HELP`` (one line for ``fp4rl --help``), ``DESCRIPTION`` (its own
``--help``), ``add_arguments(parser)`` and ``run(args) -> int | None``. It imports nothing heavy
at module level: every command's parser is built on each call of ``fp4rl``. ``run`` raises
``ValueError`` or ``FileNotFoundError`` for bad input, which `fp4rl.cli` turns into exit
status 2 and a one-line cause.
"""

from pathlib import Path

NAMES = ("train", "demo", "study", "generate", "eval", "report", "export", "bench")  # --help order

SET_HELP = (
    "override one setting, as section.key=value (repeatable); the value is read as TOML "
    "(3, 1e-5, true, [1, 2]) or else as a plain string, e.g. --set precision.kv_cache=nvfp4"
)


def add_policy_arguments(parser) -> None:
    """The arguments of a command that loads a trained policy (`fp4rl generate`, `fp4rl eval`):
    where it is, the settings, the precision to run it in, overrides."""
    parser.add_argument(
        "source",
        type=Path,
        nargs="?",
        metavar="RUN_DIR|CHECKPOINT",
        help="a run or checkpoint directory (default: --config's model.path)",
    )
    parser.add_argument(
        "--config", type=Path, help="settings (task, engine, precision); default: the run's"
    )
    parser.add_argument(
        "--precision",
        default="config",
        help="config (default): the settings' [precision], NVFP4 experts as they say; bf16: "
        "every layer BF16",
    )
    add_set_argument(parser)


def add_set_argument(parser, help: str = SET_HELP) -> None:
    """``--set SECTION.KEY=VALUE``, repeatable: overrides of the run config."""
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help
    )


def add_cache_dir_argument(parser) -> None:
    """``--cache-dir``: where built base policies are kept and reused (the demo, the study)."""
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "fp4rl",
        help="where base policies are kept and reused (default ~/.cache/fp4rl)",
    )
