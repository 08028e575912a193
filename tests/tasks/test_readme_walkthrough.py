"""The README's "From your checkpoint and data to an NVFP4 policy", every command run as written
on the tiny model (`readme_commands`): train in a child process, SIGKILLed right after its first
checkpoint, then ``--resume``, ``report``, ``eval`` and ``export --format nvfp4`` on what it
left, each checked for what it must have produced."""

import json
import signal
import subprocess
import sys

import pytest
from readme_commands import ROOT, TINY, commands, placed, run, section
from safetensors import safe_open
from tiny_hf import model_dir

pytest.importorskip("tokenizers")

SECTION = section("From your checkpoint and data to an NVFP4 policy")
COMMANDS = commands(SECTION)
STEPS = 4

# The README's train command in a child interpreter that stops for good once its first
# checkpoint is complete (printing its path), so the test kills it there, not in a race.
CHILD = """
import sys, time
from fp4rl import checkpoints, cli

save = checkpoints.save

def save_then_stop(*args, **kwargs):
    path = save(*args, **kwargs)
    print(f"saved {path}", flush=True)
    time.sleep(600)

checkpoints.save = save_then_stop
sys.exit(cli.main(sys.argv[1:]))
"""


def test_the_section_has_the_commands_this_test_runs():
    assert [argv[:2] for argv in COMMANDS] == [
        ["train", "--config"],
        ["train", "--resume"],
        ["report", "runs/mine"],
        ["eval", "runs/mine"],
        ["export", "runs/mine"],
    ]
    assert "run.checkpoint_every=20" in COMMANDS[0] and COMMANDS[4][-2:] == ["--format", "nvfp4"]


@pytest.fixture
def places(tmp_path, monkeypatch):
    """The README's paths -> a tiny model directory, a small JSONL file, run and export dirs."""
    monkeypatch.chdir(ROOT)  # the README's config path is relative to the root
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": f"what is {i}+1?", "answer": str(i + 1)} for i in range(9)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "/path/to/hf-checkpoint": model_dir(tmp_path / "model"),
        "data/train.jsonl": data,
        "runs/mine": tmp_path / "run",
        "exported/nvfp4": tmp_path / "exported",
    }


def kill_after_first_checkpoint(argv: list[str]) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # a failing child shows its error in the assertion
        text=True,
    )
    try:
        lines = []
        for line in child.stdout:
            lines.append(line)
            if line.startswith("saved "):
                break
        assert lines and lines[-1].startswith("saved "), "".join(lines[-20:])
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_every_command_of_the_walkthrough_on_the_tiny_model(places, capsys):
    run_dir = places["runs/mine"]
    settings = [*TINY, f"run.steps={STEPS}", "run.checkpoint_every=1"]

    # 1. train, killed after the checkpoint of step 1: that one complete, nothing later.
    kill_after_first_checkpoint(
        [*placed(COMMANDS[0], places), *(x for s in settings for x in ("--set", s))]
    )
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000001"]
    assert [m["step"] for m in metrics(run_dir)] == [0]

    # 2. --resume runs the remaining steps from it, and the final evaluation.
    assert run(COMMANDS[1], places) == 0
    log = capsys.readouterr().out
    assert f"resuming {run_dir} from {run_dir / 'checkpoints' / 'step-00000001'}" in log
    entries = metrics(run_dir)
    assert [m["step"] for m in entries] == list(range(STEPS + 1))
    assert "reward" not in entries[-1] and 0 <= entries[-1]["held_out_accuracy"] <= 1
    last = run_dir / "checkpoints" / f"step-{STEPS:08d}"

    # 3. report and eval of the resumed run.
    pytest.importorskip("matplotlib")
    assert run(COMMANDS[2], places) == 0
    written = capsys.readouterr().out.split()
    assert written[-1] == str(run_dir / "report" / "report.md")
    assert f"{STEPS} GRPO steps recorded" in (run_dir / "report" / "report.md").read_text()
    assert run(COMMANDS[3], places) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == str(last / "model") and 0 <= result["held_out_accuracy"] <= 1

    # 4. export: NVFP4 routed experts of the FP4 layers in compressed-tensors' layout.
    assert run(COMMANDS[4], places) == 0
    out = places["exported/nvfp4"]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    names = set()
    for file in out.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            names |= set(f.keys())
    assert any(name.endswith(".weight_packed") for name in names)
    assert (out / "tokenizer.json").is_file()
