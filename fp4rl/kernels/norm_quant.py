"""The residual add, the RMSNorm after it and the routed experts' input site, in one launch.

Per row of ``x, delta [R, D]``: ``s = x + delta`` and ``h = rms_norm(s)``, the work of
`rms_norm.launch_add` by its own row code (`rms_norm.store_sum_and_norm`, the same tile and
warps), and ``h_q = fake_quantize(h, scaling="row")``: the nearest NVFP4 quantization of the
stored h with one FP32 global scale per row (its amax / 2688), E4M3 block scales of 16 and E2M1
codes, dequantized and rounded to h's dtype -- ``reference.dequantize(reference.quantize(h,
scaling="row"), h.dtype)``, NaN and inf included (a row holding one is NaN throughout). The
quantization is `nearest`'s per-row arithmetic on whole rows held in registers (`load_pairs`,
`block_amax`, `numerics.global_scale_from_amax`, `tiles.quantize_chunk`), as the SwiGLU kernel
runs the intermediate's site.

The norm's sum of squares is ordered by its ``[BLOCK_D]`` tile and the quantization reads
blocks of 16 as (even, odd) pairs: the program stores h, waits for its threads at a barrier
(after which each sees the others' stores) and loads its row of h back in the pair layout. So
the engine's FP4 MoE layers make their experts' input in the norm's launch, where the site took
one launch more (`fp4rl.ops.add_rms_norm_quantize`); where the rollout keeps that site's
record, the same launch stores it too (`tiles.store_record`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.fp4.rounding import CompactCodes
from fp4rl.fp4.tensor import NVFP4Tensor
from fp4rl.kernels import dependent_launch, rms_norm
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import device_of, pair_view, permute_step, record_outputs
from fp4rl.kernels.tiles import fake_quantize_rows, load_pairs, program_rows

DTYPES = rms_norm.DTYPES
MAX_WIDTH = 8192  # values per row held in registers (one chunk), as `nearest`'s "row" tile


@triton.jit(do_not_specialize=["R"])
def _add_rms_norm_quantize_kernel(
    x_RD, delta_RD, weight_D, s_RD, h_RD, h_pairs_RD, h_q_RD, record_RD, record_block_scale_RD,
    record_global_scale_R, R, D, inv_width, eps, RECORD: tl.constexpr, BLOCK_D: tl.constexpr,
    PERMUTE_BY: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    OUT: tl.constexpr = s_RD.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    rms_norm.store_sum_and_norm(
        x_RD, delta_RD, weight_D, s_RD, h_RD, row, D, inv_width, eps, OUT=OUT, BLOCK_D=BLOCK_D
    )
    tl.debug_barrier()  # h as stored, every thread's, for the pair loads below
    rows_R, row_ok_R = program_rows(R, 1)  # this one row
    h_even, h_odd = load_pairs(h_pairs_RD, rows_R, row_ok_R, 0, D, BLOCK_D)
    fake_quantize_rows(
        h_even, h_odd, h_q_RD, rows_R, row_ok_R, D, record_RD, record_block_scale_RD,
        record_global_scale_R, rows_R, RECORD, BLOCK_D, PERMUTE_BY,
    )  # fmt: skip


def supported(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `launch` takes these inputs (dtypes and shapes only): x, delta and weight of one
    dtype among `DTYPES`, delta of x's shape, ``weight [D]``, D a multiple of 16 up to
    `MAX_WIDTH`."""
    if x.dim() == 0 or x.dtype not in DTYPES or delta.dtype != x.dtype or weight.dtype != x.dtype:
        return False
    D = x.shape[-1]
    return delta.shape == x.shape and weight.shape == (D,) and D % 16 == 0 and 0 < D <= MAX_WIDTH


def launch(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    record: str | None = None,
    permuted_by: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, NVFP4Tensor | CompactCodes | None]:
    """``(s, h, h_q, h_record)``: ``(s, h) = rms_norm.launch_add(x, delta, weight, eps)``, ``h_q
    = fake_quantize(h, scaling="row")`` and, with ``record`` "full" or "compact", the site's
    record of h (``quantize(h, scaling="row")`` or its `rounding.compact`; None without), bit for
    bit, in one launch, for x and delta of one shape (any leading shape, rows of D values, D a
    multiple of 16 up to `MAX_WIDTH`) and ``weight [D]``, all of one dtype. With
    ``permuted_by``, h_q's rows are stored permuted in K steps of that width, as
    `launch.permuted_rows` permutes them (s, h and the record stay in real order)."""
    D = x.shape[-1] if x.dim() else 0
    if not 0 < D <= MAX_WIDTH or D % 16:
        raise ValueError(
            f"x must have rows of D values, D a positive multiple of 16 up to {MAX_WIDTH}; got "
            f"shape {tuple(x.shape)}"
        )
    step = permute_step(permuted_by, D)
    rms_norm.check_add(x, delta, weight)
    s, h, h_q = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    rec = record_outputs(record, tuple(x.shape[:-1]), D, x.device)
    rows = x.numel() // D
    if rows == 0:
        return s, h, h_q, rec.record
    block = triton.next_power_of_2(D)
    with device_of(x):
        _add_rms_norm_quantize_kernel[(rows,)](
            x, delta, weight, s, h, pair_view(h.view(rows, D)), h_q, *rec.pointers(), rows, D,
            1.0 / D, float(eps), RECORD=rec.RECORD, BLOCK_D=block, PERMUTE_BY=step,
            num_warps=rms_norm.warps_for(block), enable_fp_fusion=False,
            **dependent_launch.keywords(x.device),
        )  # fmt: skip
    return s, h, h_q, rec.record
