"""The README's "Your own data and reward" commands, run as written on the tiny model: its
checkpoint and JSONL paths replaced by a tiny model directory and a small file, and the tiny
model's sizes set on top. The user reward is the README's own code block."""

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from tiny_hf import model_dir

from fp4rl.cli import main

pytest.importorskip("tokenizers")

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = README.read_text().split("## Your own data and reward")[1].split("\n## ")[0]

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


def commands() -> list[list[str]]:
    """Every ``fp4rl train`` command of the section's bash blocks, as argv after ``fp4rl``."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", SECTION, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0]:  # environment assignments, e.g. PYTHONPATH=.
                words = words[1:]
            if words[:2] == ["fp4rl", "train"]:
                out.append(words[1:])
    return out


def test_the_section_has_the_commands_this_test_runs():
    assert [argv[argv.index("--config") + 1] for argv in commands()] == [
        "fp4rl/configs/jsonl_math.toml"
    ] * 2


@pytest.mark.parametrize("index", [0, 1])
def test_readme_command_trains_on_a_jsonl_file(tmp_path, monkeypatch, index):
    reward_code = re.search(r"```python\n(# my_rewards\.py.*?)```", SECTION, flags=re.S)
    (tmp_path / "my_rewards.py").write_text(reward_code.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(Path(README).parent)  # the README's config path is relative to the root
    model = model_dir(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"what is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(9)
        )
    )
    out_dir = tmp_path / "run"
    places = {"/path/to/hf-checkpoint": model, "data/train.jsonl": data, "runs/mine": out_dir}
    argv = []
    for word in commands()[index]:
        for place, path in places.items():
            word = word.replace(place, str(path))
        argv.append(word)
    argv += [x for setting in [*TINY, f"run.out_dir={out_dir}"] for x in ("--set", setting)]
    try:
        assert main(argv) == 0
    finally:
        sys.modules.pop("my_rewards", None)
    steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [0, 1, 2] and "held_out_accuracy" in steps[-1]
    resolved = (out_dir / "config.toml").read_text()
    reward = "my_rewards:exact" if index == 1 else "math"
    assert 'kind = "jsonl"' in resolved and f'reward = "{reward}"' in resolved
