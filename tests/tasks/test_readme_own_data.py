"""The README's "Your own data and reward" commands, run as written on the tiny model: its
checkpoint and JSONL paths replaced by a tiny model directory and a small file, and the tiny
model's sizes set on top. The user reward is the README's own code block."""

import json
import sys

import pytest
from readme_commands import ROOT, TINY, code_block, commands, run, section
from tiny_hf import model_dir

pytest.importorskip("tokenizers")

SECTION = section("Your own data and reward")
COMMANDS = commands(SECTION)


def test_the_section_has_the_commands_this_test_runs():
    assert [argv[0] for argv in COMMANDS] == ["train", "train", "eval", "eval", "generate"]
    assert [argv[argv.index("--config") + 1] for argv in COMMANDS[:2]] == [
        "fp4rl/configs/jsonl_math.toml"
    ] * 2


@pytest.fixture
def places(tmp_path, monkeypatch):
    """The README's paths -> a tiny model directory, a small JSONL file, a run directory."""
    (tmp_path / "my_rewards.py").write_text(code_block(SECTION, "# my_rewards.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)  # the README's config path is relative to the root
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


@pytest.mark.parametrize("index", [0, 1])
def test_readme_train_command_trains_on_a_jsonl_file(places, index):
    out_dir = places["runs/mine"]
    assert run(COMMANDS[index], places, [*TINY, f"run.out_dir={out_dir}"]) == 0
    steps = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [0, 1, 2] and "held_out_accuracy" in steps[-1]
    resolved = (out_dir / "config.toml").read_text()
    reward = "my_rewards:exact" if index == 1 else "math"
    assert 'kind = "jsonl"' in resolved and f'reward = "{reward}"' in resolved


def test_readme_eval_and_generate_commands_on_the_trained_run(places, capsys):
    assert run(COMMANDS[0], places, TINY) == 0
    capsys.readouterr()
    for argv in COMMANDS[2:4]:
        assert run(argv, places) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["model"].endswith("checkpoints/step-00000002/model")
        assert 0 <= result["held_out_accuracy"] <= 1
    assert run(COMMANDS[4], places) == 0
    records = [json.loads(line) for line in places["completions.jsonl"].read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["what is 2+2?", "what is 3+3?"]
