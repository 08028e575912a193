"""NVFP4 -> float: `reference.dequantize` as one memory-bound kernel.

``value = e2m1_value(code) * f32(block_scale) * global_scale`` in FP32, left to right, then cast
to the output dtype as torch casts (nearest even; NaN as torch writes it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.fp4.reference import SUPPORTED_DTYPES
from fp4rl.fp4.tensor import NVFP4Tensor
from fp4rl.kernels.launch import (
    TileConfig,
    check_contiguous,
    check_device,
    check_kernel_device,
    config_for,
    device_of,
    scale_per_group,
)
from fp4rl.kernels.numerics import e2m1_value, e4m3_value, scale_back
from fp4rl.kernels.tiles import (
    load_block_scale_bytes,
    load_code_pairs,
    per_block,
    per_row,
    program_rows,
    store_values,
)


# Row counts change with every batch: no recompiling for R == 1 or R % 16 == 0.
@triton.jit(do_not_specialize=["R", "rows_per_group"])
def _dequantize_kernel(
    codes_RK2,
    block_scale_RKB,
    scale_G,
    out_RK,
    R,
    K,
    rows_per_group,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    rows_R, row_ok_R = program_rows(R, BLOCK_R)
    s = per_row(tl.load(scale_G + rows_R // rows_per_group, mask=row_ok_R, other=0.0))
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        code_even, code_odd = load_code_pairs(codes_RK2, rows_R, row_ok_R, k0, K, BLOCK_K)
        block_byte = load_block_scale_bytes(block_scale_RKB, rows_R, row_ok_R, k0, K, BLOCK_K)
        sf = per_block(e4m3_value(block_byte))
        store_values(
            out_RK, rows_R, row_ok_R, k0, K, scale_back(e2m1_value(code_even), sf, s),
            scale_back(e2m1_value(code_odd), sf, s), BLOCK_K,
        )  # fmt: skip


def launch(
    t: NVFP4Tensor, dtype: torch.dtype = torch.float32, *, config: TileConfig | None = None
) -> torch.Tensor:
    """``reference.dequantize(t, dtype)``: the values of ``t`` as a ``[..., K]`` tensor."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dequantize returns bfloat16, float16 or float32; got dtype={dtype}")
    check_kernel_device("codes", t.codes)
    check_device("block_scale", t.block_scale, t.device)
    check_device("global_scale", t.global_scale, t.device)
    check_contiguous("codes", t.codes)
    check_contiguous("block_scale", t.block_scale)
    k = t.shape[-1]
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    num_rows = out.numel() // k
    if num_rows:
        scale_G, group_rows = scale_per_group("global_scale", t.global_scale, t.shape)
        grid, meta = (config or config_for(k)).launch(num_rows, k)
        with device_of(out):
            _dequantize_kernel[grid](
                t.codes, t.block_scale.view(torch.uint8), scale_G, out, num_rows, k, group_rows,
                **meta,
            )  # fmt: skip
    return out
