"""``fp4rl bench``: the throughput benchmarks of ``benchmarks/``, run by name.

The benchmarks are scripts of the repository, not of the package: a wheel has none, and each
script is run as ``python benchmarks/NAME.py ARGS`` (its own process, so that what it sets
before importing, e.g. ``TRITON_INTERPRET`` for a CPU smoke run, and its own argument parser
stay its own). This command finds the directory beside a source checkout of fp4rl, or where
``--dir`` says, lists the scripts with the first paragraph of each docstring, and runs one
with the arguments given after its name, returning its exit status.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

HELP = "run a throughput benchmark of benchmarks/ by name (--list: what there is)"
DESCRIPTION = (
    "Run benchmarks/NAME.py of fp4rl's repository with ARGS passed through as they are (NAME "
    "--help: its own options, among them its CPU smoke mode, --quick or --device cpu); exits "
    "with its status. The scripts live in the repository, not in the package: a source "
    "checkout (pip install -e .) finds them, an installed wheel needs --dir. A benchmark "
    "prints markdown tables and, where the OUT environment variable names a directory, also "
    "writes them there."
)

# The checkout this module belongs to when it is not installed as a wheel: fp4rl/commands/..
ROOT = Path(__file__).resolve().parents[2]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument(
        "--dir",
        type=Path,
        metavar="DIR",
        help="the benchmarks directory of an fp4rl checkout (default: the one beside this "
        "package's source)",
    )
    parser.add_argument("name", nargs="?", metavar="NAME", help="a benchmark (see --list)")
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="the benchmark's own arguments"
    )


def run(args: argparse.Namespace) -> int | None:
    directory = benchmarks_dir(args.dir)
    found = benchmarks(directory)
    if args.list:
        print(
            f"benchmarks in {directory} (fp4rl bench NAME [ARGS...]; NAME --help for its options)"
        )
        width = max(map(len, found))
        for name, script in found.items():
            print(f"  {name:<{width}}  {description(script)}")
        return None
    if args.name is None:
        raise ValueError("name a benchmark, or --list to see them: " + ", ".join(found))
    if args.name not in found:
        raise ValueError(
            f"no benchmark {args.name!r} in {directory}; there are: " + ", ".join(found)
        )
    command = [sys.executable, str(found[args.name]), *args.args]
    print("fp4rl bench: running " + " ".join(command[1:]), file=sys.stderr, flush=True)
    status = subprocess.run(command, env=_environment(directory), check=False).returncode
    return status if status >= 0 else 128 - status  # killed by a signal: the shell's number


def benchmarks_dir(given: Path | None) -> Path:
    """``given``, or the ``benchmarks`` directory of the checkout this package runs from; each
    must hold the benchmarks' shared ``_timing.py``."""
    if given is not None:
        if not (given / "_timing.py").is_file():
            raise FileNotFoundError(
                f"--dir {given} is not fp4rl's benchmarks directory (no _timing.py in it)"
            )
        return given
    found = ROOT / "benchmarks"
    if (ROOT / "pyproject.toml").is_file() and (found / "_timing.py").is_file():
        return found
    raise FileNotFoundError(
        f"no benchmarks beside this fp4rl ({ROOT / 'fp4rl'}): they are in the repository's "
        "benchmarks/ directory, which an installed package does not carry; run from a source "
        "checkout (pip install -e .) or pass --dir CHECKOUT/benchmarks"
    )


def benchmarks(directory: Path) -> dict[str, Path]:
    """Name -> script: every ``*.py`` of ``directory`` but the helpers (``_*.py``), sorted."""
    return {p.stem: p for p in sorted(directory.glob("*.py")) if not p.name.startswith("_")}


def description(script: Path) -> str:
    """The first paragraph of the script's docstring on one line, read without running it."""
    doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split()) or "(no docstring)"


def _environment(directory: Path) -> dict[str, str]:
    """The script's environment: output unbuffered (progress shows as it is printed) and, for
    the checkout's own benchmarks, that checkout first on the path, so the script measures the
    fp4rl this command is."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if directory.resolve() == (ROOT / "benchmarks").resolve():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env
