"""The MoE combine (each token's k expert output rows, weighted and summed) in one kernel.

`fp4rl.model.experts.eager_combine` gathers token t's k rows of the experts' output ``y [A, H]``
(rows sorted by expert; ``row_order[t, j]`` is the row of assignment (t, j)), multiplies each
by its top-k weight cast to y's dtype and sums over the k: a gather, a cast, a multiply and a
reduction, four kernels per MoE layer and step. Here it is one launch, one program per token
and chunk of ``block_h`` columns, reading each gathered row where it lies.

Numerics: the eager arithmetic step by step -- the weight rounded to y's dtype; each product
computed in FP32 (exact for BF16 and FP16 operands) and rounded to y's dtype, as torch's
multiply rounds it; the k products summed in FP32 from +0.0 and rounded once to y's dtype, as
torch's sum over a dim of a BF16 or FP16 tensor -- except the order of that sum: here
j = 0, 1, ..., k - 1, fixed, so a token's result depends on its own rows alone, never on the
batch. Torch's order is its reduction kernel's; another order may move the FP32 sum by a few
ulps and, rarely, an output by one unit in its last place (bounded in
tests/kernels/test_kernel_moe_combine.py). FMA contraction is off, so an FP32 product is
rounded before it is added, as eagerly. NaN and inf propagate as eagerly: a NaN in a gathered row
makes the token's output NaN there, an inf times a zero weight is NaN, -0.0 products sum to
+0.0. Row indices outside ``[0, A)`` (the caller's bug: the dispatch's are a permutation) read
nothing and give NaN.

The launch depends on shapes only (nothing is read on the host), so it can be captured in a
CUDA graph. `benchmarks/moe_combine.py` times it against the eager ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4rl.kernels import dependent_launch
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import check_contiguous, check_kernel_device, device_of
from fp4rl.kernels.numerics import round_to

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
MAX_TOP_K = 16
H_MULTIPLE = 16  # rows start 16-element aligned: vector loads


@dataclass(frozen=True, slots=True)
class CombineTile:
    """Programs of ``block_h`` columns (a power of two >= 16) on ``num_warps`` warps."""

    block_h: int
    num_warps: int

    def __post_init__(self) -> None:
        if self.block_h < 16 or self.block_h & (self.block_h - 1):
            raise ValueError(f"block_h must be a power of two >= 16; got {self.block_h}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8; got {self.num_warps}")


# 8 BF16 values (16 bytes) per thread and load; at H = 2048 eight programs per token, so a
# decode of one token still spreads over eight SMs.
DEFAULT_TILE = CombineTile(block_h=256, num_warps=1)


@triton.jit
def _moe_combine_kernel(
    y_AH, row_order_Tk, weights_Tk, out_TH, A, H,
    K: tl.constexpr, OUT: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)  # +0.0, torch's sum's start
    # j in order: the FP32 sum's order is fixed, whatever the batch.
    for j in tl.static_range(K):
        # The row index per lane: Triton's interpreter mistypes a mask of scalar and vector.
        row = tl.load(row_order_Tk + token * K + j) + tl.zeros([BLOCK_H], tl.int64)
        inside = ok & (row >= 0) & (row < A)
        weight = round_to(tl.load(weights_Tk + token * K + j).to(tl.float32), OUT)
        y = tl.load(y_AH + row * H + cols, mask=inside, other=float("nan"))
        acc += round_to(y.to(tl.float32) * weight.to(tl.float32), OUT).to(tl.float32)
    tl.store(out_TH + token * H + cols, round_to(acc, OUT), mask=ok)


def supported(y_AH: torch.Tensor, row_order_Tk: torch.Tensor, weights_Tk: torch.Tensor) -> bool:
    """Whether `launch` takes these inputs (dtypes and shapes only): y ``[A, H]`` of `DTYPES`
    with H a positive multiple of 16, int64 ``row_order [T, k]`` with 1 <= k <= 16, and
    weights of `DTYPES` shaped like row_order, all on y's device."""
    return (
        y_AH.dtype in DTYPES
        and weights_Tk.dtype in DTYPES
        and row_order_Tk.dtype == torch.int64
        and y_AH.dim() == 2
        and y_AH.shape[1] > 0
        and y_AH.shape[1] % H_MULTIPLE == 0
        and row_order_Tk.dim() == 2
        and 1 <= row_order_Tk.shape[1] <= MAX_TOP_K
        and weights_Tk.shape == row_order_Tk.shape
        and row_order_Tk.device == y_AH.device
        and weights_Tk.device == y_AH.device
    )


def _check(y_AH: torch.Tensor, row_order_Tk: torch.Tensor, weights_Tk: torch.Tensor) -> None:
    check_kernel_device("y_AH", y_AH)
    for name, t in (("row_order_Tk", row_order_Tk), ("weights_Tk", weights_Tk)):
        if t.device != y_AH.device:
            raise ValueError(f"{name} must be on {y_AH.device} like y_AH; got {t.device}")
    if y_AH.dtype not in DTYPES or weights_Tk.dtype not in DTYPES:
        raise ValueError(
            f"y_AH and weights_Tk must have dtypes among {DTYPES}; got {y_AH.dtype} and "
            f"{weights_Tk.dtype}"
        )
    if row_order_Tk.dtype != torch.int64:
        raise ValueError(f"row_order_Tk must be int64; got {row_order_Tk.dtype}")
    if y_AH.dim() != 2 or y_AH.shape[1] == 0 or y_AH.shape[1] % H_MULTIPLE:
        raise ValueError(
            f"y_AH must be [A, H] with H a positive multiple of {H_MULTIPLE}; got shape "
            f"{tuple(y_AH.shape)}"
        )
    if row_order_Tk.dim() != 2 or not 1 <= row_order_Tk.shape[1] <= MAX_TOP_K:
        raise ValueError(
            f"row_order_Tk must be [T, k] with 1 <= k <= {MAX_TOP_K}; got shape "
            f"{tuple(row_order_Tk.shape)}"
        )
    if weights_Tk.shape != row_order_Tk.shape:
        raise ValueError(
            f"weights_Tk must have row_order_Tk's shape {tuple(row_order_Tk.shape)}; got "
            f"{tuple(weights_Tk.shape)}"
        )
    for name, t in (("y_AH", y_AH), ("row_order_Tk", row_order_Tk), ("weights_Tk", weights_Tk)):
        check_contiguous(name, t)


def launch(
    y_AH: torch.Tensor,
    row_order_Tk: torch.Tensor,
    weights_Tk: torch.Tensor,
    tile: CombineTile = DEFAULT_TILE,
) -> torch.Tensor:
    """``out [T, H]`` in y's dtype: ``out[t] = sum_j y[row_order[t, j]] * weights[t, j]``, each
    product rounded to y's dtype, the sum in FP32 over j in order, rounded once. ``tile`` other
    than the default is for benchmarking variants (benchmarks/moe_combine.py)."""
    _check(y_AH, row_order_Tk, weights_Tk)
    (A, H), (T, k) = y_AH.shape, row_order_Tk.shape
    out_TH = torch.empty(T, H, dtype=y_AH.dtype, device=y_AH.device)
    if T == 0:
        return out_TH
    block_h = min(tile.block_h, triton.next_power_of_2(H))
    with device_of(y_AH):
        _moe_combine_kernel[(T, -(-H // block_h))](
            y_AH, row_order_Tk, weights_Tk, out_TH, A, H,
            K=k, OUT=_TL_DTYPES[y_AH.dtype], BLOCK_H=block_h, num_warps=tile.num_warps,
            # Each product is rounded to y's dtype before the sum adds it, never fused.
            enable_fp_fusion=False,
            **dependent_launch.keywords(y_AH.device),
        )  # fmt: skip
    return out_TH
