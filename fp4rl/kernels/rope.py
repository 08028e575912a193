"""Rotary position embedding of ``[T, H, D]`` queries or keys in one kernel, bit for bit the
eager formulation.

`fp4rl.model.layers.apply_rope` computes ``x * cos + cat(x2, x1) * signed_sin`` with the
tables of each token broadcast over the heads: a concatenation, two products and a sum, each
its own kernel, each rounding to x's dtype. This kernel reads the halves swapped through its
column offsets and rounds exactly where the eager kernels do (each product, then the sum), so
its results are the eager ones bit for bit; one launch instead of four. Program (t, j) takes
token t's heads ``[j * BLOCK_H, (j + 1) * BLOCK_H)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels import dependent_launch
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import check_contiguous, check_kernel_device, device_of
from fp4rl.kernels.numerics import round_to

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
BLOCK_H = 8


@triton.jit
def _rope_kernel(
    x_THD, cos_TD, sin_TD, out_THD, H,
    D: tl.constexpr, OUT: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, D)
    ok = (heads < H)[:, None]
    rows = x_THD + (token * H + heads)[:, None] * D
    x = tl.load(rows + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    swapped = tl.load(rows + ((cols + D // 2) % D)[None, :], mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_TD + token * D + cols).to(tl.float32)[None, :]
    sin = tl.load(sin_TD + token * D + cols).to(tl.float32)[None, :]
    first = round_to(x * cos, OUT).to(tl.float32)
    second = round_to(swapped * sin, OUT).to(tl.float32)
    out = out_THD + (token * H + heads)[:, None] * D + cols[None, :]
    tl.store(out, round_to(first + second, OUT), mask=ok)


def supported(x_THD: torch.Tensor) -> bool:
    """Whether the kernel takes rows like ``x_THD``: a float dtype of `DTYPES`, a power-of-two
    head dim of at least 2."""
    D = x_THD.shape[-1]
    return x_THD.dtype in DTYPES and D >= 2 and D & (D - 1) == 0


def check_tables(x_THD: torch.Tensor, cos_TD: torch.Tensor, signed_sin_TD: torch.Tensor) -> None:
    """Raise ValueError unless the tables are contiguous ``[T, D]`` of x's dtype and x
    ``[T, H, D]`` is contiguous (x's dtype and shape checked by the caller)."""
    T, _, D = x_THD.shape
    for name, table in (("cos_TD", cos_TD), ("signed_sin_TD", signed_sin_TD)):
        if table.shape != (T, D) or table.dtype != x_THD.dtype:
            raise ValueError(
                f"{name} must be {x_THD.dtype} of shape {(T, D)}; got {table.dtype} of shape "
                f"{tuple(table.shape)}"
            )
        check_contiguous(name, table)
    check_contiguous("x_THD", x_THD)


def launch(x_THD: torch.Tensor, cos_TD: torch.Tensor, signed_sin_TD: torch.Tensor) -> torch.Tensor:
    """`apply_rope`'s result for contiguous ``x_THD`` and tables ``[T, D]`` of x's dtype."""
    check_kernel_device("x_THD", x_THD)
    if x_THD.dim() != 3 or not supported(x_THD):
        raise ValueError(
            f"x_THD must be [T, H, D] of {DTYPES} with D a power of two; got {x_THD.dtype} of "
            f"shape {tuple(x_THD.shape)}"
        )
    check_tables(x_THD, cos_TD, signed_sin_TD)
    T, H, D = x_THD.shape
    out = torch.empty_like(x_THD)
    if out.numel() == 0:
        return out
    with device_of(x_THD):
        _rope_kernel[(T, triton.cdiv(H, BLOCK_H))](
            x_THD, cos_TD, signed_sin_TD, out, H, D=D, OUT=_TL_DTYPES[x_THD.dtype],
            BLOCK_H=BLOCK_H, num_warps=4,
            # The sum of the two products must add the rounded products, never one fused FMA.
            enable_fp_fusion=False,
            **dependent_launch.keywords(x_THD.device),
        )  # fmt: skip
    return out
