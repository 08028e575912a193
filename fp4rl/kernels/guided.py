"""Rollout-guided rounding (`rounding.round_guided_full` / `round_guided_compact`) in one pass.

The kernel scales x by the rollout's block and global scales exactly as the nearest-rounding
kernel does, then picks each code from its bracket by the rollout's code (full) or mantissa bit
(COMPACT). Blocks of x holding inf/NaN get block scale NaN (0x7F) and zero codes. With FAKE it
stores the dequantized values in x's dtype instead: the trainer's guided fake-quant forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.fp4.format import BLOCK_SIZE
from fp4rl.fp4.rounding import CompactCodes
from fp4rl.fp4.tensor import NVFP4Tensor
from fp4rl.kernels.launch import (
    TileConfig,
    check_contiguous,
    check_device,
    check_x,
    config_for,
    device_of,
    outputs,
    pair_view,
    scale_per_group,
)
from fp4rl.kernels.numerics import (
    block_reciprocal,
    e2m1_guided,
    e2m1_value,
    e4m3_value,
    is_finite,
    scale_back,
)
from fp4rl.kernels.tiles import (
    block_amax,
    load_bit_pairs,
    load_block_scale_bytes,
    load_code_pairs,
    load_pairs,
    per_block,
    per_row,
    program_rows,
    store_codes,
    store_values,
)


# Row counts change with every batch: no recompiling for R == 1 or R % 16 == 0.
@triton.jit(do_not_specialize=["R", "rows_per_group"])
def _guided_kernel(
    x_RK,
    guide_RKG,
    rollout_scale_RKB,
    scale_G,
    codes_RK8,
    block_scale_RKB,
    fake_RK,
    R,
    K,
    rows_per_group,
    COMPACT: tl.constexpr,
    FAKE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    rows_R, row_ok_R = program_rows(R, BLOCK_R)
    s_R = tl.load(scale_G + rows_R // rows_per_group, mask=row_ok_R, other=0.0)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x_even, x_odd = load_pairs(x_RK, rows_R, row_ok_R, k0, K, BLOCK_K)
        bad = ~is_finite(block_amax(x_even, x_odd))  # inf or NaN in the block
        rollout_byte = load_block_scale_bytes(rollout_scale_RKB, rows_R, row_ok_R, k0, K, BLOCK_K)
        block_byte = tl.where(bad, 0x7F, rollout_byte)
        block_scale = e4m3_value(block_byte)
        live, recip = block_reciprocal(block_scale, s_R[:, None])
        if COMPACT:
            guide_even, guide_odd = load_bit_pairs(guide_RKG, rows_R, row_ok_R, k0, K, BLOCK_K)
        else:
            guide_even, guide_odd = load_code_pairs(guide_RKG, rows_R, row_ok_R, k0, K, BLOCK_K)
        live4, recip4 = per_block(live), per_block(recip)
        code_even = tl.where(live4, e2m1_guided(x_even * recip4, guide_even, COMPACT), 0)
        code_odd = tl.where(live4, e2m1_guided(x_odd * recip4, guide_odd, COMPACT), 0)
        if FAKE:
            sf, s = per_block(block_scale), per_row(s_R)
            store_values(
                fake_RK, rows_R, row_ok_R, k0, K, scale_back(e2m1_value(code_even), sf, s),
                scale_back(e2m1_value(code_odd), sf, s), BLOCK_K,
            )  # fmt: skip
        else:
            store_codes(
                codes_RK8, block_scale_RKB, rows_R, row_ok_R, k0, K, code_even | (code_odd << 4),
                block_byte, BLOCK_K,
            )  # fmt: skip


def check_guidance(x: torch.Tensor, guidance: NVFP4Tensor | CompactCodes) -> torch.Tensor:
    """The rollout's codes or mantissa bits, once its tensors are checked against x."""
    if isinstance(guidance, CompactCodes):
        guide, what = guidance.mantissa_bits, "compact guidance"
    elif isinstance(guidance, NVFP4Tensor):
        guide, what = guidance.codes, "rollout codes"
    else:
        raise TypeError(f"guidance must be NVFP4Tensor or CompactCodes, got {type(guidance)}")
    if guidance.shape != x.shape:
        raise ValueError(f"{what} of shape {tuple(guidance.shape)} for x {tuple(x.shape)}")
    blocks_shape = (*x.shape[:-1], x.shape[-1] // BLOCK_SIZE)
    if guidance.block_scale.shape != blocks_shape:
        raise ValueError(
            f"guidance block_scale {tuple(guidance.block_scale.shape)} does not match x "
            f"{tuple(x.shape)} (expected {blocks_shape})"
        )
    dtypes = (guide.dtype, guidance.block_scale.dtype, guidance.global_scale.dtype)
    if dtypes != (torch.uint8, torch.float8_e4m3fn, torch.float32):
        raise TypeError(f"{what} needs uint8, float8_e4m3fn and float32 tensors; got {dtypes}")
    check_device(what, guide, x.device)
    check_device("guidance block_scale", guidance.block_scale, x.device)
    check_device("guidance global_scale", guidance.global_scale, x.device)
    check_contiguous(what, guide)
    check_contiguous("guidance block_scale", guidance.block_scale)
    return guide


def launch(
    x: torch.Tensor,
    guidance: NVFP4Tensor | CompactCodes,
    *,
    fake: bool,
    config: TileConfig | None = None,
) -> NVFP4Tensor | torch.Tensor:
    """Guided quantization of ``x [..., K]`` with the rollout's scales (and codes or mantissa
    bits); with ``fake``, ``reference.dequantize`` of that result in x's dtype instead."""
    check_x(x)
    guide = check_guidance(x, guidance)
    scale_G, group_rows = scale_per_group("guidance global_scale", guidance.global_scale, x.shape)
    k = x.shape[-1]
    x_RK = x.view(-1, k)
    num_rows = x_RK.shape[0]
    fake_RK, codes, codes_words, block_scale = outputs(x, fake)
    if num_rows:
        grid, meta = (config or config_for(k)).launch(num_rows, k)
        with device_of(x):
            _guided_kernel[grid](
                pair_view(x_RK), guide, guidance.block_scale.view(torch.uint8), scale_G,
                codes_words, block_scale,
                fake_RK, num_rows, k, group_rows,
                COMPACT=isinstance(guidance, CompactCodes), FAKE=fake, **meta,
            )  # fmt: skip
    if fake:
        return fake_RK.view(x.shape)
    return NVFP4Tensor(
        codes=codes,
        block_scale=block_scale.view(torch.float8_e4m3fn),
        global_scale=guidance.global_scale,
    )
