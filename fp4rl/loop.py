"""The GRPO loop: rollout on the NVFP4 engine -> reward -> advantages -> update -> refit.

`train(config)` reads top to bottom. The trainer holds the QAT model (BF16-layout parameters,
FP32 masters, fake-quantized W4A4 experts); the engine holds its packed twin, refit from the
trainer after every update through `fp4rl.refit`. The engine records routing and guidance as
its config says; ``[align]`` says whether the trainer replays and follows them, and how often
the mismatch between the two is measured (`fp4rl.train.observe`). Metrics go to
``metrics.jsonl`` in the run directory, one JSON object per step, and a summary line per step
to ``log``. Every ``run.checkpoint_every`` steps and after the last, the state goes to a
checkpoint (`fp4rl.checkpoints`); ``resume`` continues a run from its latest one.
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


def train(config: RunConfig, *, log=print, resume: bool = False) -> list[dict]:
    """Run ``config.run.steps`` GRPO steps; returns the per-step metrics (also written to
    ``<out_dir>/metrics.jsonl``), the last entry holding the final held-out accuracy.

    A new run refuses a run directory that holds checkpoints. With ``resume``, the run in
    ``run.out_dir`` continues from its latest complete checkpoint (from step 0 if it has none):
    the trainer, the engine's weights and policy version, the random states and the metrics
    are those of the checkpoint's step, and on the CPU the steps that follow are bit for bit
    those of a run never stopped."""
    if config.run.tensorboard:
        check_tensorboard()  # a missing package stops the run before anything is loaded
    device, dtype = setup(config)
    run_dir = Path(config.run.out_dir)
    resume_from = _resume_point(run_dir, resume, log)

    path, precision = config.model.path, config.precision
    task = build_task(config.task, model_dir=path, log=log)  # bad data fails before the model loads
    experts = "qat" if config.align.trainer_activations == "nvfp4" else "qat_weights"
    weights = path if resume_from is None else resume_from / "model"
    policy = load_pretrained(weights, precision, fp4_experts=experts, dtype=dtype, device=device)
    engine = Engine.from_pretrained(
        path, config.engine, precision=precision, dtype=dtype, device=device
    )
    _check_vocab(policy.config.vocab_size, task)
    optimizer = MasterAdamW(policy.parameters(), config.optim)
    receiver = RefitReceiver(engine)
    evaluator = Evaluator(engine, config, dtype=dtype, device=device)
    start, rng = 0, None
    if resume_from is not None:
        start, rng = _restore(resume_from, policy, optimizer, receiver, config, task)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoints.write_atomic(run_dir / "config.toml", to_toml(config))
    history = checkpoints.cut_metrics(run_dir, start) if resume else []  # steps before `start`
    held_out = task.held_out()
    replay, guided = config.align.resolve(config.engine)
    log(
        f"precision plan:\n{policy.plan}\nreplay={replay} guided={guided} "
        f"(the engine records guidance={config.engine.guidance})"
    )

    purge_step = start if resume else None  # TensorBoard hides what a killed attempt wrote
    tensorboard = TensorBoardLog(run_dir, purge_step=purge_step) if config.run.tensorboard else None
    if rng is not None:
        rng.restore()  # last: loading the models above may draw random numbers
    with (
        open(run_dir / "metrics.jsonl", "a" if resume else "w") as metrics_file,
        tensorboard or contextlib.nullcontext(),
    ):
        for step in range(start, config.run.steps):
            m: dict = {"step": step, "policy_version": engine.policy_version}
            if step % config.run.eval_every == 0:
                m.update(evaluator(policy, task, held_out))
            num = config.rollout.prompts_per_step
            problems = task.train_examples(seed=config.run.seed, step=step, num=num)
            with phase(m, "rollout", device):
                completions = rollout(engine, task, problems, config, step)
            keep, advantages = score(task, problems, completions, config, m)
            every = config.align.observe_every
            if every and step % every == 0:
                batch = collate(completions[: config.run.micro_batch_seqs])
                forward = config.align.trainer_forward
                m.update(observe(policy, batch, replay=replay, guided=guided, forward=forward))
                m.update({f"{k}_bytes_per_token": v for k, v in capture_bytes(completions).items()})
            engine.release_kv()  # the trainer takes the memory of the pages while it runs
            with phase(m, "train", device), Progress(len(keep), f"step {step} train") as bar:
                if keep:
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
                        )
                    )
            with phase(m, "refit", device):
                receiver.receive(refit_records(policy, policy_version=engine.policy_version + 1))
                engine.acquire_kv()
            m["rollout_tokens_per_s"] = m["generated_tokens"] / m["rollout_s"]
            history.append(m)
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()
            if tensorboard:
                tensorboard.write(m)
            log(summary_line(m))
            if _checkpoint_due(step + 1, config):
                os.fsync(metrics_file.fileno())  # the metrics a resume keeps are on disk first
                position = _position(config, task, step + 1, engine.policy_version)
                saved = checkpoints.save(
                    run_dir,
                    position,
                    policy,
                    optimizer,
                    keep=config.run.keep_checkpoints,
                    base_model=path,
                )
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


def rollout(engine: Engine, task: Task, problems: list, config: RunConfig, step: int):
    total = len(problems) * config.rollout.samples_per_prompt
    with Progress(total, f"step {step} rollout") as bar:
        prompts = [list(p.prompt_ids) for p in problems]
        params = sampling(config, step, task.stop_token_ids)
        return engine.generate(prompts, params, on_finish=bar.update)


def score(
    task: Task, problems, completions, config: RunConfig, m: dict
) -> tuple[list[int], list[float]]:
    """Rewards and group advantages; returns the samples to train on and every advantage.

    Samples that teach nothing are left out of the update, and counted: those of groups whose
    rewards are all equal (advantage exactly 0) and, with ``grpo.mask_truncated``, those cut
    off by ``max_tokens``."""
    n = config.rollout.samples_per_prompt
    rewards_GS = torch.tensor(
        [
            [task.reward(p, c.completion_ids) for c in completions[g * n : (g + 1) * n]]
            for g, p in enumerate(problems)
        ]
    )
    adv_GS, zero_var_G = group_advantages(
        rewards_GS,
        normalize_std=config.grpo.normalize_std,
        leave_one_out=config.grpo.leave_one_out,
    )
    truncated = [c.finish_reason == "length" for c in completions]
    keep = [
        i
        for i in range(len(completions))
        if not zero_var_G[i // n] and not (config.grpo.mask_truncated and truncated[i])
    ]
    generated = sum(len(c.completion_ids) for c in completions)
    m.update(
        reward=float(rewards_GS.mean()),
        response_length=generated / len(completions),
        generated_tokens=generated,
        zero_variance_groups=int(zero_var_G.sum()),
        truncated=sum(truncated),
        trained_samples=len(keep),
        replay_fallback_tokens=0,  # the update adds the tokens routed live for want of a record
    )
    return keep, adv_GS.flatten().tolist()


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
    engine: Engine, task: Task, problems: list, config: RunConfig, *, on_finish=None
) -> dict[str, float]:
    """Held-out accuracy of the policy as the engine holds it: ``held_out_accuracy``, the share
    of completions with the full reward 1.0 sampled as the rollout samples (its temperature,
    ``run.eval_samples`` per problem, the same seed at every evaluation), and
    ``held_out_greedy``, greedy decoding. ``on_finish(n)`` is told of finished samples."""
    prompts = [list(p.prompt_ids) for p in problems]
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
        done = engine.generate(prompts, sampling_params, on_finish=on_finish)
        n = sampling_params.n
        exact = [task.reward(problems[i // n], c.completion_ids) == 1.0 for i, c in enumerate(done)]
        out[key] = sum(exact) / len(exact)
    return out


class Evaluator:
    """Held-out evaluation on the engine ``run.eval_precision`` names: the rollout engine
    itself ("rollout"), or a twin over the same checkpoint with every module in the model's
    dtype and none FP4 ("bf16": no FP4 experts, BF16 KV, nothing recorded), so runs of any
    rollout precision are measured by one evaluator. The twin is refit from the trainer when
    the rollout engine's policy version has moved past its own, and holds KV pages only while
    it evaluates."""

    def __init__(self, engine: Engine, config: RunConfig, *, dtype, device) -> None:
        self.rollout_engine, self.config = engine, config
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
            return evaluate(self.engine, task, problems, self.config)
        version = self.rollout_engine.policy_version
        if self.engine.policy_version != version:
            self.receiver.receive(refit_records(policy, policy_version=version))
        self.engine.acquire_kv()
        try:
            return evaluate(self.engine, task, problems, self.config)
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


def _resume_point(run_dir: Path, resume: bool, log) -> Path | None:
    """The checkpoint to resume from (None: from step 0); a new run may not overwrite one."""
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
    for stale in checkpoints.remove_stale(run_dir):
        log(f"removed {stale}, the leftover of a save that did not finish")
    log(f"resuming {run_dir} from " + (str(latest) if latest else "step 0: it has no checkpoint"))
    return latest


def _restore(checkpoint: Path, policy, optimizer, receiver, config: RunConfig, task: Task):
    """Trainer state, then the engine refit from it: ``(start step, random states)``."""
    saved, rng = checkpoints.load(checkpoint, optimizer)
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
    receiver.receive(refit_records(policy, policy_version=saved.policy_version))
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
