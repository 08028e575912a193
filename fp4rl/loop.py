"""The GRPO loop: rollout on the NVFP4 engine -> reward -> advantages -> update -> refit.

`train(config)` reads top to bottom. The trainer holds the QAT model (BF16-layout parameters,
FP32 masters, fake-quantized W4A4 experts); the engine holds its packed twin, refit from the
trainer after every update through `fp4rl.refit`. The engine records routing and guidance as
its config says; ``[align]`` says whether the trainer replays and follows them, and how often
the mismatch between the two is measured (`fp4rl.train.observe`). Metrics go to
``metrics.jsonl`` in the run directory, one JSON object per step, and a summary line per step
to ``log``. Every ``run.checkpoint_every`` steps and after the last, the state goes to a
checkpoint (`fp4rl.checkpoints`); ``resume`` continues a run from its latest one.

With ``ranks`` (`fp4rl.distributed`, a process of a torchrun launch) the same loop runs on
every rank: each generates on its own engine for its share of the step's prompts, the rewards
are gathered so advantages and metrics are the whole step's, the trainer is an FSDP2 shard, the
refit gathers one layer at a time, and rank 0 alone logs and writes the run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import time
from pathlib import Path

import torch

from fp4rl import checkpoints
from fp4rl.config import RunConfig, to_toml
from fp4rl.distributed import Ranks, ShardedAdamW, gathered_records, shard_policy
from fp4rl.model.weights import load_pretrained
from fp4rl.progress import Progress
from fp4rl.records import capture_bytes_per_generated_token as capture_bytes
from fp4rl.records import collate
from fp4rl.refit import RefitReceiver, refit_records
from fp4rl.report import TensorBoardLog, check_tensorboard
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.tasks import Task, build_task, step_seed
from fp4rl.train.grpo import group_advantages
from fp4rl.train.observe import observe
from fp4rl.train.optim import MasterAdamW
from fp4rl.train.step import grpo_update

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device='cuda' but no CUDA device is available")
    return torch.device(device)


def setup(config: RunConfig) -> tuple[torch.device, torch.dtype]:
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    random.seed(config.run.seed)
    torch.manual_seed(config.run.seed)
    return resolve_device(config.model.device), DTYPES[config.model.dtype]


def train(
    config: RunConfig, *, log=print, resume: bool = False, ranks: Ranks | None = None
) -> list[dict]:
    """Run ``config.run.steps`` GRPO steps; returns the per-step metrics (also written to
    ``<out_dir>/metrics.jsonl``), the last entry holding the final held-out accuracy.

    A new run refuses a run directory that holds checkpoints. With ``resume``, the run in
    ``run.out_dir`` continues from its latest complete checkpoint (from step 0 if it has none):
    the trainer, the engine's weights and policy version, the random states and the metrics
    are those of the checkpoint's step, and on the CPU the steps that follow are bit for bit
    those of a run never stopped.

    ``ranks``: this process is one rank of a run over several (`fp4rl.distributed`); every
    rank calls ``train`` with the same config and returns the same metrics."""
    if config.run.tensorboard:
        check_tensorboard()  # a missing package stops the run before anything is loaded
    device, dtype = setup(config)
    writer = ranks is None or ranks.writer
    if ranks is not None:
        device = ranks.device
        log = log if writer else _silent
        ranks.share(config.rollout.prompts_per_step)  # too few prompts fail before any load
    run_dir = Path(config.run.out_dir)
    resume_from = _resume_point(run_dir, resume, log, writer)

    path, precision = config.model.path, config.precision
    task = build_task(config.task, model_dir=path, log=log)  # bad data fails before the model loads
    experts = "qat" if config.align.trainer_activations == "nvfp4" else "qat_weights"
    weights = path if resume_from is None else resume_from / "model"
    # Sharded, the policy is read on the CPU and each rank keeps only its shards on the device.
    on = device if ranks is None else "cpu"
    policy = load_pretrained(weights, precision, fp4_experts=experts, dtype=dtype, device=on)
    engine = Engine.from_pretrained(
        path, config.engine, precision=precision, dtype=dtype, device=device
    )
    _check_vocab(policy.config.vocab_size, task)
    if ranks is None:
        optimizer = MasterAdamW(policy.parameters(), config.optim)
    else:
        optimizer = ShardedAdamW(shard_policy(policy, ranks, dtype).parameters(), config.optim)
    receiver = RefitReceiver(engine)
    evaluator = Evaluator(engine, config, dtype=dtype, device=device, ranks=ranks)
    start, rng = 0, None
    if resume_from is not None:
        start, rng = _restore(resume_from, policy, optimizer, receiver, config, task, ranks)
    history = _open_run_dir(run_dir, config, start, resume, ranks)  # the steps before `start`
    held_out = task.held_out()
    replay, guided = config.align.resolve(config.engine)
    log(
        f"precision plan:\n{policy.plan}\nreplay={replay} guided={guided} "
        f"(the engine records guidance={config.engine.guidance})"
    )

    purge_step = start if resume else None  # TensorBoard hides what a killed attempt wrote
    tensorboard = None
    if config.run.tensorboard and writer:
        tensorboard = TensorBoardLog(run_dir, purge_step=purge_step)
    if rng is not None:
        rng.restore()  # last: loading the models above may draw random numbers
    metrics_path = run_dir / "metrics.jsonl" if writer else Path(os.devnull)
    with (
        open(metrics_path, "a" if resume else "w") as metrics_file,
        tensorboard or contextlib.nullcontext(),
    ):
        for step in range(start, config.run.steps):
            m: dict = {"step": step, "policy_version": engine.policy_version}
            if step % config.run.eval_every == 0:
                m.update(evaluator(policy, task, held_out))
            num = config.rollout.prompts_per_step
            problems = task.train_examples(seed=config.run.seed, step=step, num=num)
            mine = range(num) if ranks is None else ranks.share(num)  # this rank's prompts
            with phase(m, "rollout", device):
                completions = rollout(engine, task, problems, config, step, mine)
            keep, advantages = score(
                task, problems[mine.start : mine.stop], completions, config, m, ranks
            )
            every = config.align.observe_every
            if every and step % every == 0:
                batch = collate(completions[: config.run.micro_batch_seqs])
                forward = config.align.trainer_forward
                seen = observe(policy, batch, replay=replay, guided=guided, forward=forward)
                seen.update(
                    {f"{k}_bytes_per_token": v for k, v in capture_bytes(completions).items()}
                )
                # Sharded, every rank runs the forward (FSDP gathers in it); rank 0's is kept:
                # the single process's when rank 0's share holds run.micro_batch_seqs samples.
                m.update(seen if ranks is None else ranks.broadcast(seen))
            engine.release_kv()  # the trainer takes the memory of the pages while it runs
            with phase(m, "train", device), Progress(len(keep), f"step {step} train") as bar:
                if m["trained_samples"]:  # of every rank: all of them update, or none
                    m.update(
                        grpo_update(
                            policy,
                            optimizer,
                            [completions[i] for i in keep],
                            [advantages[i] for i in keep],
                            config=config.grpo,
                            replay=replay,
                            guided=guided,
                            temperature=config.rollout.temperature,
                            micro_batch_seqs=config.run.micro_batch_seqs,
                            stats=m,
                            on_micro_batch=bar.update,
                            forward=config.align.trainer_forward,
                            across=ranks,
                            spare=completions[0],
                        )
                    )
            with phase(m, "refit", device):
                receiver.receive(weights_of(policy, engine.policy_version + 1, ranks))
                engine.acquire_kv()
            if ranks is not None:  # the step waits for its slowest rank
                m.update(ranks.max({k: v for k, v in m.items() if _per_rank(k)}))
            m["rollout_tokens_per_s"] = m["generated_tokens"] / m["rollout_s"]
            history.append(m)
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
            if tensorboard:
                tensorboard.write(m)
            log(summary_line(m))
            if _checkpoint_due(step + 1, config):
                if writer:  # the metrics a resume keeps are on disk first
                    os.fsync(metrics_file.fileno())
                position = _position(config, task, step + 1, engine.policy_version)
                kept = config.run.keep_checkpoints
                if ranks is None:
                    saved = checkpoints.save(
                        run_dir, position, policy, optimizer, keep=kept, base_model=path
                    )
                else:
                    saved = checkpoints.save_sharded(
                        run_dir, position, policy, optimizer, keep=kept, base_model=path,
                        ranks=ranks, dtype=dtype,
                    )  # fmt: skip
                log(f"checkpoint {saved}")
        final = {"step": config.run.steps, "policy_version": engine.policy_version}
        final.update(evaluator(policy, task, held_out))
        history.append(final)
        metrics_file.write(json.dumps(final) + "\n")
        if tensorboard:
            tensorboard.write(final)
    for key in ("held_out_accuracy", "held_out_greedy"):
        log(f"{key.replace('_', ' ')} {history[0][key]:.3f} -> {final[key]:.3f}")
    return history


def rollout(engine: Engine, task: Task, problems: list, config: RunConfig, step: int, mine: range):
    """The completions of ``problems[mine]`` (this rank's share; all of them in one process),
    sampled as one engine given every problem would sample them."""
    total = len(mine) * config.rollout.samples_per_prompt
    with Progress(total, f"step {step} rollout") as bar:
        prompts = [list(p.prompt_ids) for p in problems[mine.start : mine.stop]]
        params = sampling(config, step, task.stop_token_ids)
        return engine.generate(prompts, params, on_finish=bar.update, first_prompt_index=mine.start)


def score(
    task: Task, problems, completions, config: RunConfig, m: dict, ranks: Ranks | None = None
) -> tuple[list[int], list[float]]:
    """Rewards and group advantages; returns the samples to train on and every advantage.

    Samples that teach nothing are left out of the update, and counted: those of groups whose
    rewards are all equal (advantage exactly 0) and, with ``grpo.mask_truncated``, those cut
    off by ``max_tokens``. With ``ranks``, ``problems`` and ``completions`` are this rank's
    share: every rank's rewards are gathered, so the metrics are the whole step's (a group is
    one prompt's samples, on one rank), and the samples and advantages returned are this
    rank's."""
    n = config.rollout.samples_per_prompt
    rewards = [
        [task.reward(p, c.completion_ids) for c in completions[g * n : (g + 1) * n]]
        for g, p in enumerate(problems)
    ]
    truncated = [c.finish_reason == "length" for c in completions]
    lengths = [len(c.completion_ids) for c in completions]
    first = 0  # this rank's first completion in the step's
    if ranks is not None:
        parts = ranks.gather((rewards, truncated, lengths))
        first = sum(len(part[1]) for part in parts[: ranks.rank])
        rewards, truncated, lengths = ([x for part in parts for x in part[k]] for k in range(3))
    rewards_GS = torch.tensor(rewards)
    adv_GS, zero_var_G = group_advantages(
        rewards_GS,
        normalize_std=config.grpo.normalize_std,
        leave_one_out=config.grpo.leave_one_out,
    )
    keep = [
        i
        for i in range(len(truncated))
        if not zero_var_G[i // n] and not (config.grpo.mask_truncated and truncated[i])
    ]
    generated = sum(lengths)
    m.update(
        reward=float(rewards_GS.mean()),
        response_length=generated / len(lengths),
        generated_tokens=generated,
        zero_variance_groups=int(zero_var_G.sum()),
        truncated=sum(truncated),
        trained_samples=len(keep),
        replay_fallback_tokens=0,  # the update adds the tokens routed live for want of a record
    )
    last = first + len(completions)
    mine = [i - first for i in keep if first <= i < last]
    return mine, adv_GS.flatten().tolist()[first:last]


@contextlib.contextmanager
def phase(m: dict, name: str, device: torch.device):
    """Time a phase into ``m[name + "_s"]``; on CUDA also its peak memory (GiB) into
    ``m["peak_" + name + "_gib"]``, counted from the phase's start."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize(device)
        m[f"peak_{name}_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    m[f"{name}_s"] = time.perf_counter() - start


def sampling(config: RunConfig, step: int, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    r = config.rollout
    return SamplingParams(
        n=r.samples_per_prompt,
        temperature=r.temperature,
        max_tokens=r.max_tokens,
        stop_token_ids=stop_token_ids,
        seed=step_seed(config.run.seed, step),
    )


def evaluate(
    engine: Engine,
    task: Task,
    problems: list,
    config: RunConfig,
    *,
    on_finish=None,
    ranks: Ranks | None = None,
) -> dict[str, float]:
    """Held-out accuracy of the policy as the engine holds it: ``held_out_accuracy``, the share
    of completions with the full reward 1.0 sampled as the rollout samples (its temperature,
    ``run.eval_samples`` per problem, the same seed at every evaluation), and
    ``held_out_greedy``, greedy decoding. ``on_finish(n)`` is told of finished samples. With
    ``ranks``, each rank's engine takes its share of the problems and the counts are summed."""
    if ranks is None:
        mine = range(len(problems))
    else:
        mine = ranks.share(len(problems), "the held-out problems (task.num_held_out)")
    prompts = [list(p.prompt_ids) for p in problems[mine.start : mine.stop]]
    r = config.rollout
    params = {
        "held_out_accuracy": SamplingParams(
            n=config.run.eval_samples,
            temperature=r.temperature,
            max_tokens=r.max_tokens,
            stop_token_ids=task.stop_token_ids,
            seed=config.run.seed,
        ),
        "held_out_greedy": SamplingParams(
            temperature=0, max_tokens=r.max_tokens, stop_token_ids=task.stop_token_ids
        ),
    }
    out = {}
    for key, sampling_params in params.items():
        done = engine.generate(
            prompts, sampling_params, on_finish=on_finish, first_prompt_index=mine.start
        )
        n = sampling_params.n
        exact = [
            task.reward(problems[mine.start + i // n], c.completion_ids) == 1.0
            for i, c in enumerate(done)
        ]
        if ranks is None:
            out[key] = sum(exact) / len(exact)
        else:
            counts = ranks.sum({"exact": sum(exact), "all": len(exact)})
            out[key] = counts["exact"] / counts["all"]
    return out


class Evaluator:
    """Held-out evaluation on the engine ``run.eval_precision`` names: the rollout engine
    itself ("rollout"), or a twin over the same checkpoint with every module in the model's
    dtype and none FP4 ("bf16": no FP4 experts, BF16 KV, nothing recorded), so runs of any
    rollout precision are measured by one evaluator. The twin is refit from the trainer when
    the rollout engine's policy version has moved past its own, and holds KV pages only while
    it evaluates."""

    def __init__(self, engine: Engine, config: RunConfig, *, dtype, device, ranks=None) -> None:
        self.rollout_engine, self.config, self.ranks = engine, config, ranks
        self.engine, self.receiver = engine, None
        if config.run.eval_precision == "bf16":
            precision = dataclasses.replace(config.precision, experts="bf16", kv_cache="bf16")
            engine_config = dataclasses.replace(config.engine, capture_routing=False, guidance=None)
            self.engine = Engine.from_pretrained(
                config.model.path, engine_config, precision=precision, dtype=dtype, device=device
            )
            self.engine.release_kv()
            self.receiver = RefitReceiver(self.engine)

    def __call__(self, policy, task: Task, problems: list) -> dict[str, float]:
        if self.receiver is None:
            return evaluate(self.engine, task, problems, self.config, ranks=self.ranks)
        version = self.rollout_engine.policy_version
        if self.engine.policy_version != version:
            self.receiver.receive(weights_of(policy, version, self.ranks))
        self.engine.acquire_kv()
        try:
            return evaluate(self.engine, task, problems, self.config, ranks=self.ranks)
        finally:
            self.engine.release_kv()


def summary_line(m: dict) -> str:
    parts = [f"step {m['step']:>4}", f"reward {m['reward']:.3f}"]
    if "held_out_accuracy" in m:
        parts.append(f"held-out {m['held_out_accuracy']:.3f} (greedy {m['held_out_greedy']:.3f})")
    parts.append(f"len {m['response_length']:.1f}")
    if "code_agreement" in m:
        parts.append(f"codes {m['code_agreement']:.4f}")
    if "loss" in m:
        parts += [
            f"entropy {m['entropy']:.3f}",
            f"clip {m['clip_frac_low'] + m['clip_frac_high']:.3f}",
            f"is-corr {m['correction_frac']:.3f}",
            f"gap {m['token_mult_prob_error']:.5f}",
        ]
    parts.append(f"trained {m['trained_samples']}")
    parts.append(f"{m['rollout_s']:.2f}+{m['train_s']:.2f}+{m['refit_s']:.2f}s")
    return " | ".join(parts)


def weights_of(policy, policy_version: int, ranks: Ranks | None):
    """The refit stream of the trainer's weights: its parameters as they are in one process,
    gathered one FSDP unit at a time when sharded (`fp4rl.distributed.gathered_records`)."""
    if ranks is None:
        return refit_records(policy, policy_version=policy_version)
    return gathered_records(policy, policy_version)


def _open_run_dir(
    run_dir: Path, config: RunConfig, start: int, resume: bool, ranks: Ranks | None
) -> list[dict]:
    """Write the run's config and, on a resume, cut its metrics back to ``start``: rank 0's
    work; the kept metrics, on every rank."""

    def write() -> list[dict]:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoints.write_atomic(run_dir / "config.toml", to_toml(config))
        return checkpoints.cut_metrics(run_dir, start) if resume else []

    return write() if ranks is None else ranks.on_writer(write)


def _per_rank(key: str) -> bool:
    """Whether a metric is a rank's own (a phase's time or peak memory), to be maxed."""
    return key.endswith("_s") or (key.startswith("peak_") and key.endswith("_gib"))


def _silent(_line: str) -> None:
    """The log of ranks other than 0."""


def _resume_point(run_dir: Path, resume: bool, log, writer: bool = True) -> Path | None:
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


def _restore(
    checkpoint: Path, policy, optimizer, receiver, config: RunConfig, task: Task, ranks=None
):
    """Trainer state, then the engine refit from it: ``(start step, random states)``. A
    checkpoint written by any number of ranks is read by any number."""
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    dtype = DTYPES[config.model.dtype]
    saved, rng = checkpoints.load(checkpoint, optimizer, names=names, dtype=dtype, ranks=ranks)
    if saved.step > config.run.steps:
        raise ValueError(f"{checkpoint} is at step {saved.step}, past run.steps={config.run.steps}")
    expected = _position(config, task, saved.step, saved.policy_version)
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


def _checkpoint_due(done: int, config: RunConfig) -> bool:
    """Whether the state after ``done`` steps is saved: every ``run.checkpoint_every`` steps
    and after the last."""
    every = config.run.checkpoint_every
    return done == config.run.steps or (every > 0 and done % every == 0)


def _position(config: RunConfig, task: Task, step: int, policy_version: int):
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


def _check_vocab(vocab_size: int, task: Task) -> None:
    if vocab_size < task.vocab_size:
        raise ValueError(
            f"the model's vocab_size={vocab_size} does not cover the task's {task.vocab_size} "
            "token ids (its tokenizer's)"
        )
