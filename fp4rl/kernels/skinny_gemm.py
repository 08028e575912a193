"""Decode-size projections ``y_i = x @ W_i.T`` of one input by up to three weights, one launch.

A decode step multiplies a few rows (M = 1 .. 64, the batch) by each attention projection: at
batch 1 that is a read of the weights and nothing else, and cuBLAS takes one launch per weight
(q, k and v of one input: three, each mostly latency at k/v's size). Here one launch covers the
output columns of all the weights of one input, read where they lie (the parameters stay
separate tensors: no concatenated copy).

Work: program (p, r) computes rows ``[r * BLOCK_M, (r + 1) * BLOCK_M)`` of the output columns
``[j * BLOCK_N, (j + 1) * BLOCK_N)`` of one weight: p numbers the column blocks of W_0, then
W_1, then W_2, and the cumulative block counts (host ints, shapes only) tell the program which
weight and which j it has. Each program reads all of K in BLOCK_K steps, software-pipelined
(``tl.range(num_stages=...)``), with no split-K; rows past M are masked (they cost no memory
traffic). The launch depends on shapes only, so it can be captured in a CUDA graph.

Numerics: ``y[m, n] = dtype(sum_k f32(x[m, k]) * f32(W[n, k]))`` for BF16 (or FP16) x and W:
the products are exact in FP32, accumulated in FP32 on the tensor cores, and the sum is rounded
once to x's dtype. The order of the sum: BLOCK_K-wide steps k = 0, BLOCK_K, 2 * BLOCK_K, ...
added into one FP32 accumulator, each step one dot whose 16-wide k-groups the MMA instruction
adds in order. That order is the same for every M:

- BLOCK_K is a function of K alone (`block_k_for`; every tile of `CONFIGS` shares it) and
  nothing is split over K, so no tile chosen for another M changes it;
- BLOCK_N is at most 32, so the dot of every tile lowers to the same instruction (``mma.sync``;
  Triton uses Hopper's ``wgmma`` only for dots of 64-row multiples), and an output element is
  computed from its own row of x and of W alone.

So a row's output bits depend on the row, the weights and K, never on M or on the other rows
(batch-invariant; tests/kernels/test_kernel_skinny_gemm.py checks it bitwise). Not bitwise
cuBLAS (``torch.nn.functional.linear``), whose order and split-K are its own: both are FP32
sums rounded once, so an output differs from the other's by the two sums' rounding errors
(the test states the bound), usually not at all.

This module does not own when the kernel runs (`fp4rl.ops.project`, None where it does not),
the model's projections (`fp4rl.model.attention`), biases, or rows beyond `MAX_ROWS` (cuBLAS).

Legend: M rows, K reduction, N output columns of one weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4rl.kernels.launch import check_kernel_device, device_of
from fp4rl.kernels.numerics import dot, round_to

DTYPES = (torch.bfloat16, torch.float16)
MAX_ROWS = 64  # decode batches; larger M is cuBLAS's
MAX_WEIGHTS = 3  # q, k and v of one input
BLOCK_K = 256  # the reduction step of every tile (`block_k_for` narrows it for small K)


@triton.jit
def _project_block(
    x_MK, w_NK, y_MN, M, N, K, block,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """Rows of program_id(1) times column block ``block`` of one weight, stored in y."""
    rows_M = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok_M = rows_M < M
    cols_N = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok_N = cols_N < N
    k_K = tl.arange(0, BLOCK_K)
    x_ptrs = x_MK + rows_M[:, None] * K + k_K[None, :]
    w_ptrs = w_NK + cols_N.to(tl.int64)[:, None] * K + k_K[None, :]
    # The weight tile is the dot's first operand (16 or 32 rows: `mma.sync` for every tile),
    # the few rows of x its second: y.T = W @ x.T.
    acc_NM = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):  # K % BLOCK_K == 0
        x = tl.load(x_ptrs, mask=row_ok_M[:, None], other=0.0)
        # Each weight is read once per step: keep it from displacing what the step reuses.
        w = tl.load(w_ptrs, mask=col_ok_N[:, None], other=0.0, eviction_policy="evict_first")
        acc_NM = dot(w, tl.trans(x), acc_NM)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_MN + rows_M[None, :] * N + cols_N[:, None]
    out = round_to(acc_NM, y_MN.dtype.element_ty)
    tl.store(y_ptrs, out, mask=row_ok_M[None, :] & col_ok_N[:, None])


# M changes with every batch: one compiled kernel per tile, not per M. The N_i are not
# specialized either: an N of 1 would become a constant, of another type than the N it replaces.
@triton.jit(do_not_specialize=["M", "N0", "N1", "N2"])
def _skinny_gemm_kernel(
    x_MK, w0_NK, w1_NK, w2_NK, y0_MN, y1_MN, y2_MN, M, K, N0, N1, N2, end0, end1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    # Column blocks [0, end0) are W_0's, [end0, end1) W_1's, the rest W_2's (a weight a launch
    # does not have has none). The weight is picked before the one loop: a loop per weight
    # would take its own shared memory.
    p = tl.program_id(0)
    w_NK, y_MN, N, block = w0_NK, y0_MN, N0, p
    if p >= end0:
        w_NK, y_MN, N, block = w1_NK, y1_MN, N1, p - end0
    if p >= end1:
        w_NK, y_MN, N, block = w2_NK, y2_MN, N2, p - end1
    _project_block(x_MK, w_NK, y_MN, M, N, K, block,
                   BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SkinnyTile:
    """One program: ``block_m`` rows (a power of two >= 16, the tensor cores' least) times
    ``block_n`` output columns (16 or 32: see the module docstring), ``block_k`` of the
    reduction per step (a power of two >= 16; it fixes the order of the sum, so every tile of
    `CONFIGS` has the same), ``num_stages`` steps of loads in flight."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_k: int = BLOCK_K

    def __post_init__(self) -> None:
        for name in ("block_m", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"SkinnyTile.{name} must be a power of two >= 16; got {v}")
        if self.block_n not in (16, 32):
            raise ValueError(f"SkinnyTile.block_n must be 16 or 32; got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"SkinnyTile.num_warps must be 1, 2, 4 or 8; got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"SkinnyTile.num_stages must be >= 1; got {self.num_stages}")


# (most rows, tile): the first bucket that holds M is used. Chosen on one H200 at Qwen3-30B-A3B's
# attention shapes (q/k/v 4096/512/512 x 2048, o 2048 x 4096) with `python
# benchmarks/skinny_gemm.py` (BENCHMARKS.md, "Decode glue"): q/k/v in one launch took 9.9 us at
# 1-16 rows with 32 columns per program (11.0 with 16), against 18.8-19.4 us for cuBLAS's three
# calls. Any tile here may change speed only, never a bit.
CONFIGS: tuple[tuple[int, SkinnyTile], ...] = (
    # Up to 16 rows the read of W is the work: 32 columns per program (q/k/v 160 programs).
    (16, SkinnyTile(block_m=16, block_n=32, num_warps=4, num_stages=4)),
    # More rows: x (from L2) is read by fewer programs per row.
    (32, SkinnyTile(block_m=32, block_n=32, num_warps=4, num_stages=3)),
    (MAX_ROWS, SkinnyTile(block_m=64, block_n=32, num_warps=4, num_stages=2)),
)


def tile_for(num_rows: int) -> SkinnyTile:
    """The tile for M rows (M <= MAX_ROWS)."""
    return next(tile for bound, tile in CONFIGS if num_rows <= bound)


def block_k_for(k: int, block_k: int = BLOCK_K) -> int:
    """The reduction step for K (a multiple of 16): ``block_k`` halved until it divides K."""
    while k % block_k:
        block_k //= 2
    return block_k


def _problem(x_MK: torch.Tensor, weights: Sequence[torch.Tensor]) -> str | None:
    """What `launch` cannot take about these inputs, in words naming the values; None if
    nothing (the device kind aside, which `launch` checks apart)."""
    if x_MK.dtype not in DTYPES or x_MK.dim() != 2:
        return (
            f"x_MK must be a 2-D tensor of {DTYPES}; got {x_MK.dtype} of shape {tuple(x_MK.shape)}"
        )
    M, K = x_MK.shape
    if M > MAX_ROWS:
        return f"x_MK has M={M} rows; the kernel takes at most MAX_ROWS={MAX_ROWS}"
    if K < 16 or K % 16:
        return f"x_MK's K={K} must be a positive multiple of 16"
    if not x_MK.is_contiguous():
        return f"x_MK must be contiguous; got strides {tuple(x_MK.stride())}"
    if not isinstance(weights, list | tuple) or not 1 <= len(weights) <= MAX_WEIGHTS:
        count = len(weights) if isinstance(weights, list | tuple) else type(weights).__name__
        return f"weights must be a list or tuple of 1 to {MAX_WEIGHTS} tensors; got {count}"
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor):
            return f"weights[{i}] must be a tensor; got {type(w).__name__}"
        if w.device != x_MK.device:
            return f"weights[{i}] must be on {x_MK.device} like x_MK; got {w.device}"
        if w.dtype != x_MK.dtype:
            return f"weights[{i}] must have x_MK's dtype {x_MK.dtype}; got {w.dtype}"
        if w.dim() != 2 or w.shape[1] != K or w.shape[0] < 1:
            return (
                f"weights[{i}] must be [N, {K}] with N >= 1 for x_MK of shape "
                f"{tuple(x_MK.shape)}; got shape {tuple(w.shape)}"
            )
        if not w.is_contiguous():
            return f"weights[{i}] must be contiguous; got strides {tuple(w.stride())}"
    return None


def supported(x_MK: torch.Tensor, weights: Sequence[torch.Tensor]) -> bool:
    """Whether `launch` takes these inputs (dtypes, shapes, layout and devices alike): x
    ``[M, K]`` of `DTYPES` with M <= MAX_ROWS and K a multiple of 16, 1 to 3 weights
    ``[N_i, K]`` of x's dtype on x's device, all contiguous."""
    return _problem(x_MK, weights) is None


def launch(
    x_MK: torch.Tensor, weights: Sequence[torch.Tensor], tile: SkinnyTile | None = None
) -> list[torch.Tensor]:
    """``[x_MK @ w.T for w in weights]`` (``[M, N_i]`` in x's dtype each) in one launch, with
    the numerics of the module docstring. ``tile`` other than `tile_for`'s is for benchmarking
    variants (a ``block_k`` other than `BLOCK_K` changes the order of the sum)."""
    check_kernel_device("x_MK", x_MK)
    failure = _problem(x_MK, weights)
    if failure is not None:
        raise ValueError(failure)
    M, K = x_MK.shape
    outs = [torch.empty((M, w.shape[0]), dtype=x_MK.dtype, device=x_MK.device) for w in weights]
    if M == 0:
        return outs
    tile = tile or tile_for(M)
    # Stand-ins for the weights a launch of fewer than three does not have: no column blocks,
    # so never read.
    missing = MAX_WEIGHTS - len(weights)
    w_NK, y_MN = list(weights) + [weights[0]] * missing, outs + [outs[0]] * missing
    N = [w.shape[0] for w in weights] + [0] * missing
    ends, total = [], 0
    for n in N:  # plain ints: triton.cdiv costs microseconds from Python
        total += -(-n // tile.block_n)
        ends.append(total)
    grid = (total, -(-M // tile.block_m))
    with device_of(x_MK):
        _skinny_gemm_kernel[grid](
            x_MK, *w_NK, *y_MN, M, K, *N, ends[0], ends[1],
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
            BLOCK_K=block_k_for(K, tile.block_k), NUM_STAGES=tile.num_stages,
            num_warps=tile.num_warps,
            # Nothing outside the dot multiplies; fixed off as in every kernel here.
            enable_fp_fusion=False,
        )  # fmt: skip
    return outs
