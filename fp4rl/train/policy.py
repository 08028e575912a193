"""From the rollout's completions to the trainer's per-token log-probabilities: one call.

`policy_logprobs(model, collate(completions))` runs the trainer's full-sequence forward over
the packed batch (`CausalAttention`), replaying the rollout's routing and following its
guidance at every guided FP4 site when asked, and returns ``log p(target | prefix)`` for each
scored token, aligned with `TrainBatch.rollout_logprobs_N`. Nothing else is needed to compare
the two sides or to build the GRPO loss.

Legend: T fed tokens, N scored tokens, H hidden.
"""

from __future__ import annotations

from fp4rl.model.attention import CausalAttention
from fp4rl.model.inputs import check_ids
from fp4rl.model.logprobs import token_logprobs
from fp4rl.records import TrainBatch, record_to


def policy_logprobs(
    model,
    batch: TrainBatch,
    *,
    replay: bool = True,
    guided: bool = True,
    capture=None,
    stats: dict | None = None,
    chunk: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
):
    """FP32 ``[N]`` log-probabilities of ``batch.targets_N`` under ``model``, at the sampling
    ``temperature`` (compare with ``batch.sampling_logprobs_N``; at 1, with either).

    ``replay``: run the experts the rollout chose (``batch.routing``); ``guided``: round each
    guided FP4 site toward the rollout's codes (``batch.guidance``). Asking for either when the
    batch does not carry it is an error, never a silent fallback. Gradients flow when enabled.
    ``with_entropy`` returns ``(logprobs_N, entropy_N)``, the entropy detached.
    """
    if replay and batch.routing is None:
        raise ValueError(
            "replay=True but the batch has no routing record (engine.capture_routing=False); "
            "pass replay=False to route live"
        )
    if guided and batch.guidance is None:
        raise ValueError(
            "guided=True but the batch has no guidance (engine.guidance=None); pass "
            "guided=False to round to nearest"
        )
    device = model.embed_tokens.weight.device
    tokens_T = batch.tokens_T.to(device)
    routing = batch.routing.to(device) if replay else None
    guidance = None
    if guided:
        guidance = {
            k: None if r is None else record_to(r, device) for k, r in batch.guidance.items()
        }
    check_ids(model, tokens_T, routing)
    h_TH = model.hidden_states(
        tokens_T,
        CausalAttention(batch.seq_lens, device=device),
        routing=routing,
        guidance=guidance,
        capture=capture,
        stats=stats,
    )
    rows_N, targets_N = batch.rows_N.to(device), batch.targets_N.to(device)
    return token_logprobs(
        model.lm_head,
        h_TH[rows_N],
        targets_N,
        chunk=chunk,
        temperature=temperature,
        with_entropy=with_entropy,
    )
