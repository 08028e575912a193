"""A run's checkpoints: written whole or not at all, and what a resume reads back.

``<run_dir>/checkpoints/step-<8-digit step>/`` is the state after that many completed GRPO
steps:

- ``model/``: the policy as a Hugging Face checkpoint (config.json + safetensors, written by
  `fp4rl.model.checkpoint.save_checkpoint`; loadable by `fp4rl.model.weights.load_pretrained`
  and by transformers), with the tokenizer and generation files of the run's base model;
- ``trainer.pt``: the optimizer's state (`MasterAdamW.state_dict`: FP32 masters, AdamW moments,
  update count) and torch's CPU and CUDA random states; a run of several ranks
  (`fp4rl.distributed`) keeps there only the update count and rank 0's random states, and
  writes its sharded masters and moments by parameter name to ``optimizer/`` with
  ``torch.distributed.checkpoint`` (`save_sharded`), which any number of ranks, one process
  without a process group included, reads back (`load`);
- ``state.json``: the `Position` (step, policy version, run seed, and the next step's sampling
  seed and prompts' fingerprint: the data position) and Python's random state.

A checkpoint is complete iff its directory has that final name: it is written and fsynced
under a hidden temporary name in the same ``checkpoints/`` folder, then renamed. A crash at any
moment leaves the earlier checkpoints intact and at most a temporary directory, which a later
save or resume removes once its writer is dead. Old checkpoints are taken out of the final
name space by a rename before they are deleted, so no torn one ever carries a final name.

Does not own the rest of the run directory (`fp4rl.run_dir`: ``metrics.jsonl`` cut back on a
resume, `resume_config`), the order of the loop (`fp4rl.loop`), the safetensors layout
(`fp4rl.model.checkpoint`) or the optimizer (`fp4rl.train.optim`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

from fp4rl.distributed import Ranks, full_state_dict
from fp4rl.model.checkpoint import save_checkpoint
from fp4rl.model.checkpoint.writer import fsync_path, partial_path, remove_dead_partials
from fp4rl.train.optim import MasterAdamW

FORMAT = 1  # of trainer.pt and state.json; a resume refuses any other
FOLDER = "checkpoints"
_FINAL = re.compile(r"step-(\d{8})")
# Temporaries are .step-NNNNNNNN.partial-HOST-PIDNS-PID-RANDOM (`partial_path`): a save in
# progress, an old checkpoint being deleted, or what a killed process left of either.
# Files of the base model that make a checkpoint directory a whole model (tokenizer, chat
# template, EOS ids), copied into every checkpoint's model/ when present.
MODEL_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Position:
    """Where a run stands after ``step`` completed GRPO steps."""

    step: int  # completed steps: the next step's index, the data position
    policy_version: int  # the engine's weights version after the last refit
    seed: int  # run.seed: each step's prompts and sampling seed derive from (seed, step)
    sampling_seed: int  # SamplingParams.seed of the next step's rollout
    prompts_sha256: str  # of the next step's prompt token ids: the data a resume must see


@dataclass(frozen=True, slots=True)
class RandomStates:
    """Python's, torch's CPU and (when present) every CUDA device's random state."""

    python: tuple
    torch_cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...]

    @classmethod
    def capture(cls) -> RandomStates:
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else ()
        return cls(random.getstate(), torch.get_rng_state(), cuda)

    def restore(self) -> None:
        """Set them all; CUDA states only on a machine with CUDA devices (fp4rl draws none)."""
        random.setstate(self.python)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda[: torch.cuda.device_count()])


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / FOLDER / f"step-{step:08d}"


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    folder = Path(run_dir) / FOLDER
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if _FINAL.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or None."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def save(
    run_dir: str | Path,
    position: Position,
    policy: torch.nn.Module,
    optimizer: MasterAdamW,
    *,
    keep: int,
    base_model: str | Path | None = None,
) -> Path:
    """Write the checkpoint of ``position.step``, then delete all but the ``keep`` newest.

    ``policy`` is the trainer's model (its parameters go to ``model/`` in their own dtype),
    ``base_model`` the directory whose `MODEL_FILES` are copied beside them. Raises
    FileExistsError if that step's checkpoint exists; on any error nothing is left under a
    final name.
    """
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    folder = Path(run_dir) / FOLDER
    final = checkpoint_dir(run_dir, position.step)
    if final.exists():
        raise FileExistsError(f"{final} exists; not overwriting a checkpoint")
    files = {} if base_model is None else _model_files(Path(base_model))
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale(run_dir)
    tmp = partial_path(final)
    tmp.mkdir()
    try:
        save_checkpoint(policy.state_dict(), policy.config, tmp / "model", files=files)
        _write_trainer(tmp, optimizer.state_dict(), position)
        os.rename(tmp, final)
        fsync_path(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in complete_checkpoints(run_dir)[:-keep]:
        _delete(old)
    return final


def save_sharded(
    run_dir: str | Path,
    position: Position,
    policy: torch.nn.Module,
    optimizer: MasterAdamW,
    *,
    keep: int,
    base_model: str | Path | None,
    ranks: Ranks,
    dtype: torch.dtype,
) -> Path:
    """`save` for a policy sharded over ``ranks`` (`fp4rl.distributed`); every rank calls it.

    Rank 0 makes the temporary directory and writes ``model/`` (the weights gathered one
    tensor at a time, in ``dtype``), ``trainer.pt`` and ``state.json``; every rank writes its
    shard of the masters and moments to ``optimizer/`` (`torch.distributed.checkpoint`). Only
    when all of it is there does rank 0 rename the directory to its final name. An error on
    any rank leaves no final name; rank 0's errors reach every rank."""
    final = checkpoint_dir(run_dir, position.step)

    def begin() -> Path:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if final.exists():
            raise FileExistsError(f"{final} exists; not overwriting a checkpoint")
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(run_dir)
        tmp = partial_path(final)
        tmp.mkdir()
        return tmp

    tmp = Path(ranks.on_writer(begin))
    try:
        weights = full_state_dict(policy, dtype, ranks)
        names = [n for n, p in policy.named_parameters() if p.requires_grad]
        state = optimizer.named_state(names)
        dcp.save({"params": state["params"]}, checkpoint_id=tmp / "optimizer")
        ranks.barrier()  # every shard is written before rank 0 makes the directory final

        def finish() -> None:
            files = {} if base_model is None else _model_files(Path(base_model))
            save_checkpoint(weights, policy.config, tmp / "model", files=files)
            fsync_path(tmp / "optimizer")  # the shards' names (their contents are fsynced by DCP)
            optimizer_state = {"sharded": "optimizer", "num_updates": state["num_updates"]}
            _write_trainer(tmp, optimizer_state, position, world_size=ranks.world_size)
            os.rename(tmp, final)
            fsync_path(final.parent)
            for old in complete_checkpoints(run_dir)[:-keep]:
                _delete(old)

        ranks.on_writer(finish)
    except BaseException:
        if ranks.writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_trainer(tmp: Path, optimizer_state: dict, position: Position, **extra) -> None:
    """``trainer.pt`` and ``state.json`` of a checkpoint being written, fsynced with ``tmp``."""
    rng = RandomStates.capture()
    trainer = {
        "format": FORMAT,
        "optimizer": optimizer_state,
        "torch_cpu_rng": rng.torch_cpu,
        "cuda_rng": list(rng.cuda),
        **extra,
    }
    torch.save(trainer, tmp / "trainer.pt")
    fsync_path(tmp / "trainer.pt")
    state = {"format": FORMAT, **asdict(position), "python_rng": _json_rng(rng.python)}
    _write_fsynced(tmp / "state.json", json.dumps(state) + "\n")
    fsync_path(tmp)  # the names inside it, before they become visible under the final name


def load(
    checkpoint: str | Path,
    optimizer: MasterAdamW,
    *,
    names: list[str] | None = None,
    dtype: torch.dtype | None = None,
    ranks: Ranks | None = None,
) -> tuple[Position, RandomStates]:
    """Restore ``optimizer`` (masters, moments, update count; the masters rounded into its
    parameters) from ``checkpoint``; returns the position and the random states to restore
    once everything that draws random numbers at start-up has run.

    ``optimizer``'s parameters must hold the checkpoint's ``model/`` weights (the policy is
    loaded from there): each must equal its saved master rounded to the parameter's dtype, or
    the model and trainer state are not of one checkpoint and nothing is restored.

    A checkpoint of a sharded run (``optimizer/``) is read by parameter name: ``names`` are
    ``optimizer.params``' names, ``dtype`` the dtype ``model/`` holds (FP32 shards hold its
    values) and ``ranks`` the sharded trainer's ranks, or None for one process.
    """
    checkpoint = Path(checkpoint)
    state = json.loads((checkpoint / "state.json").read_text())
    trainer = torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=True)
    for name, found in (("state.json", state.get("format")), ("trainer.pt", trainer["format"])):
        if found != FORMAT:
            raise ValueError(f"{checkpoint / name}: format {found!r}, this fp4rl reads {FORMAT}")
    if "sharded" in trainer["optimizer"] or ranks is not None:
        _load_by_name(checkpoint, trainer["optimizer"], optimizer, names, dtype, ranks)
    else:
        _load_whole(checkpoint, trainer["optimizer"], optimizer)
    position = Position(**{f.name: state[f.name] for f in fields(Position)})
    python_rng = _python_rng(state["python_rng"])
    return position, RandomStates(python_rng, trainer["torch_cpu_rng"], tuple(trainer["cuda_rng"]))


def _load_whole(checkpoint: Path, saved: dict, optimizer: MasterAdamW) -> None:
    """A single process's ``trainer.pt`` into a single process's optimizer."""
    masters = saved["masters"]
    if len(masters) != len(optimizer.params):
        raise ValueError(
            f"{checkpoint}: {len(masters)} saved masters for {len(optimizer.params)} parameters"
        )
    for i, (p, master) in enumerate(zip(optimizer.params, masters, strict=True)):
        if p.shape != master.shape or not torch.equal(p, master.to(p.device, p.dtype)):
            raise ValueError(
                f"{checkpoint}: parameter {i} {tuple(p.shape)} of model/ is not its saved "
                f"master {tuple(master.shape)} rounded to {p.dtype}; model/ and trainer.pt "
                "are not of one checkpoint"
            )
    optimizer.load_state_dict(saved)


def _load_by_name(
    checkpoint: Path, saved: dict, optimizer: MasterAdamW, names, dtype, ranks: Ranks | None
) -> None:
    """Masters and moments by parameter name, into tensors of ``optimizer``'s own layout
    (whole, or this rank's shards): from ``optimizer/`` (resharded by
    `torch.distributed.checkpoint` to whatever the ranks now are), or from a single process's
    ``trainer.pt``, cut into this rank's shards."""
    if names is None or dtype is None:
        raise ValueError(f"{checkpoint}: reading the optimizer by name needs names and a dtype")
    if "sharded" in saved:
        target = _empty_named_state(optimizer, names)
        # One process reads every shard itself (no process group), ranks their own parts.
        dcp.load(target, checkpoint_id=checkpoint / saved["sharded"], no_dist=ranks is None)
        num_updates = saved["num_updates"]
    else:
        target, num_updates = _named_from_whole(saved, optimizer, names)
    bad = [
        i
        for i, (p, name) in enumerate(zip(optimizer.params, names, strict=True))
        if not _same_rounded(p, target["params"][name]["master"], dtype)
    ]
    if ranks is not None:
        bad = sorted(set().union(*ranks.gather(bad)))
    if bad:
        i = bad[0]
        raise ValueError(
            f"{checkpoint}: parameter {i} ({names[i]}) of model/ is not its saved master "
            f"rounded to {dtype} ({len(bad)} such); model/ and the optimizer state are not of "
            "one checkpoint"
        )
    optimizer.load_named_state(names, {"num_updates": num_updates, "params": target["params"]})


def _empty_named_state(optimizer: MasterAdamW, names: list[str]) -> dict:
    """Tensors shaped (and sharded) as ``optimizer``'s, for `torch.distributed.checkpoint` to
    fill in place."""
    return {
        "params": {
            name: {
                "master": torch.empty_like(m),
                "exp_avg": torch.empty_like(m),
                "exp_avg_sq": torch.empty_like(m),
                "step": torch.zeros((), dtype=torch.float32),
            }
            for name, m in zip(names, optimizer.masters, strict=True)
        }
    }


def _named_from_whole(saved: dict, optimizer: MasterAdamW, names: list[str]):
    """A single process's ``trainer.pt`` state by name, each tensor cut as ``optimizer``'s own
    (this rank's shard of a sharded one)."""
    masters = saved["masters"]
    if len(masters) != len(names):
        raise ValueError(f"{len(masters)} saved masters for {len(names)} parameters")
    # torch's state is indexed in the order of its parameter groups: matrices, then the rest
    # (`fp4rl.train.optim.adamw`).
    order = [i for i, m in enumerate(masters) if m.ndim >= 2]
    order += [i for i, m in enumerate(masters) if m.ndim < 2]
    moments = {order[k]: v for k, v in saved["optimizer"]["state"].items()}
    params = {}
    for i, (name, m) in enumerate(zip(names, optimizer.masters, strict=True)):
        if tuple(masters[i].shape) != tuple(m.shape):
            raise ValueError(f"{name}: saved {tuple(masters[i].shape)}, now {tuple(m.shape)}")
        zero = torch.zeros_like(masters[i])
        whole = moments.get(i, {})
        params[name] = {
            "master": _like(masters[i], m),
            "exp_avg": _like(whole.get("exp_avg", zero), m),
            "exp_avg_sq": _like(whole.get("exp_avg_sq", zero), m),
            "step": whole.get("step", torch.zeros(())).reshape(()).float(),
        }
    return {"params": params}, saved["num_updates"]


def _like(whole: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``whole`` laid out as ``target``: the same shards of the same mesh when it is a DTensor."""
    if isinstance(target, DTensor):
        return distribute_tensor(whole.to(target.device), target.device_mesh, target.placements)
    return whole.to(target.device)


def _same_rounded(param: torch.Tensor, master: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``param`` (this rank's part) holds ``master`` rounded to ``dtype``."""
    if isinstance(param, DTensor):
        param, master = param.to_local(), master.to_local()
    rounded = master.to(param.device, dtype)
    return param.shape == master.shape and torch.equal(param.to(dtype), rounded)


def remove_stale(run_dir: str | Path) -> list[Path]:
    """Remove the temporary directories in ``checkpoints/`` whose writer is dead (this host
    and PID namespace, a process id that no longer exists); returns them. Those of a live
    process or of another host are left alone."""
    folder = Path(run_dir) / FOLDER
    return remove_dead_partials(folder) if folder.is_dir() else []


def write_atomic(file: Path, text: str) -> None:
    """Replace ``file`` with ``text`` through a fsynced temporary sibling and a rename."""
    tmp = file.with_name(f".{file.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    try:
        _write_fsynced(tmp, text)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(file.parent)


def _delete(checkpoint: Path) -> None:
    """Rename out of the final name space first: a crash mid-delete leaves a temporary."""
    doomed = partial_path(checkpoint)
    os.rename(checkpoint, doomed)
    fsync_path(checkpoint.parent)
    shutil.rmtree(doomed)


def _model_files(base_model: Path) -> dict[str, bytes]:
    return {n: (base_model / n).read_bytes() for n in MODEL_FILES if (base_model / n).is_file()}


def _json_rng(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_rng(saved: list) -> tuple:
    version, internal, gauss = saved
    return (version, tuple(internal), gauss)


def _write_fsynced(file: Path, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
