"""The experts' SwiGLU in one kernel, and with the intermediate's FP4 site in the same pass.

``h = silu(gate) * up`` for ``gate_up [A, 2I]`` (each row's gate, then its up half), as the
eager formulation computes it (`fp4rl.model.experts.eager_swiglu`): ``silu(g) = g / (1 +
exp(-g))`` in FP32 with an IEEE division and the accurate exp (`numerics.exp_rn`), rounded to
the dtype; then the product of the two dtype values in FP32,
rounded once. On one H200 this gave torch's ``F.silu`` bit for bit on all 65,536 BF16 inputs and
on 4 M random FP32 inputs (the fast ``exp2``-based exp differed on a third of the FP32 ones);
eagerly the formulation is two kernels, here one.

With QUANTIZE the kernel stores ``dequantize(quantize(h, scaling="row"))`` instead of h, in h's
dtype: the intermediate's round-to-nearest site (`fp4rl.kernels.nearest`'s per-row arithmetic,
`tiles.quantize_chunk`), so the engine's packed experts make their intermediate in one launch
where eagerly it takes three. Rows of up to `MAX_WIDTH` values are one chunk in registers.
`launch_recording` also stores the site's record (full codes or compact mantissa bits, with the
scales) from the same launch, its rows in the order the caller names (the experts' assignments
in token order, while h stays sorted by expert): a captured intermediate then costs no launch
more than an uncaptured one.

Under Triton's interpreter (CPU tests) the exp is numpy's, which may round differently: there
the silu is checked against the eager formulation to within one unit in its last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.fp4.rounding import CompactCodes
from fp4rl.fp4.tensor import NVFP4Tensor
from fp4rl.kernels import dependent_launch
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import (
    check_contiguous,
    check_kernel_device,
    device_of,
    pair_view,
    permute_step,
    record_outputs,
)
from fp4rl.kernels.numerics import (
    exp_rn,
    round_to,
)
from fp4rl.kernels.tiles import fake_quantize_rows, load_pairs, program_rows, store_values

DTYPES = (torch.bfloat16,)
MAX_WIDTH = 8192  # intermediate values per row held in registers (one chunk)
# Below this many rows (decode batches) each program takes one row, so that a batch-1 step's
# 8 rows run on 8 SMs rather than 2; from it on, 2048 values per program (two rows of
# Qwen3-30B-A3B's 768). Rows are independent (the site's reductions are maxima), so the results
# do not depend on the choice. A row a program runs on 8 warps, two rows on 4. On one H200
# (`python benchmarks/swiglu.py`, QUANTIZE, I = 768, twice; BENCHMARKS.md "The SwiGLU's
# programs"), against the four rows of 4 warps taken before from 1,024 rows and the 4 warps
# below: 8 rows 1.74-1.75 against 2.29 us, 512 rows 2.84-2.90 against 2.98-3.05, 2,048 rows
# 6.85-6.94 against 8.82-8.89, 4,096 rows 11.8-12.3 against 15.3-15.7, 32,768 rows 77.3-79.2
# against 93.4-95.4.
FEW_ROWS = 1024


def rows_per_program(A: int, I: int) -> int:  # noqa: E741 - the legend's name
    """Rows each program takes for ``A`` rows of ``I`` intermediate values."""
    return 1 if A < FEW_ROWS else max(1, 2048 // triton.next_power_of_2(I))


def warps_for(A: int) -> int:
    """Warps of each program for a launch of ``A`` rows (no bit depends on it)."""
    return 8 if A < FEW_ROWS else 4


@triton.jit
def _rounded(v, DTYPE: tl.constexpr):
    """FP32 ``v`` rounded to DTYPE (nearest even) and back to FP32, exactly."""
    return round_to(v, DTYPE).to(tl.float32)


@triton.jit
def _swiglu(gate, up, DTYPE: tl.constexpr):
    one = tl.full(gate.shape, 1.0, tl.float32)
    silu = _rounded(tl.math.div_rn(gate, one + exp_rn(-gate)), DTYPE)
    return _rounded(silu * up, DTYPE)


@triton.jit(do_not_specialize=["A"])
def _swiglu_kernel(
    gate_up_RK,
    out_AI,
    row_order_A,
    record_AI,
    record_block_scale_AI,
    record_global_scale_A,
    A,
    I,
    QUANTIZE: tl.constexpr,
    RECORD: tl.constexpr,
    ROW_ORDER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PERMUTE_BY: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    record_rows_A, ok_A = program_rows(A, BLOCK_R)
    rows_A = record_rows_A
    if ROW_ORDER:  # the program takes records' rows; row_order[c]: the row of gate_up and out
        rows_A = tl.load(row_order_A + record_rows_A, mask=ok_A, other=0)
    # gate_up [A, 2I] seen as [2A, I]: row 2a is a's gate, row 2a + 1 its up.
    g_even, g_odd = load_pairs(gate_up_RK, 2 * rows_A, ok_A, 0, I, BLOCK_K)
    u_even, u_odd = load_pairs(gate_up_RK, 2 * rows_A + 1, ok_A, 0, I, BLOCK_K)
    DTYPE: tl.constexpr = out_AI.dtype.element_ty
    h_even, h_odd = _swiglu(g_even, u_even, DTYPE), _swiglu(g_odd, u_odd, DTYPE)
    if QUANTIZE:
        fake_quantize_rows(
            h_even, h_odd, out_AI, rows_A, ok_A, I, record_AI, record_block_scale_AI,
            record_global_scale_A, record_rows_A, RECORD, BLOCK_K, PERMUTE_BY,
        )  # fmt: skip
    else:
        store_values(out_AI, rows_A, ok_A, 0, I, h_even, h_odd, BLOCK_K, PERMUTE_BY)


def supported(gate_up: torch.Tensor) -> bool:
    """Whether `launch` takes this ``[A, 2I]`` input (dtype and width only)."""
    if gate_up.dim() != 2 or gate_up.dtype not in DTYPES or gate_up.shape[1] % 32:
        return False
    return gate_up.shape[1] // 2 <= MAX_WIDTH


def launch(
    gate_up: torch.Tensor,
    *,
    quantize: bool = False,
    rows: int | None = None,
    num_warps: int | None = None,
    permuted_by: int | None = None,
) -> torch.Tensor:
    """``silu(gate) * up`` ``[A, I]`` of ``gate_up [A, 2I]`` (`supported` must hold), bitwise
    the eager formulation on the GPU; with ``quantize``, its per-row NVFP4 fake quantization
    (``fake_quantize(h, scaling="row")``, bitwise). ``rows`` a program and ``num_warps`` other
    than `rows_per_program`'s and `warps_for`'s are for benchmarking variants; no bit depends
    on them. With ``permuted_by`` the rows are stored permuted in K steps of that width, as
    `launch.permuted_rows` permutes them."""
    return _launch(gate_up, quantize, None, None, rows, num_warps, permuted_by)[0]


def launch_recording(
    gate_up: torch.Tensor,
    form: str,
    row_order: torch.Tensor | None = None,
    permuted_by: int | None = None,
) -> tuple[torch.Tensor, NVFP4Tensor | CompactCodes]:
    """``(h_q, record)``: `launch` with ``quantize`` and, from the same launch, the site's
    record of it in ``form`` ("full": ``quantize(h, scaling="row")``; "compact": its
    `rounding.compact`), bit for bit. ``row_order`` (int64, any shape of A elements, e.g. the
    experts' ``[T, k]``) puts record row ``c`` from row ``row_order[c]`` of h (a permutation;
    not checked, which would need a device sync), the record's leading dims then
    ``row_order.shape``; without it the record's rows are h's. ``permuted_by``: h_q's rows
    permuted as `launch`'s (the record's stay in real order)."""
    if form is None:
        raise ValueError("launch_recording needs a record form, 'full' or 'compact'; got None")
    if row_order is not None:
        check_kernel_device("row_order", row_order)
        check_contiguous("row_order", row_order)
        if row_order.dtype != torch.int64 or row_order.numel() != gate_up.shape[0]:
            raise ValueError(
                f"row_order must be int64 with one entry per row of gate_up ({gate_up.shape[0]}); "
                f"got {row_order.dtype} of shape {tuple(row_order.shape)}"
            )
    return _launch(gate_up, True, form, row_order, None, None, permuted_by)


def _launch(gate_up, quantize, form, row_order, rows, num_warps, permuted_by):
    check_kernel_device("gate_up", gate_up)
    if not supported(gate_up):
        raise ValueError(
            f"gate_up must be [A, 2I] of {DTYPES} with I a multiple of 16 up to {MAX_WIDTH}; got "
            f"{gate_up.dtype} of shape {tuple(gate_up.shape)}"
        )
    check_contiguous("gate_up", gate_up)
    A, width = gate_up.shape
    I = width // 2  # noqa: E741 - the legend's name
    step = permute_step(permuted_by, I)
    out = torch.empty((A, I), dtype=gate_up.dtype, device=gate_up.device)
    lead = (A,) if row_order is None else tuple(row_order.shape)
    rec = record_outputs(form, lead, I, gate_up.device)
    if A == 0:
        return out, rec.record
    block_k = triton.next_power_of_2(I)
    block_r = rows_per_program(A, I) if rows is None else rows
    warps = warps_for(A) if num_warps is None else num_warps
    for name, v in (("rows", block_r), ("num_warps", warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"swiglu.launch: {name} must be a power of two; got {v}")
    with device_of(gate_up):
        _swiglu_kernel[(triton.cdiv(A, block_r),)](
            pair_view(gate_up.view(2 * A, I)), out, out if row_order is None else row_order,
            *rec.pointers(), A, I, QUANTIZE=quantize,
            RECORD=rec.RECORD, ROW_ORDER=row_order is not None, BLOCK_R=block_r, BLOCK_K=block_k,
            PERMUTE_BY=step, num_warps=warps,
            # The division and the site's scale arithmetic must not fuse into FMAs.
            enable_fp_fusion=False,
            **dependent_launch.keywords(gate_up.device),
        )  # fmt: skip
    return out, rec.record
