"""Group amax of ``[R, K]`` rows: the first of the two passes of per-tensor / per-group quantize.

Each program takes the amax of its rows (`tiles.row_amax`) and folds it into its groups' int32
slots with `atomic_max` on the FP32 bits: max is order-free, so the result is deterministic, and
bits of non-negative floats order like the floats. A non-finite row contributes +inf or NaN bits
(above every number), which the quantize kernel turns into a poisoned (NaN) global scale.
Per-row scaling never comes here: its amax is fused into the quantize kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels.launch import CONFIGS, TileConfig, device_of, pair_view
from fp4rl.kernels.tiles import program_rows, row_amax


# Row counts change with every batch: no recompiling for R == 1 or R % 16 == 0.
@triton.jit(do_not_specialize=["R", "rows_per_group"])
def _group_amax_kernel(
    x_RK,
    amax_bits_G,
    R,
    K,
    rows_per_group,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    rows_R, row_ok_R = program_rows(R, BLOCK_R)
    amax_R = row_amax(x_RK, rows_R, row_ok_R, K, BLOCK_R, BLOCK_K, NUM_STAGES)
    # As bits, +inf and (positive) NaN rank above every number: a non-finite row poisons its
    # group's maximum.
    amax_bits_R = amax_R.to(tl.int32, bitcast=True)
    # One atomic per program when all its rows share a group (per-tensor, large groups).
    first_group = (tl.program_id(0) * BLOCK_R) // rows_per_group
    last_group = (tl.minimum(tl.program_id(0) * BLOCK_R + BLOCK_R, R) - 1) // rows_per_group
    if first_group == last_group:
        tl.atomic_max(amax_bits_G + first_group, tl.max(amax_bits_R, axis=0), sem="relaxed")
    else:
        tl.atomic_max(
            amax_bits_G + rows_R // rows_per_group, amax_bits_R, mask=row_ok_R, sem="relaxed"
        )


def group_amax_bits(
    x_RK: torch.Tensor, rows_per_group: int, config: TileConfig = CONFIGS["default"]
) -> torch.Tensor:
    """int32 bits of ``max |x|`` over each group of ``rows_per_group`` rows, shape ``[G]``.

    x_RK must be a contiguous 2-D float tensor (the callers check x itself).
    """
    if x_RK.dim() != 2 or not x_RK.is_contiguous():
        raise ValueError(f"x_RK must be contiguous 2-D; got shape {tuple(x_RK.shape)}")
    num_rows, k = x_RK.shape
    if rows_per_group < 1 or num_rows % rows_per_group:
        raise ValueError(f"rows_per_group={rows_per_group} does not divide R={num_rows}")
    amax_bits_G = torch.zeros(num_rows // rows_per_group, dtype=torch.int32, device=x_RK.device)
    grid, meta = config.launch(num_rows, k)
    with device_of(x_RK):
        _group_amax_kernel[grid](
            pair_view(x_RK), amax_bits_G, num_rows, k, rows_per_group, **meta,
        )  # fmt: skip
    return amax_bits_G
