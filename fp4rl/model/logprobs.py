"""Per-token log-probabilities without materialising the whole ``[T, V]`` FP32 logits.

The lm_head runs over chunks of rows; each chunk's logits live only inside a checkpointed
function, so the backward pass recomputes them chunk by chunk instead of keeping ``T x V`` FP32
activations alive (151k-vocab models make that several GB per 8k tokens).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(lm_head: torch.nn.Module, h_NH: torch.Tensor, targets_N: torch.Tensor):
    logits_NV = lm_head(h_NH).float()
    picked = logits_NV.gather(1, targets_N[:, None]).squeeze(1)
    return picked - torch.logsumexp(logits_NV, dim=-1)


def token_logprobs(
    lm_head: torch.nn.Module, h_TH: torch.Tensor, targets_T: torch.Tensor, *, chunk: int = 1024
) -> torch.Tensor:
    """``log p(targets[t] | h[t])`` in FP32, ``[T]``."""
    if h_TH.shape[0] != targets_T.shape[0]:
        raise ValueError(f"{h_TH.shape[0]} hidden rows for {targets_T.shape[0]} targets")
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    out = []
    for h, t in zip(h_TH.split(chunk), targets_T.split(chunk), strict=True):
        if torch.is_grad_enabled() and h.requires_grad:
            out.append(checkpoint(_chunk_logprobs, lm_head, h, t, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(lm_head, h, t))
    return torch.cat(out) if out else h_TH.new_zeros(0, dtype=torch.float32)
