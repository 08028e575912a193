"""Per-token log-probabilities without materialising the whole ``[T, V]`` FP32 logits.

The lm_head runs over chunks of rows; each chunk's logits live only inside a checkpointed
function, so the backward pass recomputes them chunk by chunk instead of keeping ``T x V`` FP32
activations alive (151k-vocab models make that several GB per 8k tokens).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(lm_head, h_NH, targets_N, temperature: float, with_entropy: bool):
    logits_NV = lm_head(h_NH).float()
    if temperature != 1.0:
        logits_NV = logits_NV / temperature
    lse_N = torch.logsumexp(logits_NV, dim=-1)
    logp_N = logits_NV.gather(1, targets_N[:, None]).squeeze(1) - lse_N
    if not with_entropy:
        return logp_N, None
    # Entropy of the same distribution, for monitoring only: its gradient is never used.
    with torch.no_grad():
        p_NV = torch.softmax(logits_NV, dim=-1)
        entropy_N = lse_N - (p_NV * logits_NV).sum(-1)
    return logp_N, entropy_N


def token_logprobs(
    lm_head: torch.nn.Module,
    h_TH: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    chunk: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
):
    """``log p(targets[t] | h[t])`` in FP32, ``[T]``, under ``softmax(logits / temperature)``
    (the distribution a rollout at that temperature sampled from); with ``with_entropy`` also
    that distribution's entropy per row, detached: ``(logprobs_T, entropy_T)``."""
    if h_TH.shape[0] != targets_T.shape[0]:
        raise ValueError(f"{h_TH.shape[0]} hidden rows for {targets_T.shape[0]} targets")
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logps, entropies = [], []
    for h, t in zip(h_TH.split(chunk), targets_T.split(chunk), strict=True):
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(
                _chunk_logprobs, lm_head, h, t, temperature, with_entropy, use_reentrant=False
            )
        else:
            lp, ent = _chunk_logprobs(lm_head, h, t, temperature, with_entropy)
        logps.append(lp)
        entropies.append(ent)
    empty = h_TH.new_zeros(0, dtype=torch.float32)
    logp_T = torch.cat(logps) if logps else empty
    if not with_entropy:
        return logp_T
    return logp_T, torch.cat(entropies).detach() if entropies else empty
