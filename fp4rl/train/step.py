"""One GRPO update from a rollout's completions: micro-batched forward/backward, one step.

The completions arrive with their advantages; those the caller keeps out (zero-variance
groups, truncated samples) never reach here. Each micro-batch of whole completions is packed
by `collate`, scored by `policy_logprobs` (router replay and guided rounding as asked), and its
loss is normalized by the counts of the whole update, so the summed gradient does not depend
on how the completions were split (`fp4rl.train.grpo.grpo_loss`). Also the supervised step of
the warm-up that makes a base policy: the same forward, the answer's negative log-likelihood.

Legend: N scored tokens of a micro-batch, Q completions of the update.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fp4rl.records import Completion, collate
from fp4rl.train.grpo import GrpoConfig, grpo_loss
from fp4rl.train.optim import MasterAdamW
from fp4rl.train.policy import policy_logprobs


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
) -> dict[str, float]:
    """Accumulate the GRPO gradient of ``completions`` and take one optimizer step. Returns
    the loss and the objective's metrics (token-weighted means over the update) and the
    optimizer's ``lr``, ``grad_norm`` and ``skipped``. ``stats`` receives the forward's counters
    (``replay_fallback_tokens``); ``on_micro_batch(num_completions)`` is called after each;
    ``forward``: the trainer's attention (`policy_logprobs`)."""
    if len(completions) != len(advantages_Q) or not completions:
        raise ValueError(
            f"{len(completions)} completions and {len(advantages_Q)} advantages; need as many, "
            "and at least one"
        )
    device = policy.embed_tokens.weight.device
    total_tokens = sum(len(c.completion_ids) for c in completions)
    sums: dict[str, torch.Tensor] = {}
    for start in range(0, len(completions), micro_batch_seqs):
        chunk = completions[start : start + micro_batch_seqs]
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
            stats=stats,
            forward=forward,
        )
        adv_Q = torch.tensor(advantages_Q[start : start + micro_batch_seqs], dtype=torch.float32)
        loss, metrics = grpo_loss(
            logp_N,
            logp_rollout_N=batch.sampling_logprobs_N.to(device),
            advantages_N=adv_Q.to(device)[batch.seq_index_N.to(device)],
            seq_index_N=batch.seq_index_N.to(device),
            num_seqs=batch.num_seqs,
            config=config,
            entropy_N=entropy_N,
            total_tokens=total_tokens,
            total_seqs=len(completions),
        )
        loss.backward()
        optimizer.accumulate()
        if on_micro_batch is not None:
            on_micro_batch(batch.num_seqs)
        # The micro-batch losses sum to the update's loss; the metrics are means over each
        # call's tokens, so they combine weighted by token share.
        sums["loss"] = sums.get("loss", 0.0) + loss.detach().float()
        share = batch.num_targets / total_tokens
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value.float() * share
    out = {key: float(value) for key, value in sums.items()}
    out.update(optimizer.step())
    return out


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
