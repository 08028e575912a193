"""The README's commands, run as written on the tiny model: one mechanism for every README test.

`section(title)` is the text of one ``## title`` section, `commands(text)` every ``fp4rl``
command of its bash blocks (argv after ``fp4rl``), `code_block(text, first_line)` one of its
code blocks, and `run(argv, places, settings)` runs a command through `fp4rl.cli.main` with the
README's placeholder paths replaced (``places``: placeholder -> path) and ``settings`` added as
``--set``. `TINY` sizes a run of the config files for the tiny model of `tiny_hf`.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from fp4rl.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"
ROOT = README.parent  # the README's relative paths (fp4rl/configs/...) start here

# The tiny model's sizes (vocabulary 128, 256 positions, random weights) and a short run.
TINY = [
    "model.dtype=float32",
    "model.device=cpu",
    "precision.bf16_first_layers=1",
    "precision.bf16_last_layers=1",
    "engine.block_size=4",
    "engine.kv_memory_bytes=4194304",
    "engine.max_model_len=128",
    "engine.max_num_seqs=16",
    "engine.max_num_batched_tokens=256",
    "rollout.prompts_per_step=4",
    "rollout.samples_per_prompt=4",
    "rollout.max_tokens=6",
    "task.max_prompt_tokens=100",
    "task.num_held_out=2",
    "run.steps=2",
    "run.eval_every=1",
    "run.threads=1",
]


def section(title: str) -> str:
    """The README's ``## title`` section, up to the next ``## ``."""
    parts = README.read_text().split(f"\n## {title}\n")
    if len(parts) != 2:
        raise AssertionError(f"README.md has {len(parts) - 1} sections titled {title!r}")
    return parts[1].split("\n## ")[0]


def commands(text: str) -> list[list[str]]:
    """Every ``fp4rl`` command of the bash blocks of ``text``, as argv after ``fp4rl``."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0]:  # environment assignments, e.g. PYTHONPATH=.
                words = words[1:]
            if words[:1] == ["fp4rl"]:
                out.append(words[1:])
    return out


def code_block(text: str, first_line: str) -> str:
    """The code block of ``text`` whose first line starts with ``first_line``."""
    found = re.search(rf"```\w*\n({re.escape(first_line)}.*?)```", text, flags=re.S)
    if found is None:
        raise AssertionError(f"no code block starting {first_line!r}")
    return found.group(1)


def placed(argv: list[str], places: dict) -> list[str]:
    """``argv`` with the README's placeholder paths replaced."""
    words = []
    for word in argv:
        for place, path in places.items():
            word = word.replace(place, str(path))
        words.append(word)
    return words


def run(argv: list[str], places: dict, settings=()) -> int:
    """The README's ``argv`` with its paths replaced, and ``settings`` as ``--set``."""
    return main([*placed(argv, places), *(x for s in settings for x in ("--set", s))])
