"""``fp4rl demo`` run again into the same ``--out-dir``: every invocation gets its own run
directory, so the second never meets the first one's checkpoints; bad settings stop before a
directory is made."""

import datetime
import json
import sys

import pytest

from fp4rl import demo
from fp4rl.cli import main
from fp4rl.train.optim import OptimConfig

# A short warm-up and a small run: what is tested is where the runs go, not how they learn.
SHORT_WARMUP = demo.Warmup(steps=20, check_every=20, optim=OptimConfig(lr=3e-3, warmup_steps=5))
SMALL = ["rollout.prompts_per_step=4", "task.num_held_out=8", "run.eval_every=1"]


def test_running_the_demo_twice_into_one_out_dir_makes_two_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "WARMUP", SHORT_WARMUP)
    out, cache = tmp_path / "demo", tmp_path / "cache"
    argv = ["demo", "--steps", "1", "--cache-dir", str(cache), "--out-dir", str(out)]
    argv += [word for setting in SMALL for word in ("--set", setting)]
    printed = []
    for _ in range(2):
        assert main(argv) == 0
        printed.append(capsys.readouterr().out)
    runs = sorted(p.parent for p in out.glob("*/seed0"))
    assert len(runs) == 2
    for run, text in zip(runs, printed, strict=True):
        assert f"seed 0: run directory {run / 'seed0'}" in text
        steps = [json.loads(line) for line in (run / "seed0" / "metrics.jsonl").open()]
        assert [m["step"] for m in steps] == [0, 1]
        assert (run / "seed0" / "checkpoints" / "step-00000001" / "model").is_dir()
    assert "base policy: reusing" in printed[1]  # the cache is shared, the runs are not


def test_run_directories_are_new_even_within_one_second(tmp_path):
    now = datetime.datetime(2026, 11, 30, 17, 5, 9, tzinfo=datetime.UTC)
    made = [demo.new_run_dir(tmp_path / "demo", now=now) for _ in range(3)]
    assert [p.name for p in made] == ["20261130-170509", "20261130-170509-2", "20261130-170509-3"]
    assert all(p.is_dir() and not any(p.iterdir()) for p in made)
    local = now.astimezone(datetime.timezone(datetime.timedelta(hours=-5)))
    assert demo.new_run_dir(tmp_path / "other", now=local).name == "20261130-170509"  # UTC


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "run.steps=0"], "run.steps must be"),
        (["--seeds", "0,x"], "--seeds must be comma-separated ints"),
        (["--set", "run.tensorboard=true"], "run.tensorboard = true needs the tensorboard"),
    ],
)
def test_bad_settings_stop_before_a_run_directory_is_made(
    tmp_path, monkeypatch, capsys, args, message
):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    assert main(["demo", "--out-dir", str(tmp_path / "demo"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp4rl demo: error:") and message in err and err.count("\n") == 1
    assert not (tmp_path / "demo").exists()


def test_help_says_where_each_invocation_writes(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "OUT_DIR/<UTC date-time>/seed<N>" in out and "fp4rl train --resume" in out
