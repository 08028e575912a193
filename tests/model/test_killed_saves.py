"""A save killed mid-write leaves its hidden partial directory; the next save removes it, and
never the partial directory of a save still running in another process.

The other process is real: a child interpreter that starts ``save_checkpoint`` and stops for
good once its first shard is on disk (its own shard writer, wrapped in the child, prints the
file and sleeps), so the test kills it at a known point rather than racing a large write.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from fp4rl.model.checkpoint import load_state_dict, save_checkpoint
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import tiny_qwen3_moe
from fp4rl.model.transformer import build_model, init_weights

ROOT = Path(__file__).resolve().parents[2]
SHARD_BYTES = 40_000  # several shards: the child stops after the first

HANGING_SAVE = f"""
import sys, time
import torch
from fp4rl.model.checkpoint import save_checkpoint, writer
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import tiny_qwen3_moe
from fp4rl.model.transformer import build_model, init_weights

write = writer._write_safetensors

def write_then_hang(file, tensors):
    write(file, tensors)
    print(file, flush=True)
    time.sleep(600)

writer._write_safetensors = write_then_hang
precision = PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0)
model = build_model(tiny_qwen3_moe(), precision, fp4_experts="qat", dtype=torch.float32)
init_weights(model)
save_checkpoint(model.state_dict(), tiny_qwen3_moe(), sys.argv[1], max_shard_bytes={SHARD_BYTES})
"""


def start_hanging_save(target: Path) -> tuple[subprocess.Popen, Path]:
    """A child process stopped inside ``save_checkpoint(..., target)``; its first shard file."""
    child = subprocess.Popen(
        [sys.executable, "-c", HANGING_SAVE, str(target)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = child.stdout.readline().strip()
    if not line:
        child.kill()
        raise AssertionError(f"the child save did not start:\n{child.communicate()[1]}")
    return child, Path(line)


def kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait()  # reaped: a zombie still answers os.kill(pid, 0)
    child.stdout.close()
    child.stderr.close()


def partials(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".partial-" in p.name)


def state_and_config():
    config = tiny_qwen3_moe()
    precision = PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0)
    model = build_model(config, precision, fp4_experts="qat", dtype=torch.float32)
    init_weights(model, seed=3)
    return {n: t.clone() for n, t in model.state_dict().items()}, config


def assert_loads(path: Path, state, config) -> None:
    loaded = load_state_dict(path, config)
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[n], state[n]) for n in state)


def test_the_next_save_removes_the_partial_directory_of_a_killed_one(tmp_path):
    parent = tmp_path / "checkpoints"
    child, shard = start_hanging_save(parent / "step-1")
    kill(child)
    partial = shard.parent
    assert partial.parent == parent and partial.name.startswith(".step-1.partial-")
    assert f"-{child.pid}-" in partial.name and shard.stat().st_size > 0
    assert not (parent / "step-1").exists()

    state, config = state_and_config()
    save_checkpoint(state, config, parent / "step-2")
    assert partials(parent) == [] and os.listdir(parent) == ["step-2"]
    assert_loads(parent / "step-2", state, config)


def test_a_running_save_keeps_its_partial_directory(tmp_path):
    parent = tmp_path / "checkpoints"
    state, config = state_and_config()
    child, shard = start_hanging_save(parent / "step-1")
    try:
        running = shard.parent.name
        # Named as this process's own save (alive), and as a dead process on another host.
        host_pidns, _, _ = running.removeprefix(".step-1.partial-").rpartition(f"-{child.pid}-")
        own = f".step-0.partial-{host_pidns}-{os.getpid()}-{'0' * 12}"
        elsewhere = f".step-0.partial-elsewhere-{host_pidns.rpartition('-')[2]}-1-{'a' * 12}"
        unknown = ".step-0.partial-0123456789ab"  # another naming: not known to be dead
        for name in (own, elsewhere, unknown):
            (parent / name).mkdir()

        save_checkpoint(state, config, parent / "step-2")
        assert partials(parent) == sorted([running, own, elsewhere, unknown])
        assert shard.exists()
        assert_loads(parent / "step-2", state, config)
    finally:
        kill(child)
    save_checkpoint(state, config, parent / "step-3")  # now dead: removed
    assert partials(parent) == sorted([own, elsewhere, unknown])
