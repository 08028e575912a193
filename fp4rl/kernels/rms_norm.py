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

`launch_add` also takes the residual add before a norm: it reads x and delta, stores ``s = x +
delta`` rounded as torch rounds it (the FP32 sum of the two values, rounded once to their
dtype) and the norm of that rounded s by this kernel's own row code (`row_inverse_rms`,
`normed`, the same tile and warps): bitwise ``(x + delta, launch(x + delta, weight, eps))`` in
one launch instead of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels import dependent_launch
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import check_contiguous, check_device, check_kernel_device, device_of
from fp4rl.kernels.numerics import round_to

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def row_inverse_rms(x, inv_width, eps):
    """The inverse RMS of an FP32 row ``x [BLOCK_D]`` (zeros past D): the sum of squares in
    the order the program's ``[BLOCK_D]`` tile and warps (`warps_for`) set, times FP32 ``1 /
    D``, plus eps, under rsqrt."""
    # As torch's mean: the sum times FP32 1 / D. (`tl.full` is a no-op compiled; the
    # interpreter holds float arguments in double precision.)
    mean = tl.sum(x * x, axis=0) * tl.full((), inv_width, tl.float32)
    return tl.math.rsqrt(mean + tl.full((), eps, tl.float32))


@triton.jit
def inverse_rms(x_RD, row, cols, ok, D, inv_width, eps):
    """Row ``row`` of ``x_RD`` in FP32 (``[BLOCK_D]``, zeros past D) and its inverse RMS
    (`row_inverse_rms`; kernels that must give RMSNorm's bits call this from a program of the
    same tile and warps: `fp4rl.kernels.norm_rope`)."""
    x = tl.load(x_RD + row * D + cols, mask=ok, other=0.0).to(tl.float32)
    return x, row_inverse_rms(x, inv_width, eps)


@triton.jit
def normed(x, inv_rms, weight, OUT: tl.constexpr):
    """``weight * OUT(x * inv_rms)`` rounded to OUT, as FP32 (exact)."""
    y = round_to(x * inv_rms, OUT)
    return round_to(weight * y.to(tl.float32), OUT).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_RD, weight_D, y_RD, D, inv_width, eps,
    OUT: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    x, inv_rms = inverse_rms(x_RD, row, cols, ok, D, inv_width, eps)
    weight = tl.load(weight_D + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_RD + row * D + cols, round_to(normed(x, inv_rms, weight, OUT), OUT), mask=ok)


@triton.jit
def store_sum_and_norm(
    x_RD, delta_RD, weight_D, s_RD, y_RD, row, D, inv_width, eps,
    OUT: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Row ``row`` (int64) of ``s = OUT(x + delta)`` and of its RMSNorm ``y``, stored: the
    work of one `_add_rms_norm_kernel` program (kernels that must give its bits call this from
    a program of the same tile and warps: `fp4rl.kernels.norm_quant`)."""
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    at = row * D + cols
    x = tl.load(x_RD + at, mask=ok, other=0.0).to(tl.float32)
    delta = tl.load(delta_RD + at, mask=ok, other=0.0).to(tl.float32)
    # torch's x + delta: the two values' FP32 sum rounded once to OUT (a no-op for FP32).
    s = round_to(x + delta, OUT)
    tl.store(s_RD + at, s, mask=ok)
    s = s.to(tl.float32)  # the stored values, zeros past D as `inverse_rms` loads them
    inv_rms = row_inverse_rms(s, inv_width, eps)
    weight = tl.load(weight_D + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_RD + at, round_to(normed(s, inv_rms, weight, OUT), OUT), mask=ok)


@triton.jit
def _add_rms_norm_kernel(
    x_RD, delta_RD, weight_D, s_RD, y_RD, D, inv_width, eps,
    OUT: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    store_sum_and_norm(
        x_RD, delta_RD, weight_D, s_RD, y_RD, row, D, inv_width, eps, OUT=OUT, BLOCK_D=BLOCK_D
    )


def warps_for(block_d: int) -> int:
    """Warps of a program that normalizes one row of ``block_d`` (padded) values: they and the
    tile fix the order of the sum of squares."""
    return 4 if block_d >= 1024 else 1


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
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


def check_add(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> None:
    """What `launch_add` needs of its inputs (errors name the value at fault)."""
    _check(x, weight)
    if delta.dtype != x.dtype or delta.shape != x.shape:
        raise ValueError(
            f"delta must be {x.dtype} of shape {tuple(x.shape)} like x; got {delta.dtype} of "
            f"shape {tuple(delta.shape)}"
        )
    check_device("delta", delta, x.device)
    check_contiguous("delta", delta)


def launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (any leading shape) with ``weight [D]`` of x's dtype."""
    _check(x, weight)
    y = torch.empty_like(x)
    D = x.shape[-1]
    rows = x.numel() // D if D else 0
    if rows == 0:
        return y
    block = triton.next_power_of_2(D)
    with device_of(x):
        _rms_norm_kernel[(rows,)](
            x, weight, y, D, 1.0 / D, float(eps), OUT=_TL_DTYPES[x.dtype], BLOCK_D=block,
            num_warps=warps_for(block), enable_fp_fusion=False,
            **dependent_launch.keywords(x.device),
        )  # fmt: skip
    return y


def launch_add(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, launch(s, weight, eps))`` with ``s = x + delta`` (torch's rounding), bit for bit,
    in one launch, for ``delta`` of x's dtype and shape (any leading shape) and ``weight [D]``."""
    check_add(x, delta, weight)
    s, y = torch.empty_like(x), torch.empty_like(x)
    D = x.shape[-1]
    rows = x.numel() // D if D else 0
    if rows == 0:
        return s, y
    block = triton.next_power_of_2(D)
    with device_of(x):
        _add_rms_norm_kernel[(rows,)](
            x, delta, weight, s, y, D, 1.0 / D, float(eps), OUT=_TL_DTYPES[x.dtype],
            BLOCK_D=block, num_warps=warps_for(block), enable_fp_fusion=False,
            **dependent_launch.keywords(x.device),
        )  # fmt: skip
    return s, y
