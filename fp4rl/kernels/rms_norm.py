"""RMSNorm of each row in one kernel.

``y = weight * dtype(x32 / sqrt(mean(x32 ** 2) + eps))`` per row of ``x [R, D]``, ``x32`` the
row in FP32 and the weight product rounded to x's dtype as torch rounds ``weight * y`` (the
Qwen formulation, `fp4rl.model.layers.eager_rms_norm`). Eagerly that formulation is seven
kernels (cast, square, mean, add, rsqrt, multiply, weight multiply) per call and four calls per
decoder layer; here it is one launch, one program per row.

Numerics: the eager formulation's arithmetic step by step (the mean as the sum times FP32
``1 / D``, as torch's mean; ``rsqrt`` as torch's CUDA kernel computes it), except the order in
which the FP32 sum of squares is added: the kernel's own, fixed by the tile, which depends on D
alone, so a row's result does not depend on the batch it is in. The inverse RMS may therefore
differ from the eager one in its last bit, which moves an output by one unit in its last
place, rarely (tests/kernels/test_kernel_rms_norm.py bounds both): the class of difference a
GEMM's summation order makes. The trainer's forward runs the same kernel on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels.launch import check_contiguous, check_kernel_device, device_of
from fp4rl.kernels.numerics import round_to

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def inverse_rms(x_RD, row, cols, ok, D, inv_width, eps):
    """Row ``row`` of ``x_RD`` in FP32 (``[BLOCK_D]``, zeros past D) and its inverse RMS: the
    sum of squares in the order a one-warp program's ``[BLOCK_D]`` tile sets (kernels that
    must give RMSNorm's bits call this from such a program: `fp4rl.kernels.norm_rope`)."""
    x = tl.load(x_RD + row * D + cols, mask=ok, other=0.0).to(tl.float32)
    # As torch's mean: the sum times FP32 1 / D. (`tl.full` is a no-op compiled; the
    # interpreter holds float arguments in double precision.)
    mean = tl.sum(x * x, axis=0) * tl.full((), inv_width, tl.float32)
    return x, tl.math.rsqrt(mean + tl.full((), eps, tl.float32))


@triton.jit
def normed(x, inv_rms, weight, OUT: tl.constexpr):
    """``weight * OUT(x * inv_rms)`` rounded to OUT, as FP32 (exact)."""
    y = round_to(x * inv_rms, OUT)
    return round_to(weight * y.to(tl.float32), OUT).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_RD, weight_D, y_RD, D, inv_width, eps, OUT: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    x, inv_rms = inverse_rms(x_RD, row, cols, ok, D, inv_width, eps)
    weight = tl.load(weight_D + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_RD + row * D + cols, round_to(normed(x, inv_rms, weight, OUT), OUT), mask=ok)


def warps_for(block_d: int) -> int:
    """Warps of a program that normalizes one row of ``block_d`` (padded) values: they and the
    tile fix the order of the sum of squares."""
    return 4 if block_d >= 1024 else 1


def launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape) with ``weight [D]`` of x's dtype."""
    check_kernel_device("x", x)
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"x and weight must share a dtype among {DTYPES}; got {x.dtype} and {weight.dtype}"
        )
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight must be [{D}] for x of shape {tuple(x.shape)}; got "
                         f"{tuple(weight.shape)}")  # fmt: skip
    check_contiguous("x", x)
    check_contiguous("weight", weight)
    y = torch.empty_like(x)
    rows = x.numel() // D if D else 0
    if rows == 0:
        return y
    block = triton.next_power_of_2(D)
    with device_of(x):
        _rms_norm_kernel[(rows,)](
            x, weight, y, D, 1.0 / D, float(eps), OUT=_TL_DTYPES[x.dtype], BLOCK_D=block,
            num_warps=warps_for(block), enable_fp_fusion=False,
        )  # fmt: skip
    return y
