"""One GRPO update from a rollout's completions: micro-batched forward/backward, one step.

The completions arrive with their advantages; those the caller keeps out (zero-variance
groups, truncated samples) never reach here. Each micro-batch of whole completions is packed
by `collate`, scored by `policy_logprobs` (router replay and guided rounding as asked), and its
loss is normalized by the counts of the whole update, so the summed gradient does not depend
on how the completions were split (`fp4rl.train.grpo.grpo_loss`). Also the supervised step of
the warm-up that makes a base policy: the same forward, the answer's negative log-likelihood.

A sharded trainer (FSDP2, `fp4rl.distributed.shard_policy`) is told here, before each
micro-batch, what its collectives are: whether this micro-batch's backward reduce-scatters the
gradients (``gradient_sync``) and whether the gathered parameters stay gathered for the next one
(``keep_gathered``); every rank runs the same number of micro-batches, so each makes the same
collectives in the same order.

Legend: N scored tokens of a micro-batch, Q completions of the update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, Protocol, get_args

import torch

from fp4rl import checks
from fp4rl.records import Completion, collate
from fp4rl.train.grpo import GrpoConfig, grpo_loss
from fp4rl.train.optim import MasterAdamW
from fp4rl.train.policy import policy_logprobs

# When a sharded trainer reduce-scatters its gradients: once per update, or in every micro-batch.
GradientSync = Literal["update", "micro_batch"]


class Across(Protocol):
    """The other ranks of a sharded trainer (`fp4rl.distributed.Ranks`)."""

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """Each key summed over the ranks (absent on a rank: 0)."""

    def max(self, values: dict[str, float]) -> dict[str, float]:
        """Each key's largest value over the ranks."""


def grpo_update(
    policy,
    optimizer: MasterAdamW,
    completions: Sequence[Completion],
    advantages_Q: Sequence[float],
    *,
    config: GrpoConfig,
    replay: bool,
    guided: bool,
    temperature: float,
    micro_batch_seqs: int,
    stats: dict | None = None,
    on_micro_batch=None,
    forward: str = "packed",
    across: Across | None = None,
    spare: Completion | None = None,
    gradient_sync: GradientSync = "micro_batch",
    keep_gathered: bool = False,
    reference=None,
    proximal: Sequence[torch.Tensor] | None = None,
) -> dict[str, float]:
    """Accumulate the GRPO gradient of ``completions`` and take one optimizer step. Returns
    the loss and the objective's metrics (token-weighted means over the update) and the
    optimizer's ``lr``, ``grad_norm`` and ``skipped``. ``stats`` receives the forward's counters
    (``replay_fallback_tokens``), added up on the device and made numbers once, after the last
    micro-batch; ``on_micro_batch(num_completions)`` is called after each;
    ``forward``: the trainer's attention (`policy_logprobs`).

    ``across``: the update is one of a sharded trainer's ranks, ``completions`` this rank's
    share (possibly none). The normalizers are then the counts over every rank, the returned
    loss, metrics and counters those of the whole update, and every rank runs as many
    micro-batches as the busiest one, so that their collectives line up: the missing ones
    recompute ``spare`` (any completion of this rank) with weight 0, adding nothing. ``policy``
    is then sharded by FSDP2; ``gradient_sync``: it reduce-scatters the gradients in the last
    micro-batch alone ("update"; the ones before sum theirs unsharded, in FP32) or in each
    ("micro_batch"); ``keep_gathered``: it gathers its parameters once per update, in the first
    forward, and reshards them after the last backward (`sharded_micro_batch`). Both are
    ignored without ``across``.

    ``reference``: a frozen policy (the same model, its parameters not trained), scored on
    every micro-batch exactly as ``policy`` is (the same replay, rounding, temperature and
    attention) for the KL term of ``config.kl_coef``, which needs it. ``proximal``: each
    completion's log-probs (FP32, one per completion token) under the proximal policy
    (`proximal_logprobs`, `grpo_step`); left out, the proximal policy is the current one."""
    checks.choice("gradient_sync", gradient_sync, get_args(GradientSync))
    checks.boolean("keep_gathered", keep_gathered)
    if config.kl_coef > 0 and reference is None:
        raise ValueError(f"grpo.kl_coef={config.kl_coef} needs a reference policy to score with")
    if len(completions) != len(advantages_Q) or not (completions or across):
        raise ValueError(
            f"{len(completions)} completions and {len(advantages_Q)} advantages; need as many, "
            "and at least one"
        )
    device = policy.embed_tokens.weight.device
    total_tokens = sum(len(c.completion_ids) for c in completions)
    total_seqs = len(completions)
    num_micro_batches = math.ceil(len(completions) / micro_batch_seqs)
    if across is not None:
        totals = across.sum({"tokens": total_tokens, "seqs": total_seqs})
        total_tokens, total_seqs = int(totals["tokens"]), int(totals["seqs"])
        num_micro_batches = int(across.max({"n": num_micro_batches})["n"])
        spare = completions[0] if completions else spare
        if spare is None:
            raise ValueError("a rank with no completion to train on needs a spare one")
    if across is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        check_unsharded_fits(policy, sync=gradient_sync, keep=keep_gathered, free=free + cached)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}  # the forward's counters, summed on the device
    for index in range(num_micro_batches):
        start = index * micro_batch_seqs
        if across is not None:
            last = index == num_micro_batches - 1
            sharded_micro_batch(policy, last=last, sync=gradient_sync, keep=keep_gathered)
        chunk = completions[start : start + micro_batch_seqs]
        advantages = advantages_Q[start : start + micro_batch_seqs]
        padding = not chunk
        if padding:
            chunk, advantages = [spare], [0.0]
        # Fresh per micro-batch: FSDP may rebuild a non-empty dict among the forward's
        # arguments (moving them to the device), losing what is counted into it.
        counted = None if padding else {}
        batch = collate(chunk)
        if batch.sampling_logprobs_N is None:
            raise ValueError("GRPO needs the rollout's logprobs (SamplingParams.return_logprobs)")
        logp_N, entropy_N = policy_logprobs(
            policy,
            batch,
            replay=replay,
            guided=guided,
            temperature=temperature,
            with_entropy=True,
            stats=counted,
            forward=forward,
        )
        logp_ref_N = None
        if reference is not None:
            with torch.no_grad():
                logp_ref_N = policy_logprobs(
                    reference,
                    batch,
                    replay=replay,
                    guided=guided,
                    temperature=temperature,
                    forward=forward,
                )
        logp_prox_N = None
        if proximal is not None and not padding:
            logp_prox_N = torch.cat(list(proximal[start : start + micro_batch_seqs])).to(device)
        adv_Q = torch.tensor(advantages, dtype=torch.float32)
        loss, metrics = grpo_loss(
            logp_N,
            logp_rollout_N=batch.sampling_logprobs_N.to(device),
            advantages_N=adv_Q.to(device)[batch.seq_index_N.to(device)],
            seq_index_N=batch.seq_index_N.to(device),
            num_seqs=batch.num_seqs,
            config=config,
            entropy_N=entropy_N,
            logp_prox_N=logp_prox_N,
            logp_ref_N=logp_ref_N,
            # A padding pass normalizes by its own counts: its loss is scaled to 0 anyway.
            total_tokens=None if padding else total_tokens,
            total_seqs=None if padding else total_seqs,
        )
        if padding:  # a gradient of exact zeros; nothing of it is counted
            (loss * 0.0).backward()
            optimizer.accumulate()
            sums = {key: sums.get(key, 0.0) for key in ("loss", *metrics)}
            continue
        loss.backward()
        optimizer.accumulate()
        for key, value in counted.items():
            counts[key] = counts.get(key, 0) + value
        if on_micro_batch is not None:
            on_micro_batch(batch.num_seqs)
        # The micro-batch losses sum to the update's loss; the metrics are means over each
        # call's tokens, so they combine weighted by token share.
        sums["loss"] = sums.get("loss", 0.0) + loss.detach().float()
        share = batch.num_targets / total_tokens
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value.float() * share
    if across is not None:  # FSDP2's own settings again, for forwards outside updates
        sharded_micro_batch(policy, last=True, sync="micro_batch", keep=False)
    out = {key: float(value) for key, value in sums.items()}
    counters = {key: int(value) for key, value in counts.items()}  # their one wait on the device
    if across is not None:
        out = across.sum(out)
        counters = {key: int(value) for key, value in across.sum(counters).items()}
    if stats is not None:
        for key, value in counters.items():
            stats[key] = stats.get(key, 0) + value
    out.update(optimizer.step())
    return out


def grpo_step(
    policy,
    optimizer: MasterAdamW,
    completions: Sequence[Completion],
    advantages_Q: Sequence[float],
    *,
    config: GrpoConfig,
    across: Across | None = None,
    spare: Completion | None = None,
    **update,
) -> dict[str, float]:
    """One rollout's optimizer steps: ``config.mini_batches`` updates (`grpo_update`, which
    ``update`` is passed to), prompt p's completions in mini-batch ``p % mini_batches``; a
    mini-batch no rank holds a completion of is left out. Before the first update the policy
    scores the completions of the later ones (`proximal_logprobs`): their proximal policy is
    the one the step started from. Returns the loss and the objective's metrics averaged over
    the updates weighted by their tokens (over every rank), ``grad_norm`` averaged over them,
    ``lr`` (the last update's), ``skipped`` (how many skipped their step) and ``updates``, how
    many ran. One mini-batch is exactly one `grpo_update`."""
    M = config.mini_batches
    kw = dict(config=config, across=across, spare=spare, **update)
    if M == 1:
        return {**grpo_update(policy, optimizer, completions, advantages_Q, **kw), "updates": 1}
    parts = [[i for i, c in enumerate(completions) if c.prompt_index % M == b] for b in range(M)]
    sizes = {}  # each mini-batch's completions and tokens, over every rank
    for b, part in enumerate(parts):
        sizes[f"n{b}"] = len(part)
        sizes[f"t{b}"] = sum(len(completions[i].completion_ids) for i in part)
    if across is not None:
        sizes = across.sum(sizes)
    kept = [b for b in range(M) if sizes[f"n{b}"] > 0]
    parts = [parts[b] for b in kept]
    tokens = [sizes[f"t{b}"] for b in kept]
    scoring = dict(
        replay=update["replay"],
        guided=update["guided"],
        temperature=update["temperature"],
        micro_batch_seqs=update["micro_batch_seqs"],
        forward=update.get("forward", "packed"),
        across=across,
        spare=completions[0] if completions else spare,
    )
    chosen = [[completions[i] for i in part] for part in parts]
    proximal = [None] + [proximal_logprobs(policy, later, **scoring) for later in chosen[1:]]
    results = []
    for part, these, prox in zip(parts, chosen, proximal, strict=True):
        advantages = [advantages_Q[i] for i in part]
        results.append(grpo_update(policy, optimizer, these, advantages, proximal=prox, **kw))
    # The loss and the objective's metrics weighted by each update's share of the tokens, as
    # `grpo_update` weighs its micro-batches; the optimizer's own per step.
    share = [t / sum(tokens) for t in tokens]
    out = {key: sum(w * r[key] for w, r in zip(share, results, strict=True)) for key in results[0]}
    out.update(
        lr=results[-1]["lr"],
        grad_norm=sum(r["grad_norm"] for r in results) / len(results),
        skipped=sum(r["skipped"] for r in results),
    )
    return {**out, "updates": len(results)}


@torch.no_grad()
def proximal_logprobs(
    policy,
    completions: Sequence[Completion],
    *,
    replay: bool,
    guided: bool,
    temperature: float,
    micro_batch_seqs: int,
    forward: str = "packed",
    across: Across | None = None,
    spare: Completion | None = None,
) -> list[torch.Tensor]:
    """Each completion's log-probs under ``policy`` as it is now (FP32 on the policy's device,
    one per completion token), scored as `grpo_update` scores the same list (its micro-batches,
    replay, rounding, temperature and attention, so the same bits), without a gradient. With
    ``across``, every rank runs as many micro-batches as the busiest, the missing ones over
    ``spare``, so that a sharded policy's gathers line up."""
    count = math.ceil(len(completions) / micro_batch_seqs)
    if across is not None:
        count = int(across.max({"n": count})["n"])
    out = []
    for index in range(count):
        chunk = completions[index * micro_batch_seqs : (index + 1) * micro_batch_seqs]
        batch = collate(chunk or [spare])
        logp_N = policy_logprobs(
            policy, batch, replay=replay, guided=guided, temperature=temperature,
            forward=forward,
        )  # fmt: skip
        if chunk:
            out += logp_N.split([len(c.completion_ids) for c in chunk])
    return out


def sharded_micro_batch(policy, *, last: bool, sync: GradientSync, keep: bool) -> None:
    """Set the FSDP2 ``policy``'s collectives for its next micro-batch (torch's ``FSDPModule``
    settings, on the root and every decoder layer). Its backward reduce-scatters the gradients
    if ``last`` or ``sync`` is "micro_batch"; otherwise FSDP2 keeps them unsharded and adds the
    next micro-batch's in the reduce dtype, FP32, not in the BF16 of the gathered parameters.
    ``keep``: no layer reshards after its forward, nor after its backward unless ``last``.
    The last backward always reshards: the optimizer then updates the shards, and the next
    forward gathers the update, never parameters left gathered from before it."""
    if not hasattr(policy, "set_requires_gradient_sync"):
        raise ValueError(
            f"a sharded update needs the policy sharded by FSDP2 (shard_policy), got a "
            f"{type(policy).__name__}"
        )
    policy.set_requires_gradient_sync(last or sync == "micro_batch")
    policy.set_reshard_after_backward(last or not keep)
    # The root (embeddings, lm_head) never reshards after its forward: lm_head is applied
    # after it, to the scored rows.
    for layer in policy.layers:
        layer.set_reshard_after_forward(not keep)


def check_unsharded_fits(policy, *, sync: GradientSync, keep: bool, free: int) -> None:
    """Refuse, before it starts, a sharded update that cannot fit in ``free`` bytes of its
    device: between micro-batches it holds on every rank the whole model's FP32 gradient
    unsharded (``sync`` "update": 4 bytes per parameter) and, with ``keep``, its gathered
    parameters (2 bytes or more). Activations aside, so passing is no promise."""
    held = {"its FP32 gradient (4 bytes per parameter)": 4 * (sync == "update")}
    held["its gathered parameters (2 or more)"] = 2 * keep
    need = sum(held.values()) * sum(p.numel() for p in policy.parameters() if p.requires_grad)
    if need > free:
        what = " and ".join(k for k, v in held.items() if v)
        raise ValueError(
            f"run.gradient_sync={sync!r} with run.keep_gathered={str(keep).lower()} keeps {what} "
            f"of the whole model unsharded on every rank during an update: "
            f"{need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free on this device; "
            "set run.gradient_sync='micro_batch' and run.keep_gathered=false (docs/scaling.md)"
        )


def supervised_update(
    policy, optimizer: MasterAdamW, completions: Sequence[Completion]
) -> dict[str, float]:
    """One step of teacher forcing: minimize the mean negative log-likelihood of every
    completion token (live routing, nearest rounding). The warm-up that makes a base policy."""
    batch = collate(completions)
    logp_N = policy_logprobs(policy, batch, replay=False, guided=False)
    loss = -logp_N.mean()
    loss.backward()
    return {"loss": float(loss.detach()), **optimizer.step()}
