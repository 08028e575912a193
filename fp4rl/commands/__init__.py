"""The subcommands of ``fp4rl``, one module each.

A command module defines ``HELP`` (one line for ``fp4rl --help``), ``DESCRIPTION`` (its own
``--help``), ``add_arguments(parser)`` and ``run(args) -> int | None``. It imports nothing heavy
at module level: every command's parser is built on each call of ``fp4rl``. ``run`` raises
``ValueError`` or ``FileNotFoundError`` for bad input, which `fp4rl.cli` turns into exit
status 2 and a one-line cause.
"""

# the order of ``fp4rl --help``
NAMES = ("train", "demo", "study", "generate", "eval", "report", "export", "bench")

SET_HELP = (
    "override one setting, as section.key=value (repeatable); the value is read as TOML "
    "(3, 1e-5, true, [1, 2]) or else as a plain string, e.g. --set precision.kv_cache=nvfp4"
)
