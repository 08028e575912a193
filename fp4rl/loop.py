"""The GRPO loop: rollout on the NVFP4 engine -> reward -> advantages -> update -> refit.

`train(config)` reads top to bottom. The trainer holds the QAT model (BF16-layout parameters,
FP32 masters, fake-quantized W4A4 experts); the engine holds its packed twin, refit from the
trainer after every update through `fp4rl.refit`. With ``grpo.kl_coef`` the trainer also
holds the starting checkpoint, frozen, as the KL term's reference policy. The engine records
routing and guidance as its config says; ``[align]`` says whether the trainer replays and
follows them, and how often the mismatch between the two is measured (`fp4rl.train.observe`).
Metrics go to ``metrics.jsonl`` in the run directory, one JSON object per step, and a summary
line per step to ``log``. Every ``run.checkpoint_every`` steps and after the last, the state
goes to a checkpoint; ``resume`` continues a run from its latest one.

This module owns the order of a run and of its steps (`train`, `rollout`, `score`, the observed
mismatch, the update, the refit) and the step's metrics. It does not own the run directory
over the run's life (`fp4rl.run_dir`: where a run starts, resume, metrics.jsonl, when and how
checkpoints are saved), held-out evaluation (`fp4rl.evaluation`, whose `evaluate` and
`Evaluator` it re-exports) or the numerics of any phase.

With ``ranks`` (`fp4rl.distributed`, a process of a torchrun launch) the same loop runs on
every rank: each generates on its own engine for its share of the step's prompts, the rewards
are gathered so advantages and metrics are the whole step's, the trainer is an FSDP2 shard, the
refit gathers one layer at a time, and rank 0 alone logs and writes the run directory.
"""

from __future__ import annotations

import contextlib
import io
import random
import time
from pathlib import Path

import torch

from fp4rl.config import RunConfig
from fp4rl.distributed import Ranks, ShardedAdamW, held_bytes, shard_policy, weights_of
from fp4rl.evaluation import Evaluator, evaluate
from fp4rl.metrics_log import check_tensorboard
from fp4rl.model.weights import load_pretrained
from fp4rl.progress import Progress
from fp4rl.records import Completion, bytes_per_generated_token, capture_totals, collate
from fp4rl.refit import RefitReceiver
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.run_dir import (
    MetricsLog,
    checkpoint_due,
    open_run_dir,
    restore,
    resume_point,
    save,
)
from fp4rl.tasks import Task, build_task, step_seed
from fp4rl.train.grpo import group_advantages
from fp4rl.train.observe import Observed, observe_counts, observed_metrics
from fp4rl.train.optim import MasterAdamW
from fp4rl.train.step import grpo_step

__all__ = [
    "DTYPES",
    "Evaluator",
    "evaluate",
    "held_out_metrics",
    "observed",
    "phase",
    "progress",
    "resolve_device",
    "rollout",
    "sampling",
    "score",
    "setup",
    "summary_line",
    "train",
    "weights_of",
]

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
    resume_from = resume_point(run_dir, resume, log, writer)

    path, precision = config.model.path, config.precision
    task = build_task(config.task, model_dir=path, log=log)  # bad data fails before the model loads
    experts = "qat" if config.align.trainer_activations == "nvfp4" else "qat_weights"
    weights = path if resume_from is None else resume_from / "model"
    # Sharded, the policy is read on the CPU and each rank keeps only its shards on the device.
    on = device if ranks is None else "cpu"
    policy = load_pretrained(weights, precision, fp4_experts=experts, dtype=dtype, device=on)
    reference = None
    if config.grpo.kl_coef > 0:  # the KL term's anchor: the starting checkpoint, frozen
        reference = load_pretrained(path, precision, fp4_experts=experts, dtype=dtype, device=on)
        reference.requires_grad_(False)
        if ranks is not None:  # sharded like the policy, kept in its dtype
            shard_policy(reference, ranks, dtype, frozen=True)
        log(
            f"KL reference policy: {path}, frozen, {held_bytes(reference) / 2**20:,.1f} MiB of "
            f"parameters held by this {'rank' if ranks else 'process'}"
        )
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
        start, rng = restore(
            resume_from, policy, optimizer, receiver, config, task, dtype=dtype, ranks=ranks
        )
    history = open_run_dir(run_dir, config, start, resume, ranks)  # the steps before `start`
    held_out = task.held_out()
    replay, guided = config.align.resolve(config.engine)
    log(
        f"precision plan:\n{policy.plan}\nreplay={replay} guided={guided} "
        f"(the engine records guidance={config.engine.guidance})"
    )

    metrics = MetricsLog(
        run_dir, start=start, resume=resume, writer=writer, tensorboard=config.run.tensorboard
    )
    if rng is not None:
        rng.restore()  # last: loading the models above may draw random numbers
    with metrics:
        for step in range(start, config.run.steps):
            m: dict = {"step": step, "policy_version": engine.policy_version}
            if step % config.run.eval_every == 0:
                m.update(held_out_metrics(evaluator, policy, task, held_out, config, ranks))
            num = config.rollout.prompts_per_step
            problems = task.train_examples(seed=config.run.seed, step=step, num=num)
            mine = range(num) if ranks is None else ranks.share(num)  # this rank's prompts
            with phase(m, "rollout", device, engine):
                completions = rollout(engine, task, problems, config, step, mine, ranks, m)
            keep, advantages = score(
                task, problems[mine.start : mine.stop], completions, config, m, ranks
            )
            every = config.align.observe_every
            if every and step % every == 0:
                first = mine.start * config.rollout.samples_per_prompt  # this rank's first
                m.update(observed(policy, completions, config, replay, guided, first, ranks))
            if not config.run.keep_kv:  # the trainer takes the pages' memory while it runs
                engine.release_kv()  # the pages' memory; the graphs stay (engine.keep_graphs)
            bar = progress(len(keep), f"step {step} train", ranks)
            with phase(m, "train", device, engine), bar:
                if m["trained_samples"]:  # of every rank: all of them update, or none
                    m.update(
                        grpo_step(
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
                            gradient_sync=config.run.gradient_sync,
                            keep_gathered=config.run.keep_gathered,
                            reference=reference,
                        )
                    )
            with phase(m, "refit", device, engine):
                receiver.receive(weights_of(policy, engine.policy_version + 1, ranks))
                engine.acquire_kv()
            if ranks is not None:  # the step waits for its slowest rank
                m.update(ranks.max({k: v for k, v in m.items() if _per_rank(k)}))
            m["rollout_tokens_per_s"] = m["generated_tokens"] / m["rollout_s"]
            history.append(m)
            metrics.write(m)
            log(summary_line(m))
            if checkpoint_due(step + 1, config):
                metrics.sync()  # the metrics a resume keeps are on disk first
                saved = save(
                    run_dir, config, task, step + 1, engine.policy_version, policy, optimizer,
                    dtype=dtype, ranks=ranks,
                )  # fmt: skip
                log(f"checkpoint {saved}")
        final = {"step": config.run.steps, "policy_version": engine.policy_version}
        final.update(held_out_metrics(evaluator, policy, task, held_out, config, ranks))
        history.append(final)
        metrics.write(final)
    for key in ("held_out_accuracy", "held_out_greedy"):
        log(f"{key.replace('_', ' ')} {history[0][key]:.3f} -> {final[key]:.3f}")
    return history


def rollout(
    engine: Engine,
    task: Task,
    problems: list,
    config: RunConfig,
    step: int,
    mine: range,
    ranks: Ranks | None = None,
    m: dict | None = None,
):
    """The completions of ``problems[mine]`` (this rank's share; all of them in one process),
    sampled as one engine given every problem would sample them. Into ``m``: the CUDA graphs
    the engine captured for it and the seconds that took (``graphs_captured``,
    ``graph_capture_s``; none once the engine holds a graph of every shape it meets)."""
    total = len(mine) * config.rollout.samples_per_prompt
    stats: dict = {}
    with progress(total, f"step {step} rollout", ranks) as bar:
        prompts = [list(p.prompt_ids) for p in problems[mine.start : mine.stop]]
        params = sampling(config, step, task.stop_token_ids)
        completions = engine.generate(
            prompts, params, stats=stats, on_finish=bar.update, first_prompt_index=mine.start
        )
    if m is not None:
        m["graphs_captured"] = stats["graphs_captured"]
        m["graph_capture_s"] = stats["capture_seconds"]
    return completions


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


def observed(
    policy,
    completions: list[Completion],
    config: RunConfig,
    replay: bool,
    guided: bool,
    first: int = 0,
    ranks: Ranks | None = None,
) -> dict[str, float]:
    """The mismatch metrics (`fp4rl.train.observe`) of the step's first ``run.micro_batch_seqs``
    completions, and what the records captured cost per generated token over all of them
    (``routing_bytes_per_token``, ``guidance_bytes_per_token``).

    With ``ranks``, ``completions`` are this rank's, the first of them the step's ``first``-th:
    each rank observes the part of the batch it holds, the sums, counts and maxima are reduced
    over the ranks and only then divided, so the metrics are those of one process. A rank that
    holds none of the batch runs the forward all the same (FSDP gathers in it) on a spare
    completion, and counts nothing of it."""
    part = completions[: max(0, config.run.micro_batch_seqs - first)]
    counts = observe_counts(
        policy,
        collate(part or completions[:1]),
        replay=replay,
        guided=guided,
        temperature=config.rollout.temperature,
        forward=config.align.trainer_forward,
    )
    if not part:
        counts = Observed()
    cost = capture_totals(completions)
    if ranks is not None:
        counts = Observed(sums=ranks.sum(counts.sums), maxima=ranks.max(counts.maxima))
        cost = ranks.sum(cost)
    out = observed_metrics(counts)
    for key, value in bytes_per_generated_token(cost).items():
        out[f"{key}_bytes_per_token"] = value
    return out


def progress(total: int, label: str, ranks: Ranks | None = None) -> Progress:
    """A progress bar on the terminal (`fp4rl.progress`); with several ranks, rank 0's alone:
    the other ranks' bars write to no terminal, so they draw nothing."""
    if ranks is None or ranks.writer:
        return Progress(total, label)
    return Progress(total, label, stream=io.StringIO())


@contextlib.contextmanager
def phase(m: dict, name: str, device: torch.device, engine=None):
    """Time a phase into ``m[name + "_s"]``; on CUDA also its peak memory (GiB) into
    ``m["peak_" + name + "_gib"]``, counted from the phase's start: torch's allocations and
    the ``engine``'s KV pages at reserved addresses, outside torch's allocator
    (`Engine.reserved_kv_bytes`: the more of what they were at the phase's start and end)."""

    def outside() -> int:
        return 0 if engine is None else engine.reserved_kv_bytes

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    held = outside()
    start = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) + max(held, outside())
        m[f"peak_{name}_gib"] = peak / 2**30
    m[f"{name}_s"] = time.perf_counter() - start


def sampling(config: RunConfig, step: int, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    r = config.rollout
    return SamplingParams(
        n=r.samples_per_prompt,
        temperature=r.temperature,
        max_tokens=r.max_tokens,
        stop_token_ids=stop_token_ids,
        seed=step_seed(config.run.seed, step),
        cdf_order=r.cdf_order,
    )


def held_out_metrics(
    evaluator: Evaluator, policy, task: Task, problems: list, config: RunConfig, ranks=None
) -> dict[str, float]:
    """`evaluate` on the evaluator's engine, brought up to the trainer's weights first."""
    with evaluator.current(policy) as engine:
        return evaluate(engine, task, problems, config, ranks=ranks)


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


def _per_rank(key: str) -> bool:
    """Whether a metric is a rank's own (a phase's time or peak memory), to be maxed."""
    return key.endswith("_s") or (key.startswith("peak_") and key.endswith("_gib"))


def _silent(_line: str) -> None:
    """The log of ranks other than 0."""


def _check_vocab(vocab_size: int, task: Task) -> None:
    if vocab_size < task.vocab_size:
        raise ValueError(
            f"the model's vocab_size={vocab_size} does not cover the task's {task.vocab_size} "
            "token ids (its tokenizer's)"
        )
