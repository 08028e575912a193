"""What the seam benchmarks (`guidance.py`, `seam_ops.py`) start from: a run config, its task,
and the checkpoint at ``model.path`` twice, as the trainer's QAT model and as the rollout's
packed model."""

from __future__ import annotations

import torch

from fp4rl.config import RunConfig, load
from fp4rl.loop import DTYPES
from fp4rl.model.weights import load_pretrained
from fp4rl.tasks import Task, build_task


def load_seam(config_file, overrides) -> tuple[RunConfig, Task, torch.nn.Module, torch.nn.Module]:
    """``(config, task, policy, packed)`` from a TOML file and ``section.key=value`` overrides;
    torch uses ``run.threads`` threads when the config sets them."""
    config = load(config_file, overrides)
    torch.set_num_threads(config.run.threads or torch.get_num_threads())
    path, precision, dtype = config.model.path, config.precision, DTYPES[config.model.dtype]
    task = build_task(config.task, model_dir=path)
    policy = load_pretrained(path, precision, fp4_experts="qat", dtype=dtype)
    packed = load_pretrained(path, precision, fp4_experts="packed", dtype=dtype)
    return config, task, policy, packed
