"""A run's directory over the run's life: where the run starts, what it writes, when it saves.

- `resume_point`: a new run refuses a directory that holds checkpoints; a resumed one starts
  from its latest complete checkpoint (the leftovers of killed saves removed first);
- `restore`: the trainer and its optimizer from that checkpoint, its data position checked
  against the config, the engine refit from the restored trainer;
- `open_run_dir`: ``config.toml`` written and, on a resume, ``metrics.jsonl`` cut back to the
  checkpoint's step (`cut_metrics`); `resume_config`, the config a resume runs under;
- `MetricsLog`: each step's metrics appended to ``metrics.jsonl`` (and, with
  ``run.tensorboard``, TensorBoard) and flushed; fsynced before a checkpoint;
- `checkpoint_due` and `save`: when the state is saved, and the save, of one process or
  sharded; `position`, where the run stands after a step.

With several ranks (`fp4rl.distributed`), rank 0 alone writes, its errors told to every rank.
Does not own the checkpoint layout (`fp4rl.checkpoints`) or the order of a step (`fp4rl.loop`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from fp4rl import checkpoints
from fp4rl.config import RunConfig, parse_override, to_toml
from fp4rl.config import load as load_config
from fp4rl.distributed import Ranks, weights_of
from fp4rl.metrics_log import TensorBoardLog
from fp4rl.tasks import Task, step_seed

# What `fp4rl train --resume` may change: how long the run goes on and what it keeps or
# mirrors. Everything else would make the steps after the resume those of another run.
RESUME_OVERRIDES = ("run.steps", "run.checkpoint_every", "run.keep_checkpoints", "run.tensorboard")


def resume_point(run_dir: Path, resume: bool, log, writer: bool = True) -> Path | None:
    """The checkpoint to resume from (None: from step 0); a new run may not overwrite one.
    Only the ``writer`` (rank 0) removes what killed saves left."""
    latest = checkpoints.latest_checkpoint(run_dir)
    if not resume:
        if latest is not None:
            raise ValueError(
                f"{run_dir} holds checkpoints of an earlier run ({latest.name}): continue it "
                f"with `fp4rl train --resume {run_dir}`, or choose another run.out_dir"
            )
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size:
            log(f"replacing {metrics}, left by an earlier run that saved no checkpoint")
        return None
    for stale in checkpoints.remove_stale(run_dir) if writer else []:
        log(f"removed {stale}, the leftover of a save that did not finish")
    log(f"resuming {run_dir} from " + (str(latest) if latest else "step 0: it has no checkpoint"))
    return latest


def restore(
    checkpoint: Path,
    policy,
    optimizer,
    receiver,
    config: RunConfig,
    task: Task,
    *,
    dtype: torch.dtype,
    ranks: Ranks | None = None,
):
    """Trainer state, then the engine refit from it: ``(start step, random states)``. A
    checkpoint written by any number of ranks is read by any number."""
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    saved, rng = checkpoints.load(checkpoint, optimizer, names=names, dtype=dtype, ranks=ranks)
    if saved.step > config.run.steps:
        raise ValueError(f"{checkpoint} is at step {saved.step}, past run.steps={config.run.steps}")
    expected = position(config, task, saved.step, saved.policy_version)
    differ = [
        k
        for k in ("seed", "sampling_seed", "prompts_sha256")
        if getattr(saved, k) != getattr(expected, k)
    ]
    if differ:
        raise ValueError(
            f"{checkpoint}: its data position is not this config's: "
            + ", ".join(
                f"{k} saved {getattr(saved, k)!r}, now {getattr(expected, k)!r}" for k in differ
            )
            + " (another run.seed, rollout.prompts_per_step, task or data file?)"
        )
    receiver.receive(weights_of(policy, saved.policy_version, ranks))
    return saved.step, rng


def open_run_dir(
    run_dir: Path, config: RunConfig, start: int, resume: bool, ranks: Ranks | None
) -> list[dict]:
    """Write the run's config and, on a resume, cut its metrics back to ``start``: rank 0's
    work; the kept metrics, on every rank."""

    def write() -> list[dict]:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoints.write_atomic(run_dir / "config.toml", to_toml(config))
        return cut_metrics(run_dir, start) if resume else []

    return write() if ranks is None else ranks.on_writer(write)


def cut_metrics(run_dir: str | Path, step: int) -> list[dict]:
    """Rewrite ``metrics.jsonl`` to hold only the entries of steps before ``step`` (those a
    resume from the checkpoint of ``step`` keeps) and return them. Atomic: the file is
    replaced by a rename. The entries must be those of steps 0 .. step - 1 in order; a last
    line cut short by a kill is dropped, any other unreadable line is an error naming it."""
    file = Path(run_dir) / "metrics.jsonl"
    text = file.read_text() if file.exists() else ""
    lines = text.split("\n")
    kept, entries = [], []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            entry = json.loads(line)
            entry_step = entry["step"]
            if not isinstance(entry_step, int):
                raise TypeError(f"step {entry_step!r} is not an int")
        except (ValueError, TypeError, KeyError) as err:
            if number == len(lines):  # no newline after it: a write cut short by a kill
                break
            raise ValueError(
                f"{file}:{number}: not a metrics entry ({err}): {line[:80]!r}"
            ) from None
        if entry_step < step:
            kept.append(line)
            entries.append(entry)
    steps = [e["step"] for e in entries]
    if steps != list(range(step)):
        raise ValueError(
            f"{file}: has entries for steps {steps[:10]}{'...' if len(steps) > 10 else ''} "
            f"before step {step}; resuming there needs exactly steps 0 .. {step - 1}"
        )
    checkpoints.write_atomic(file, "".join(line + "\n" for line in kept))
    return entries


def resume_config(run_dir: str | Path, overrides: list[str] = ()) -> RunConfig:
    """The config of the run in ``run_dir`` (its ``config.toml``), with ``run.out_dir`` set to
    ``run_dir`` and ``overrides`` applied, each of which must be one of `RESUME_OVERRIDES`."""
    run_dir = Path(run_dir)
    file = run_dir / "config.toml"
    if not file.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no config.toml")
    for text in overrides:
        section, key, _ = parse_override(text)
        if f"{section}.{key}" not in RESUME_OVERRIDES:
            raise ValueError(
                f"--set {text!r}: a resumed run may change only {', '.join(RESUME_OVERRIDES)}; "
                f"{section}.{key} would make it another run"
            )
    return load_config(file, [*overrides, f"run.out_dir={json.dumps(str(run_dir))}"])


class MetricsLog:
    """``metrics.jsonl`` opened for the steps from ``start`` on (appended to on a resume,
    written anew otherwise) and, with ``tensorboard``, TensorBoard beside it (a resumed run
    hides what a killed attempt wrote from ``start`` on). Only the ``writer`` (rank 0) writes;
    the other ranks' log writes nowhere."""

    def __init__(
        self, run_dir: Path, *, start: int, resume: bool, writer: bool, tensorboard: bool
    ) -> None:
        self.writer = writer
        self.tensorboard = None
        if tensorboard and writer:
            self.tensorboard = TensorBoardLog(run_dir, purge_step=start if resume else None)
        path = run_dir / "metrics.jsonl" if writer else Path(os.devnull)
        try:
            self.file = open(path, "a" if resume else "w")  # noqa: SIM115 (closed by close)
        except BaseException:
            if self.tensorboard:
                self.tensorboard.close()
            raise

    def write(self, m: dict) -> None:
        """One entry, flushed: a run killed after it loses nothing of it."""
        self.file.write(json.dumps(m) + "\n")
        self.file.flush()
        if self.tensorboard:
            self.tensorboard.write(m)

    def sync(self) -> None:
        """The entries written so far on disk (a checkpoint's metrics precede it)."""
        if self.writer:
            os.fsync(self.file.fileno())

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            if self.tensorboard:
                self.tensorboard.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def checkpoint_due(done: int, config: RunConfig) -> bool:
    """Whether the state after ``done`` steps is saved: every ``run.checkpoint_every`` steps
    and after the last."""
    every = config.run.checkpoint_every
    return done == config.run.steps or (every > 0 and done % every == 0)


def save(
    run_dir: Path,
    config: RunConfig,
    task: Task,
    done: int,
    policy_version: int,
    policy,
    optimizer,
    *,
    dtype: torch.dtype,
    ranks: Ranks | None = None,
) -> Path:
    """The checkpoint of the state after ``done`` steps (`fp4rl.checkpoints`): written by one
    process, or gathered and sharded over ``ranks``; the oldest beyond
    ``run.keep_checkpoints`` deleted."""
    at = position(config, task, done, policy_version)
    kept, base = config.run.keep_checkpoints, config.model.path
    if ranks is None:
        return checkpoints.save(run_dir, at, policy, optimizer, keep=kept, base_model=base)
    return checkpoints.save_sharded(
        run_dir, at, policy, optimizer, keep=kept, base_model=base, ranks=ranks, dtype=dtype
    )


def position(config: RunConfig, task: Task, step: int, policy_version: int):
    """Where the run stands after ``step`` steps, with the fingerprint of the prompts it sees
    next (a pure function of the run seed and the step)."""
    num = config.rollout.prompts_per_step
    prompts = task.train_examples(seed=config.run.seed, step=step, num=num)
    digest = hashlib.sha256(json.dumps([list(p.prompt_ids) for p in prompts]).encode())
    return checkpoints.Position(
        step=step,
        policy_version=policy_version,
        seed=config.run.seed,
        sampling_seed=step_seed(config.run.seed, step),
        prompts_sha256=digest.hexdigest(),
    )
