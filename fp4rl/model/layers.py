"""Building blocks shared by every layer: RMSNorm, rotary position embedding, the SwiGLU MLP.

Numerics follow the Qwen reference implementation so that checkpoints load to the same
function: norms compute in FP32 and cast back before the weight multiply; RoPE tables are FP32
and cast to the activation dtype.

A decode step runs these a few times per layer on a handful of rows, where each kernel launch
costs more than its arithmetic. So the RoPE tables are computed once per forward
(`RopeTables`) and shared by every layer, and the formulations below are chosen for the
fewest kernels among those that give the Qwen reference's bits
(`tests/model/test_fewer_kernels.py` holds each to the reference formulation).
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
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * op_to(torch.mul, x32, inv_rms, x.dtype)


def op_to(op, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``op(a, b).to(dtype)`` for ``op`` `torch.mul` or `torch.div`. Where autograd records
    nothing (the engine, evaluation) it is one kernel: ``out=`` in ``dtype`` computes each
    result in the inputs' dtype and rounds it once to ``dtype`` as it is stored, the rounding
    the cast applies (on the GPU the same conversion in the op's kernel; on the CPU a temporary
    copied out). Autograd takes no ``out=``."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return op(a, b).to(dtype)
    shape = torch.broadcast_shapes(a.shape, b.shape)
    return op(a, b, out=torch.empty(shape, dtype=dtype, device=a.device))


def rope_cos_sin(
    positions_T: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, head_dim]`` for the rotate-half convention."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions_T.device)
    inv_freq = 1.0 / (theta ** (exponent.float() / head_dim))
    freqs = positions_T.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RopeTables:
    """The RoPE tables of one forward's positions, shared by its layers: ``cos`` and
    ``signed_sin`` ``[T, head_dim]`` in ``dtype`` -- the values of `rope_cos_sin`, with the
    first half of ``sin`` negated for `apply_rope`. Built by the model's forward from the
    attention backend's positions; nothing outlives the forward."""

    def __init__(
        self, positions_T: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
    ) -> None:
        self.head_dim, self.theta = head_dim, theta
        self.cos, sin = rope_cos_sin(positions_T, head_dim, theta, dtype)
        half = head_dim // 2
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def apply_rope(
    x_THD: torch.Tensor, cos_TD: torch.Tensor, signed_sin_TD: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE, ``x * cos + cat(-x2, x1) * sin``, computed as ``x * cos + cat(x2, x1)
    * signed_sin`` where ``signed_sin = cat(-sin1, sin2)`` (`RopeTables`): negation is exact
    and a rounded product only changes sign with a factor, so the bits are the same, zeros'
    signs included, without a negation per call."""
    half = x_THD.shape[-1] // 2
    swapped = torch.cat((x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos_TD[:, None, :] + swapped * signed_sin_TD[:, None, :]


class MLP(nn.Module):
    """Dense SwiGLU MLP (dense decoder layers and the Qwen2-MoE shared expert): always BF16."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
