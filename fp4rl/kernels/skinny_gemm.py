"""Decode-size projections ``y_i = x @ W_i.T`` of one input by up to three weights, one launch.

A decode step multiplies a few rows (M = 1 .. 64, the batch) by each attention projection: at
batch 1 that is a read of the weights and nothing else, and cuBLAS takes one launch per weight
(q, k and v of one input: three, each mostly latency at k/v's size). Here one launch covers the
output columns of all the weights of one input, read where they lie (the parameters stay
separate tensors: no concatenated copy).

Work: program (p, r, s) computes rows ``[r * BLOCK_M, (r + 1) * BLOCK_M)`` of the output columns
``[j * BLOCK_N, (j + 1) * BLOCK_N)`` of one weight over slice s of K: p numbers the column blocks
of W_0, then W_1, then W_2, and the cumulative block counts (host ints, shapes only) tell the
program which weight and which j it has. A few rows leave too few column blocks to keep an
H200's 132 SMs reading (q/k/v of Qwen3-30B-A3B: 160 blocks of 32 columns, o: 64), so K is cut
into slices of SLICE_K (`SkinnyTile.slice_k`, 512; the last slice may be shorter), one per
program: q/k/v (K = 2048) takes 4 slices, 640 programs, and o (K = 4096) 8 slices, 512
programs, each reading 32 KB of weights. A K of at most one slice is not split: its programs
read all of K. Within its slice a program reads BLOCK_K steps, software-pipelined
(``tl.range(num_stages=...)``); rows past M are masked (they cost no memory traffic).

The slices of one output tile (its column block and row block) are added without a second
launch. Each program stores its FP32 partial sum in a workspace (one ``BLOCK_M x BLOCK_N`` tile
per program, rows past M not stored), then, after a barrier of its threads, counts its arrival
on the output tile's counter with one acquire-release atomic add: the release publishes the
partial, the acquire lets the program that arrives last see every other partial. That program
loads the partials, adds them, stores the output and sets the counter back to 0, so every
counter is 0 between launches and the launch can be replayed (a CUDA graph) with no memset.
Which program adds is decided by arrival; in what order it adds is not (below), so the results
are deterministic.

Buffers: the workspace is a `torch.empty` of each launch (under CUDA-graph capture it comes from
the graph's pool, which keeps it for the replays). The counters are int32 zeros allocated once
per device and grown when a launch needs more (the old buffers are kept: a graph captured with
one still uses it); the first launch of a shape should come before a capture, or the zeroing of
a new buffer is recorded in the graph too (a memset replayed with it: harmless, not free). All
launches on a device share the counters, so launches there must not overlap in time: one stream,
or streams ordered by events, as a decode step's launches are.

The launch is dependent (`fp4rl.kernels.dependent_launch`): it may be scheduled while the kernel
before it ends, and every program first waits for that kernel (`wait_for_prior`) before any
load, store or atomic. The launch depends on shapes only, so it can be captured in a CUDA graph.

Numerics: ``y[m, n] = dtype(sum_k f32(x[m, k]) * f32(W[n, k]))`` for BF16 (or FP16) x and W:
the products are exact in FP32, accumulated in FP32 on the tensor cores, and the sum is rounded
once to x's dtype. The order of the sum: within a slice, BLOCK_K-wide steps added into one FP32
accumulator that starts at 0, each step one dot whose 16-wide k-groups the MMA instruction adds
in order; then the slices' sums ``p_0, p_1, ...`` added in slice order, ``((p_0 + p_1) + p_2) +
...``, one FP32 addition each (the workspace holds FP32 values: stored and loaded exactly). With
one slice the sum is the steps over all of K, as before the split existed. That order is the
same for every M:

- BLOCK_K and SLICE_K are functions of K alone (`block_k_for`, `slices_for`; every tile of
  `CONFIGS` shares ``block_k`` and ``slice_k``), so no tile chosen for another M, and no order of
  arrival, changes the slices or the steps;
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

from fp4rl.kernels import dependent_launch
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import check_kernel_device, device_of
from fp4rl.kernels.numerics import dot, round_to

DTYPES = (torch.bfloat16, torch.float16)
MAX_ROWS = 64  # decode batches; larger M is cuBLAS's
# One weight (o) gains no launches over cuBLAS: sent here up to 16 rows only, where it measured
# as fast (one H200, `python benchmarks/skinny_gemm.py`: 8.7-9.0 us against 8.9-9.2 at 1-16
# rows, 13.6 against 10.1 at 64). See `preferred`.
MAX_ROWS_ONE_WEIGHT = 16
MAX_WEIGHTS = 3  # q, k and v of one input
BLOCK_K = 256  # the reduction step of every tile (`block_k_for` narrows it for small K)
SLICE_K = 512  # the reduction of one program (`slices_for`): a larger K is split
# The least counter buffer (16 KiB): one counter per output tile, and q/k/v of Qwen3-30B-A3B
# has at most 1280 (16 columns, 4 row blocks of 16).
MIN_COUNTERS = 4096


@triton.jit
def _sum_steps(
    x_MK, w_NK, rows_M, row_ok_M, cols_N, col_ok_N, K, k_begin, k_end,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """``W[cols, k_begin:k_end] @ x[rows, k_begin:k_end].T`` in FP32 (``[BLOCK_N, BLOCK_M]``),
    in BLOCK_K steps from ``k_begin`` (both ends multiples of BLOCK_K)."""
    k_K = k_begin + tl.arange(0, BLOCK_K)
    x_ptrs = x_MK + rows_M[:, None] * K + k_K[None, :]
    w_ptrs = w_NK + cols_N.to(tl.int64)[:, None] * K + k_K[None, :]
    # The weight tile is the dot's first operand (16 or 32 rows: `mma.sync` for every tile),
    # the few rows of x its second: y.T = W @ x.T.
    acc_NM = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        x = tl.load(x_ptrs, mask=row_ok_M[:, None], other=0.0)
        # Each weight is read once per step: keep it from displacing what the step reuses.
        w = tl.load(w_ptrs, mask=col_ok_N[:, None], other=0.0, eviction_policy="evict_first")
        acc_NM = dot(w, tl.trans(x), acc_NM)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc_NM


@triton.jit
def _add_slices(
    acc_NM, partial, counter, tile, s, row_ok_M, y_ptrs, y_ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLICES: tl.constexpr,
):  # fmt: skip
    """Store slice s's partial sum ``acc_NM`` of output tile ``tile`` in the workspace and count
    it on the tile's counter; the last of the tile's SLICES programs to arrive adds the partials
    in slice order, stores the output and resets the counter to 0."""
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    # [BLOCK_M, BLOCK_N] row-major per program: a row's columns are contiguous.
    offsets_NM = tl.arange(0, BLOCK_M)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    slices = partial + tile.to(tl.int64) * (SLICES * TILE) + offsets_NM
    tl.store(slices + s * TILE, acc_NM, mask=row_ok_M[None, :])
    # Every thread's stores come before the one thread's atomic, whose release publishes them.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == SLICES - 1:
        # Past the acquire: the other programs' partials are visible (in L2: ".cg" skips L1).
        # The loads are unrolled so that they are all in flight before the first addition.
        total_NM = tl.load(slices, mask=row_ok_M[None, :], other=0.0, cache_modifier=".cg")
        for t in tl.static_range(1, SLICES):
            total_NM += tl.load(
                slices + t * TILE, mask=row_ok_M[None, :], other=0.0, cache_modifier=".cg"
            )
        tl.store(y_ptrs, round_to(total_NM, y_ptrs.dtype.element_ty), mask=y_ok)
        # Nothing else touches the counter in this launch: 0 for the next one.
        tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def _project_block(
    x_MK, w_NK, y_MN, partial, counters, M, N, K, block, tile,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SLICE_K: tl.constexpr, SLICES: tl.constexpr, NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """Rows of program_id(1) times column block ``block`` of one weight over slice
    program_id(2) of K, stored in y (by the tile's last slice when K is split)."""
    rows_M = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok_M = rows_M < M
    cols_N = block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok_N = cols_N < N
    y_ptrs = y_MN + rows_M[None, :] * N + cols_N[:, None]
    y_ok = row_ok_M[None, :] & col_ok_N[:, None]
    if SLICES == 1:
        acc_NM = _sum_steps(x_MK, w_NK, rows_M, row_ok_M, cols_N, col_ok_N, K, 0, K,
                            BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)  # fmt: skip
        tl.store(y_ptrs, round_to(acc_NM, y_MN.dtype.element_ty), mask=y_ok)
    else:
        s = tl.program_id(2)
        k_begin = s * SLICE_K
        k_end = tl.minimum(k_begin + SLICE_K, K)
        acc_NM = _sum_steps(x_MK, w_NK, rows_M, row_ok_M, cols_N, col_ok_N, K, k_begin, k_end,
                            BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)  # fmt: skip
        _add_slices(acc_NM, partial, counters + tile, tile, s, row_ok_M, y_ptrs, y_ok,
                    BLOCK_M, BLOCK_N, SLICES)  # fmt: skip


# M changes with every batch: one compiled kernel per tile, not per M. The N_i are not
# specialized either: an N of 1 would become a constant, of another type than the N it replaces.
@triton.jit(do_not_specialize=["M", "N0", "N1", "N2"])
def _skinny_gemm_kernel(
    x_MK, w0_NK, w1_NK, w2_NK, y0_MN, y1_MN, y2_MN, partial, counters,
    M, K, N0, N1, N2, end0, end1,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SLICE_K: tl.constexpr, SLICES: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    # Column blocks [0, end0) are W_0's, [end0, end1) W_1's, the rest W_2's (a weight a launch
    # does not have has none). The weight is picked before the one loop: a loop per weight
    # would take its own shared memory.
    p = tl.program_id(0)
    w_NK, y_MN, N, block = w0_NK, y0_MN, N0, p
    if p >= end0:
        w_NK, y_MN, N, block = w1_NK, y1_MN, N1, p - end0
    if p >= end1:
        w_NK, y_MN, N, block = w2_NK, y2_MN, N2, p - end1
    # The output tile (column block, row block): its counter and its slices' partials.
    tile = p * tl.num_programs(1) + tl.program_id(1)
    _project_block(x_MK, w_NK, y_MN, partial, counters, M, N, K, block, tile,
                   BLOCK_M, BLOCK_N, BLOCK_K, SLICE_K, SLICES, NUM_STAGES)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SkinnyTile:
    """One program: ``block_m`` rows (a power of two >= 16, the tensor cores' least) times
    ``block_n`` output columns (16 or 32: see the module docstring), ``block_k`` of the
    reduction per step (a power of two >= 16), ``num_stages`` steps of loads in flight, at most
    ``slice_k`` of the reduction (a power of two >= ``block_k``; 0: all of K, never split).
    ``block_k`` and ``slice_k`` fix the order of the sum, so every tile of `CONFIGS` has the
    same."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_k: int = BLOCK_K
    slice_k: int = SLICE_K

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
        s = self.slice_k
        if s and (s < self.block_k or s & (s - 1)):
            raise ValueError(
                f"SkinnyTile.slice_k must be 0 or a power of two >= block_k={self.block_k}; got {s}"
            )


# (most rows, tile): the first bucket that holds M is used. Timed on one H200 at Qwen3-30B-A3B's
# attention shapes (q/k/v 4096/512/512 x 2048, o 2048 x 4096) with `python
# benchmarks/skinny_gemm.py` (BENCHMARKS.md, "Decode glue") before K was split: q/k/v in one
# launch took 9.9 us at 1-16 rows with 32 columns per program (11.0 with 16), against 18.8-19.4
# us for cuBLAS's three calls, and o 9.9 us at 1 row against cuBLAS's 8.8 (split-K and its
# reduce), with 160 and 64 programs; slices of SLICE_K give them 640 and 512. Any tile here may
# change speed only, never a bit.
CONFIGS: tuple[tuple[int, SkinnyTile], ...] = (
    # Up to 16 rows the read of W is the work: 32 columns per program, two 256-wide steps per
    # slice, both in flight (q/k/v 640 programs, o 512).
    (16, SkinnyTile(block_m=16, block_n=32, num_warps=4, num_stages=2)),
    # More rows: x (from L2) is read by fewer programs per row.
    (32, SkinnyTile(block_m=32, block_n=32, num_warps=4, num_stages=2)),
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


def slices_for(k: int, slice_k: int = SLICE_K) -> int:
    """The slices K is cut into (``ceil(K / slice_k)``, each a program's; 1 for ``slice_k``
    0 or a K of at most one slice). A whole number of steps each: ``slice_k`` is a power of two
    no smaller than the tile's ``block_k``, so a multiple of `block_k_for`'s step."""
    return -(-k // slice_k) if slice_k else 1


# Per device: the counter buffers, the last the largest (see the module docstring).
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def counters(device: torch.device, count: int = 0) -> torch.Tensor:
    """The device's int32 counters, at least ``count`` (0 between launches)."""
    held = _COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < count:
        size = max(count, MIN_COUNTERS, 2 * held[-1].numel() if held else 0)
        held.append(torch.zeros(size, dtype=torch.int32, device=device))
    return held[-1]


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


def preferred(num_rows: int, num_weights: int) -> bool:
    """Whether a decode step's projection of ``num_rows`` rows by ``num_weights`` weights should
    take this kernel rather than cuBLAS: up to `MAX_ROWS` for two or three weights (one launch
    instead of one per weight), up to `MAX_ROWS_ONE_WEIGHT` for one."""
    return num_rows <= (MAX_ROWS if num_weights > 1 else MAX_ROWS_ONE_WEIGHT)


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
    variants (a ``block_k`` or ``slice_k`` other than `BLOCK_K`'s or `SLICE_K`'s changes the
    order of the sum where K is longer than the step or the slice)."""
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
    row_blocks = -(-M // tile.block_m)
    slices = slices_for(K, tile.slice_k)
    # One counter per output tile; the partials of every program (a stand-in when not split).
    tiles = total * row_blocks
    count = counters(x_MK.device, tiles)
    partial = outs[0]
    if slices > 1:
        size = tiles * slices * tile.block_m * tile.block_n
        partial = torch.empty(size, dtype=torch.float32, device=x_MK.device)
    with device_of(x_MK):
        _skinny_gemm_kernel[(total, row_blocks, slices)](
            x_MK, *w_NK, *y_MN, partial, count, M, K, *N, ends[0], ends[1],
            BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k_for(K, tile.block_k),
            SLICE_K=tile.slice_k, SLICES=slices, NUM_STAGES=tile.num_stages,
            num_warps=tile.num_warps,
            # Nothing outside the dot multiplies; fixed off as in every kernel here.
            enable_fp_fusion=False,
            **dependent_launch.keywords(x_MK.device),
        )  # fmt: skip
    return outs
