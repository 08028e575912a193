"""Building blocks shared by every layer: RMSNorm, rotary position embedding, the SwiGLU MLP.

Numerics follow the Qwen reference implementation so that checkpoints load to the same
function: norms compute in FP32 and cast back before the weight multiply; RoPE tables are FP32
and cast to the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    positions_T: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, head_dim]`` for the rotate-half convention."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions_T.device)
    inv_freq = 1.0 / (theta ** (exponent.float() / head_dim))
    freqs = positions_T.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x_THD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    half = x_THD.shape[-1] // 2
    rotated = torch.cat((-x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos_TD[:, None, :] + rotated * sin_TD[:, None, :]


class MLP(nn.Module):
    """Dense SwiGLU MLP (dense decoder layers and the Qwen2-MoE shared expert): always BF16."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
