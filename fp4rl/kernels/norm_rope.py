"""Qwen3's per-head q/k RMSNorm and the rotary embedding after it, in one kernel.

`fp4rl.model.attention.Attention` normalizes each head's query and key rows (RMSNorm over the
head dim) and then rotates them; on the GPU that is two launches per tensor, the RMSNorm kernel
(`fp4rl.kernels.rms_norm`) and the RoPE kernel (`fp4rl.kernels.rope`). This kernel gives their
composition's bits in one launch: one program per (token, head) row, one warp, the RMSNorm
kernel's own code for the row and its sum of squares (`rms_norm.inverse_rms`, the same tile
and warps, so the same summation order), then the RoPE kernel's roundings (each product, then
the sum). The rotated half's normalized values are recomputed from a second load of the row
with the halves swapped: the same arithmetic on the same values, so the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels import dependent_launch, rms_norm, rope
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import check_contiguous, check_kernel_device, device_of
from fp4rl.kernels.numerics import round_to
from fp4rl.kernels.rms_norm import inverse_rms, normed

DTYPES = rope.DTYPES
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _norm_rope_kernel(
    x_RD, weight_D, cos_TD, sin_TD, out_RD, H, D, inv_width, eps,
    OUT: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)  # token * H + head
    token = row // H
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D  # D == BLOCK_D (a power of two): every lane is live
    x, inv_rms = inverse_rms(x_RD, row, cols, ok, D, inv_width, eps)
    swapped_cols = (cols + D // 2) % D
    x_swapped = tl.load(x_RD + row * D + swapped_cols).to(tl.float32)
    y = normed(x, inv_rms, tl.load(weight_D + cols).to(tl.float32), OUT)
    y_swapped = normed(x_swapped, inv_rms, tl.load(weight_D + swapped_cols).to(tl.float32), OUT)
    cos = tl.load(cos_TD + token * D + cols).to(tl.float32)
    sin = tl.load(sin_TD + token * D + cols).to(tl.float32)
    first = round_to(y * cos, OUT).to(tl.float32)
    second = round_to(y_swapped * sin, OUT).to(tl.float32)
    tl.store(out_RD + row * D + cols, round_to(first + second, OUT))


def supported(x_THD: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `launch` takes these rows and norm weight (dtypes and shapes only): `rope`'s
    rows (a power-of-two head dim) and a weight of their dtype and head dim."""
    return (
        x_THD.dim() == 3
        and rope.supported(x_THD)
        and weight.dtype == x_THD.dtype
        and weight.shape == (x_THD.shape[-1],)
    )


def launch(
    x_THD: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_TD: torch.Tensor,
    signed_sin_TD: torch.Tensor,
) -> torch.Tensor:
    """``rope.launch(rms_norm.launch(x_THD, weight, eps), cos_TD, signed_sin_TD)`` bit for bit,
    in one launch, for contiguous ``x_THD [T, H, D]`` and tables ``[T, D]`` of x's dtype."""
    check_kernel_device("x_THD", x_THD)
    if not supported(x_THD, weight):
        raise ValueError(
            f"x_THD must be [T, H, D] of {DTYPES} with D a power of two, and weight [D] of its "
            f"dtype; got x_THD {x_THD.dtype} of shape {tuple(x_THD.shape)}, weight "
            f"{weight.dtype} of shape {tuple(weight.shape)}"
        )
    rope.check_tables(x_THD, cos_TD, signed_sin_TD)
    check_contiguous("weight", weight)
    T, H, D = x_THD.shape
    out = torch.empty_like(x_THD)
    if out.numel() == 0:
        return out
    with device_of(x_THD):
        _norm_rope_kernel[(T * H,)](
            x_THD, weight, cos_TD, signed_sin_TD, out, H, D, 1.0 / D, float(eps),
            OUT=_TL_DTYPES[x_THD.dtype], BLOCK_D=D, num_warps=rms_norm.warps_for(D),
            # No FMA may merge a product with the sum after it (as in both kernels).
            enable_fp_fusion=False,
            **dependent_launch.keywords(x_THD.device),
        )  # fmt: skip
    return out
