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

from fp4rl import ops


class RMSNorm(nn.Module):
    """On the GPU one kernel per call (`fp4rl.ops.rms_norm`; its FP32 sum of squares in a fixed
    order, so a row's result does not depend on the batch), gradients from the eager
    formulation; elsewhere the eager formulation (`eager_rms_norm`). `sum_and_norm` takes the
    residual add before the norm into the same launch, `sum_norm_and_quantize` also the routed
    experts' input site after it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            if x.is_cuda:
                return _KernelRMSNorm.apply(x, self.weight, self.eps)
            return eager_rms_norm(x, self.weight, self.eps)
        y = ops.rms_norm(x, self.weight, self.eps)
        return eager_rms_norm(x, self.weight, self.eps) if y is None else y

    def sum_and_norm(
        self, x: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, self(s))`` with ``s = x + delta``: a residual add and the norm after it. On
        the GPU without autograd one kernel (`fp4rl.ops.add_rms_norm`) gives the bits of the
        add's and the norm's; with autograd, elsewhere, or with hooks on this module (which
        then see s and its norm, as from a call) the add, then the call."""
        if self._fusable(x, delta):
            out = ops.add_rms_norm(x, delta, self.weight, self.eps)
            if out is not None:
                return out
        s = x + delta
        return s, self(s)

    def sum_norm_and_quantize(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        record: str | None = None,
        permuted_by: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, ops.SiteRecord | None]:
        """``(s, h, h_q, h_record)``: `sum_and_norm`'s ``(s, h)``, ``h_q =
        ops.fake_quantize(h, scaling="row")`` (an FP4 site rounding to nearest) and, with
        ``record`` ("full" or "compact"), that site's record of h, all from one kernel
        (`fp4rl.ops.add_rms_norm_quantize`, bit for bit) where `sum_and_norm` would fuse and
        that kernel runs; elsewhere ``h_q`` and the record are None and the caller runs the
        site. ``permuted_by``: h_q's rows stored permuted for the experts' GEMM."""
        if self._fusable(x, delta):
            out = ops.add_rms_norm_quantize(x, delta, self.weight, self.eps, record, permuted_by)
            if out is not None:
                return out
        return (*self.sum_and_norm(x, delta), None, None)

    def _fusable(self, x: torch.Tensor, delta: torch.Tensor) -> bool:
        """No gradient is recorded and no hook waits for a call: a kernel may add and norm."""
        wants_grad = torch.is_grad_enabled() and (
            x.requires_grad or delta.requires_grad or self.weight.requires_grad
        )
        return not (wants_grad or self._forward_pre_hooks or self._forward_hooks)


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Qwen formulation: FP32 statistics, cast back before the weight multiply."""
    x32 = x.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * op_to(torch.mul, x32, inv_rms, x.dtype)


class _KernelRMSNorm(torch.autograd.Function):
    """The kernel's values forward; backward, the gradients of the eager formulation (which
    computes the same function up to the last bit of its inverse RMS), recomputed."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        y = ops.rms_norm(x, weight, eps)
        return eager_rms_norm(x, weight, eps) if y is None else y

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
            dx, dweight = torch.autograd.grad(eager_rms_norm(x, weight, ctx.eps), (x, weight), grad)
        return dx, dweight, None


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
    signs included, without a negation per call. On the GPU, outside autograd, one kernel
    computes the same bits (`fp4rl.ops.apply_rope`)."""
    if not (torch.is_grad_enabled() and x_THD.requires_grad):
        out = ops.apply_rope(x_THD, cos_TD, signed_sin_TD)
        if out is not None:
            return out
    half = x_THD.shape[-1] // 2
    swapped = torch.cat((x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos_TD[:, None, :] + swapped * signed_sin_TD[:, None, :]


def project(x: torch.Tensor, *linears: nn.Linear) -> list[torch.Tensor]:
    """``[linear(x) for linear in linears]``. On the GPU in inference mode (the engine's steps),
    for bias-free projections of a decode step's few rows, one kernel launch for all of them
    (`fp4rl.ops.project`: FP32 sums in an order fixed by the input width, so a row's bits do not
    depend on the batch; not cuBLAS's bits); elsewhere, the trainer's forwards included, one
    ``F.linear`` each."""
    if torch.is_inference_mode_enabled() and all(linear.bias is None for linear in linears):
        out = ops.project(x, [linear.weight for linear in linears])
        if out is not None:
            return out
    return [linear(x) for linear in linears]


def normed_rope(
    x_THD: torch.Tensor, norm: nn.Module, cos_TD: torch.Tensor, signed_sin_TD: torch.Tensor
) -> torch.Tensor:
    """``apply_rope(norm(x_THD), ...)``: Qwen3's per-head q/k norm, then the rotation. On the
    GPU, outside autograd and with ``norm`` an `RMSNorm`, one kernel (`fp4rl.ops.norm_rope`)
    gives the bits of the two kernels it replaces."""
    wants_grad = torch.is_grad_enabled() and (
        x_THD.requires_grad or any(p.requires_grad for p in norm.parameters())
    )
    if isinstance(norm, RMSNorm) and not wants_grad:
        out = ops.norm_rope(x_THD, norm.weight, norm.eps, cos_TD, signed_sin_TD)
        if out is not None:
            return out
    return apply_rope(norm(x_THD), cos_TD, signed_sin_TD)


class MLP(nn.Module):
    """Dense SwiGLU MLP (dense decoder layers and the Qwen2-MoE shared expert): always BF16."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
