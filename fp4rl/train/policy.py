"""From the rollout's completions to the trainer's per-token log-probabilities: one call.

`policy_logprobs(model, collate(completions))` runs the trainer's full-sequence forward over
the packed batch (`CausalAttention`, in the model dtype or in FP32; with ``forward="engine"``,
`EngineOrderAttention`, which attends the way the rollout engine did: each prompt alone, each
completion token as one query over its context), replaying the rollout's routing and following
its guidance at every guided FP4 site when asked, and returns ``log p(target | prefix)`` for
each scored token, aligned with `TrainBatch.rollout_logprobs_N`. Nothing else is needed to compare
the two sides or to build the GRPO loss.

Legend: T fed tokens, N scored tokens, H hidden.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from fp4rl.model.attention import CausalAttention, EngineOrderAttention
from fp4rl.model.inputs import check_ids
from fp4rl.model.logprobs import token_logprobs
from fp4rl.records import TrainBatch, record_to

FORWARDS = ("packed", "packed_fp32", "engine")


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
    forward: str = "packed",
):
    """FP32 ``[N]`` log-probabilities of ``batch.targets_N`` under ``model``, at the sampling
    ``temperature`` (compare with ``batch.sampling_logprobs_N``; at 1, with either).

    ``replay``: run the experts the rollout chose (``batch.routing``); ``guided``: round each
    guided FP4 site toward the rollout's codes (``batch.guidance``). Asking for either when the
    batch does not carry it is an error, never a silent fallback. Gradients flow when enabled.
    ``with_entropy`` returns ``(logprobs_N, entropy_N)``, the entropy detached. ``forward``:
    "packed" (one causal attention over each whole sequence, in the model dtype),
    "packed_fp32" (the same in FP32, the output rounded once: the engine's precision) or
    "engine" (the rollout engine's attention arithmetic row by row, CPU only:
    `EngineOrderAttention`).
    """
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
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
    attn = _backend(batch, forward, device)
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
        attn,
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


def _backend(batch: TrainBatch, forward: str, device: torch.device):
    if forward != "engine":
        return CausalAttention(batch.seq_lens, fp32=forward == "packed_fp32", device=device)
    if device.type != "cpu":
        raise ValueError(
            f"forward='engine' reproduces the engine's CPU attention, but the model is on "
            f"{device}: there the engine decodes through the paged kernel, whose split of each "
            "context depends on the engine's batch (docs/alignment.md); use forward='packed'"
        )
    prompts = prompt_lens(batch)
    return EngineOrderAttention(
        batch.seq_lens, prompts, prefilled_by=shared_prefills(batch, prompts), device=device
    )


def prompt_lens(batch: TrainBatch) -> list[int]:
    """Each sequence's prompt length: the row scoring its first completion token, plus one."""
    first_N = torch.ones_like(batch.seq_index_N, dtype=torch.bool)
    first_N[1:] = batch.seq_index_N[1:] != batch.seq_index_N[:-1]
    seqs, rows = batch.seq_index_N[first_N].tolist(), batch.rows_N[first_N].tolist()
    if seqs != list(range(batch.num_seqs)):
        raise ValueError(
            "every sequence of the batch needs a scored token to tell its prompt's length; "
            f"sequences with one: {seqs}"
        )
    starts = [0, *accumulate(batch.seq_lens)][:-1]
    return [row - start + 1 for row, start in zip(rows, starts, strict=True)]


def shared_prefills(batch: TrainBatch, prompts: list[int]) -> list[int]:
    """Per sequence, the first sequence of the batch with the same prompt tokens: the engine
    prefilled a prompt once for all its samples."""
    tokens, first, out, start = batch.tokens_T.tolist(), {}, [], 0
    for b, (n, p) in enumerate(zip(batch.seq_lens, prompts, strict=True)):
        out.append(first.setdefault(tuple(tokens[start : start + p]), b))
        start += n
    return out
