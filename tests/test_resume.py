"""Checkpoints and resume: runs killed (SIGKILL) inside a checkpoint write, right after one and
while an old one is deleted leave only complete checkpoints, and resuming them gives the steps
of a run never stopped, metrics and every tensor bit for bit on the CPU.

The killed runs are child interpreters that stop for good at a known point (a wrapped function
prints where it is and sleeps), so the test kills them there rather than racing a write.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import qat_model, tiny_config, tiny_precision

from fp4rl import checkpoints, cli, demo
from fp4rl import config as run_config
from fp4rl import run_dir as run_directory
from fp4rl.commands import train as train_command
from fp4rl.loop import train
from fp4rl.model.checkpoint import save_checkpoint
from fp4rl.model.weights import load_pretrained
from fp4rl.train.optim import MasterAdamW, OptimConfig

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, KEEP = 5, 2, 2  # checkpoints after steps 2, 4 and 5; the two newest kept
OPTIM = OptimConfig(lr=1e-3)  # any: loading replaces the state

# Wraps one function of the run so that the child stops for good at a known point of the
# checkpoint of step 4 (or of the deletion of step 2's), then runs `fp4rl.loop.train`.
CHILD = """
import json, shutil, sys, time
from fp4rl import checkpoints, demo, run_dir as run_directory
from fp4rl import config as run_config
from fp4rl.commands import train as train_command
from fp4rl.loop import train
from fp4rl.model.checkpoint import writer

run_dir, stop_at, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

def stop(where):
    print(where, flush=True)
    time.sleep(600)

if stop_at == "model-write":  # step 4's weights on disk, its config.json not yet
    write = writer._write_safetensors
    def write_then_stop(file, tensors):
        write(file, tensors)
        if ".step-00000004.partial-" in str(file):
            stop(file)
    writer._write_safetensors = write_then_stop
elif stop_at == "after-save":  # step 4's checkpoint complete, step 4 not begun
    save = checkpoints.save
    def save_then_stop(*args, **kwargs):
        path = save(*args, **kwargs)
        if path.name == "step-00000004":
            stop(path)
        return path
    checkpoints.save = save_then_stop
elif stop_at == "delete":  # step 2's checkpoint renamed away, not yet deleted
    rmtree = shutil.rmtree
    def stop_then_rmtree(path, *args, **kwargs):
        if ".step-00000002.partial-" in str(path):
            stop(path)
        return rmtree(path, *args, **kwargs)
    shutil.rmtree = stop_then_rmtree
if overrides is None:
    train(run_directory.resume_config(run_dir), log=lambda _: None, resume=True)
else:
    train(run_config.load(demo.CONFIG_FILE, overrides), log=lambda _: None)
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A random tiny model with the task's vocabulary: a few samples per group earn the format
    reward, so every step trains."""
    path = tmp_path_factory.mktemp("base") / "model"
    config = tiny_config(vocab_size=16)
    model = qat_model(tiny_precision("nvfp4"), config=config, seed=0)
    save_checkpoint(model.state_dict(), config, path)
    return path


def overrides(base: Path, run_dir: Path) -> list[str]:
    return [
        f"model.path={base}",
        f"run.out_dir={run_dir}",
        "model.device=cpu",  # bit for bit is the CPU's promise
        "model.dtype=bfloat16",  # BF16 parameters beside FP32 masters
        f"run.steps={STEPS}",
        f"run.checkpoint_every={EVERY}",
        f"run.keep_checkpoints={KEEP}",
        "run.eval_every=2",
        "run.eval_samples=1",
        "rollout.prompts_per_step=8",
        "rollout.samples_per_prompt=8",
        "rollout.max_tokens=3",
        "task.format_reward=0.5",
        "task.num_held_out=16",
        "align.observe_every=2",
        "optim.lr=1e-3",
        "optim.warmup_steps=0",
    ]


def run_until_stopped(tmp_path: Path, run_dir: Path, stop_at: str, args) -> Path:
    """Start a child run, wait until it stops at ``stop_at``, SIGKILL it; where it stopped."""
    with open(tmp_path / f"{stop_at}.stderr", "w+") as err:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(run_dir), stop_at, json.dumps(args)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        where = child.stdout.readline().strip()
        child.send_signal(signal.SIGKILL)
        child.wait()  # reaped: a zombie still answers os.kill(pid, 0)
        child.stdout.close()
        err.seek(0)
        assert where, f"the child run did not reach {stop_at}:\n{err.read()}"
    return Path(where)


def on_disk(run_dir: Path) -> tuple[list[str], list[str]]:
    """(complete checkpoints, temporaries) of ``run_dir``; every complete one must load."""
    entries = sorted(p.name for p in (run_dir / checkpoints.FOLDER).iterdir())
    complete = [p.name for p in checkpoints.complete_checkpoints(run_dir)]
    temporary = [name for name in entries if name.startswith(".step-") and ".partial-" in name]
    assert sorted(complete + temporary) == entries, entries
    for name in complete:
        policy = load_pretrained(
            run_dir / checkpoints.FOLDER / name / "model",
            tiny_precision("nvfp4"),
            dtype=torch.bfloat16,
        )
        position, _ = checkpoints.load(
            run_dir / checkpoints.FOLDER / name, MasterAdamW(policy.parameters(), OPTIM)
        )
        assert position.step == int(name.removeprefix("step-"))
    return complete, temporary


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def without_timings(entries: list[dict]) -> list[dict]:
    """Everything a step computed; its wall-clock times are the only entries that may differ."""
    timing = ("_s", "_tokens_per_s")
    return [{k: v for k, v in m.items() if not k.endswith(timing)} for m in entries]


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Weights, masters, moments, counts, random states and position: equal, bit for bit."""
    assert json.loads((a / "state.json").read_text()) == json.loads((b / "state.json").read_text())
    assert (a / "model/config.json").read_text() == (b / "model/config.json").read_text()
    weights_a, weights_b = (
        load_file(a / "model/model.safetensors"),
        load_file(b / "model/model.safetensors"),
    )
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    ta, tb = (torch.load(p / "trainer.pt", weights_only=True) for p in (a, b))
    assert torch.equal(ta["torch_cpu_rng"], tb["torch_cpu_rng"])
    oa, ob = ta["optimizer"], tb["optimizer"]
    assert oa["num_updates"] == ob["num_updates"]
    for i, (ma, mb) in enumerate(zip(oa["masters"], ob["masters"], strict=True)):
        assert torch.equal(ma, mb), f"master {i}"
    sa, sb = oa["optimizer"]["state"], ob["optimizer"]["state"]
    assert sa.keys() == sb.keys() and len(sa) == len(oa["masters"])
    for i in sa:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[i][key], sb[i][key]), f"{key} of master {i}"
    assert oa["optimizer"]["param_groups"] == ob["optimizer"]["param_groups"]


def test_killed_runs_resume_to_the_uninterrupted_run(tmp_path, base):
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    reference = train(
        run_config.load(demo.CONFIG_FILE, overrides(base, reference_dir)), log=lambda _: None
    )
    # Every step that follows a resume updates the weights (the random model earns its first
    # rewards in step 1).
    assert all(m["trained_samples"] > 0 for m in reference[1:STEPS])

    # Killed inside the safetensors writer, while step 4's checkpoint is being written.
    where = run_until_stopped(tmp_path, run_dir, "model-write", overrides(base, run_dir))
    assert where.exists() and ".model.partial-" in where.parent.name  # the torn write is there
    complete, temporary = on_disk(run_dir)
    assert complete == ["step-00000002"] and len(temporary) == 1
    assert temporary[0].startswith(".step-00000004.partial-")
    assert checkpoints.latest_checkpoint(run_dir).name == "step-00000002"
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2, 3]

    # Resumed from step 2 (the torn temporary removed, steps 2 and 3 run again), killed right
    # after step 4's checkpoint.
    run_until_stopped(tmp_path, run_dir, "after-save", None)
    assert on_disk(run_dir) == (["step-00000002", "step-00000004"], [])
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2, 3]

    # Resumed from step 4, killed while the last save deletes the oldest checkpoint: step 2's
    # is already out of the final name space.
    run_until_stopped(tmp_path, run_dir, "delete", None)
    complete, temporary = on_disk(run_dir)
    assert complete == ["step-00000004", "step-00000005"] and len(temporary) == 1
    assert temporary[0].startswith(".step-00000002.partial-")

    # Resumed at the last step through the command line: only the final evaluation is left.
    assert cli.main(["train", "--resume", str(run_dir)]) == 0
    assert on_disk(run_dir) == (["step-00000004", "step-00000005"], [])
    assert without_timings(metrics(run_dir)) == without_timings(reference)
    assert without_timings(metrics(reference_dir)) == without_timings(reference)
    for step in (4, 5):  # written by the runs resumed from steps 2 and 4
        assert_same_checkpoint(
            checkpoints.checkpoint_dir(reference_dir, step),
            checkpoints.checkpoint_dir(run_dir, step),
        )
    # A resume whose prompts would not be the run's is refused before anything is rewritten.
    other_data = run_config.load(demo.CONFIG_FILE, [*overrides(base, run_dir), "task.max_digits=3"])
    files = {p: p.read_bytes() for p in (run_dir / "config.toml", run_dir / "metrics.jsonl")}
    with pytest.raises(ValueError, match="prompts_sha256 saved '[0-9a-f]{64}', now"):
        train(other_data, log=lambda _: None, resume=True)
    assert all(p.read_bytes() == content for p, content in files.items())

    # A model and a trainer state of different checkpoints are refused, nothing restored.
    step5 = checkpoints.checkpoint_dir(run_dir, 5)
    policy = load_pretrained(step5 / "model", tiny_precision("nvfp4"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="are not of one checkpoint"):
        checkpoints.load(
            checkpoints.checkpoint_dir(run_dir, 4), MasterAdamW(policy.parameters(), OPTIM)
        )

    # A finished run extended: the steps of a run that long from the start.
    longer_dir = tmp_path / "longer"
    longer = run_config.load(
        demo.CONFIG_FILE, [*overrides(base, longer_dir), f"run.steps={STEPS + 1}"]
    )
    longer_history = train(longer, log=lambda _: None)
    assert cli.main(["train", "--resume", str(run_dir), "--set", f"run.steps={STEPS + 1}"]) == 0
    assert without_timings(metrics(run_dir)) == without_timings(longer_history)
    assert_same_checkpoint(
        checkpoints.checkpoint_dir(longer_dir, STEPS + 1),
        checkpoints.checkpoint_dir(run_dir, STEPS + 1),
    )


def write_metrics(run_dir: Path, text: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir / "metrics.jsonl"


def test_metrics_are_cut_back_to_the_checkpoint(tmp_path):
    entries = "".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(4))
    file = write_metrics(tmp_path, entries + '{"step": 4, "rew')  # the last write cut short
    assert run_directory.cut_metrics(tmp_path, 2) == [
        {"step": 0, "reward": 0.0},
        {"step": 1, "reward": 0.1},
    ]
    assert file.read_text() == entries[: entries.index('{"step": 2')]
    assert run_directory.cut_metrics(tmp_path, 0) == [] and file.read_text() == ""
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left

    write_metrics(tmp_path, entries.replace('{"step": 1', '{"step": x', 1))
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics entry"):
        run_directory.cut_metrics(tmp_path, 3)
    write_metrics(tmp_path, entries.replace('{"step": 1', '{"step": 5', 1))
    with pytest.raises(ValueError, match=r"steps \[0, 2\] before step 3; .* steps 0 .. 2"):
        run_directory.cut_metrics(tmp_path, 3)


def test_resume_takes_the_runs_config_and_changes_only_what_keeps_the_run(tmp_path, base):
    moved = tmp_path / "moved"  # the run directory is where it is now, not where it was made
    config = run_config.load(demo.CONFIG_FILE, overrides(base, tmp_path / "elsewhere"))
    moved.mkdir()
    (moved / "config.toml").write_text(run_config.to_toml(config))
    resumed = run_directory.resume_config(moved, ["run.steps=9", "run.keep_checkpoints=1"])
    assert resumed.run.out_dir == str(moved) and resumed.run.steps == 9
    assert resumed.run.keep_checkpoints == 1 and resumed.optim == config.optim
    with pytest.raises(ValueError, match=r"optim.lr would make it another run"):
        run_directory.resume_config(moved, ["optim.lr=1e-2"])
    with pytest.raises(FileNotFoundError, match="has no config.toml"):
        run_directory.resume_config(tmp_path / "nothing")
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    assert all(key in parser.format_help() for key in run_directory.RESUME_OVERRIDES)


def test_a_new_run_refuses_a_directory_with_checkpoints(tmp_path, base):
    run_dir = tmp_path / "run"
    checkpoints.checkpoint_dir(run_dir, 3).mkdir(parents=True)
    config = run_config.load(demo.CONFIG_FILE, overrides(base, run_dir))
    with pytest.raises(ValueError, match=r"holds checkpoints .*step-00000003.*--resume"):
        train(config, log=lambda _: None)
    # Metrics of a run that saved no checkpoint are replaced, and said so.
    earlier = write_metrics(tmp_path / "earlier", '{"step": 0}\nnot json\n')
    config = run_config.load(demo.CONFIG_FILE, [*overrides(base, earlier.parent), "run.steps=1"])
    lines = []
    train(config, log=lines.append)
    assert f"replacing {earlier}, left by an earlier run that saved no checkpoint" in lines
    assert [m["step"] for m in metrics(earlier.parent)] == [0, 1]


def test_a_failed_save_leaves_no_checkpoint(tmp_path):
    policy = qat_model(
        tiny_precision("nvfp4"), config=tiny_config(vocab_size=16), dtype=torch.bfloat16
    )
    optimizer = MasterAdamW(policy.parameters(), OPTIM)
    with torch.no_grad():
        policy.norm.weight[0] = float("nan")
    position = checkpoints.Position(
        step=1, policy_version=1, seed=0, sampling_seed=1, prompts_sha256="0" * 64
    )
    with pytest.raises(ValueError, match="norm.weight: 1 non-finite"):
        checkpoints.save(tmp_path, position, policy, optimizer, keep=1)
    assert list((tmp_path / checkpoints.FOLDER).iterdir()) == []
