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
    """Every ``fp4rl`` command of the section's bash blocks, as argv after ``fp4rl``."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", SECTION, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0]:  # environment assignments, e.g. PYTHONPATH=.
                words = words[1:]
            if words[:1] == ["fp4rl"]:
                out.append(words[1:])
    return out


def test_the_section_has_the_commands_this_test_runs():
    assert [argv[0] for argv in commands()] == ["train", "train", "eval", "eval", "generate"]
    assert [argv[argv.index("--config") + 1] for argv in commands()[:2]] == [
        "fp4rl/configs/jsonl_math.toml"
    ] * 2


@pytest.fixture
def places(tmp_path, monkeypatch):
    """The README's paths -> a tiny model directory, a small JSONL file, a run directory."""
    reward_code = re.search(r"```python\n(# my_rewards\.py.*?)```", SECTION, flags=re.S)
    (tmp_path / "my_rewards.py").write_text(reward_code.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(Path(README).parent)  # the README's config path is relative to the root
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"what is {i}+1?", "answer": str(i + 1)} for i in range(9)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "what is 2+2?"}\n{"prompt": "what is 3+3?"}\n')
    yield {
        "/path/to/hf-checkpoint": model_dir(tmp_path / "model"),
        "data/train.jsonl": data,
        "runs/mine": tmp_path / "run",
        "completions.jsonl": tmp_path / "completions.jsonl",
        "prompts.jsonl": prompts,
    }
    sys.modules.pop("my_rewards", None)


def run(argv: list[str], places: dict, settings=()) -> int:
    """The README's ``argv`` with its paths replaced, and ``settings`` as ``--set``."""
    words = []
    for word in argv:
        for place, path in places.items():
            word = word.replace(place, str(path))
        words.append(word)
    return main([*words, *(x for setting in settings for x in ("--set", setting))])


@pytest.mark.parametrize("index", [0, 1])
def test_readme_train_command_trains_on_a_jsonl_file(places, index):
    out_dir = places["runs/mine"]
    assert run(commands()[index], places, [*TINY, f"run.out_dir={out_dir}"]) == 0
    steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [0, 1, 2] and "held_out_accuracy" in steps[-1]
    resolved = (out_dir / "config.toml").read_text()
    reward = "my_rewards:exact" if index == 1 else "math"
    assert 'kind = "jsonl"' in resolved and f'reward = "{reward}"' in resolved


def test_readme_eval_and_generate_commands_on_the_trained_run(places, capsys):
    assert run(commands()[0], places, TINY) == 0
    capsys.readouterr()
    for argv in commands()[2:4]:
        assert run(argv, places) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["model"].endswith("checkpoints/step-00000002/model")
        assert 0 <= result["held_out_accuracy"] <= 1
    assert run(commands()[4], places) == 0
    records = [json.loads(line) for line in places["completions.jsonl"].read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["what is 2+2?", "what is 3+3?"]
