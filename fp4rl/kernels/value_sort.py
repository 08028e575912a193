"""The sampler's sorted draw without a sort: 16-bit rows put in descending order by counting.

The sampler's definition (`fp4rl.rollout.sampler._draw_sorted`) sorts each row of logits
(descending, stable), walks the CDF of the sorted FP32 values and maps the drawn rank back to a
token id through the sort's permutation. Where the row is 16-bit (the engine's BF16 logits at
temperature 1), its values take at most 65,536 bit patterns, so the sorted row is fixed by how
many times each value occurs, and the permutation is needed at one rank a row only:

1. `_count_kernel`, grid (B, ceil(V / BLOCK)): each value adds one to its row's bin, the bins
   ordered as the values descend (`descending_bin`), with atomic adds (integer: the counts are
   exact whatever their order). A bin's count lies in a slot of its own (`_slot`) that puts
   neighbouring bins on different cache lines: a row of logits crowds into a few hundred
   bins, and adds queued on a few lines were the launch's bound;
2. `_scan_kernel`, grid (B,): each row's counts become running sums in bin order, ``ends[b,
   d]``, the number of values at or above bin d's;
3. `_expand_kernel`, grid (ceil(V / BLOCK), B): sorted position r of row b holds the value of
   the first bin whose end passes r (a binary search of the row's ends, narrowed to the bins
   of the program's stretch of ranks), written as FP32: the sort's values converted exactly,
   as ``.float()`` does;
4. after the walk, `_token_kernel`, grid (B,): the drawn rank r lies in bin d, as the
   ``j = r - ends[d - 1]``-th value of that bin; the stable sort placed them in id order, so
   the token is the row's ``j``-th id holding a value of bin d (a scan of the row, up to it).

Nothing here rounds, so the walk's float32 and float64 operations see the definition's values
and the token is the stable sort's at that rank. The sorts (the CPU's and CUB's radix sort on
the GPU alike) compare -0.0 and +0.0 as equal, keeping their ids in order, so both zeros share
a bin, which the sorted row holds as +0.0: the one bit where it may differ from the sort's
values, and one no result of the draw depends on (a zero's logprob, exponential and CDF are the
same either way). A NaN sorts with the largest (sign bit clear) or after -inf (sign set); the
engine refuses NaN logits after the draw, and every index stays in range for them.

Also `walk_exponentials`: the walk's ``x.double().exp()`` of each row in one pass (torch's bits
on the GPU) with its count of entries above -inf, which the walk takes as well.

Cost at V = 151,936: per row, 65,536 int32 bins (256 KB, zeroed, counted, scanned) besides one
read of the row for the counts, one write of the FP32 row and part of a read for the token.
Launches depend on shapes alone, nothing is read back. `python benchmarks/sampler.py` times
the sampler with and without these kernels (BENCHMARKS.md, "The sorted draw by counting").

Legend: B rows, V vocab, N bins (65,536).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.kernels.launch import check_contiguous, check_device, check_kernel_device, device_of
from fp4rl.kernels.token_draw import exp64

NUM_BINS = 1 << 16
DTYPES = (torch.bfloat16, torch.float16)
# Values a program of the count and expand launches takes.
BLOCK = 1024
# Values a step of the token scan takes: a row is one program's, so a few long steps rather than
# many short ones (2,048 a step took 0.12 ms at 256 rows on one H200).
SCAN_BLOCK = 8192
# Bins a step of the running sums takes, over 32.
SCAN_TILE = 128
# Values a program of the exponentials takes.
EXP_BLOCK = 2048


@triton.jit
def descending_bin(bits):
    """Bin of a 16-bit float's pattern (int32 in [0, 65535]), ascending as the value descends:
    positive patterns count down from the largest, negative ones (sign bit set) count up from
    -0.0, which already grow as the value falls; -0.0 (0x8000) shares +0.0's bin, which leaves
    bin 0x8000 empty. `bin_value` undoes it."""
    return tl.where(bits > 0x8000, bits, (bits & 0x7FFF) ^ 0x7FFF)


@triton.jit
def bin_value(bins):
    """The pattern a bin holds (+0.0 for the zeros' bin)."""
    return tl.where(bins >= 0x8000, bins, bins ^ 0x7FFF)


@triton.jit
def _slot(bins):
    """Where a bin's count lies in its row: bin ``32 * h + l`` at ``2048 * l + h``, so that
    neighbouring bins (a row of logits crowds into a few hundred) fall on different cache
    lines and their atomic adds spread over the L2 instead of queueing on a few lines."""
    return ((bins & 31) << 11) | (bins >> 5)


@triton.jit
def _patterns(rows_BV, row, cols, V):
    """The 16-bit patterns (int32 in [0, 65535]) of ``rows[row, cols]``, zero past V."""
    values = tl.load(rows_BV + row * V + cols, mask=cols < V, other=0.0)
    return values.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _count_kernel(rows_BV, counts_BN, V, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    bins = descending_bin(_patterns(rows_BV, row, cols, V))
    tl.atomic_add(counts_BN + row * N + _slot(bins), 1, mask=cols < V, sem="relaxed")


@triton.jit
def _scan_kernel(counts_BN, N: tl.constexpr, TILE: tl.constexpr):
    """Each row's counts replaced by their running sums in bin order (in place, in their
    slots), one program a row, ``32 * TILE`` bins a step: a [32, TILE] tile of slots holds
    bins ``32 * h + l`` for TILE consecutive h, and its transpose lists them in order."""
    row = tl.program_id(0).to(tl.int64)
    low = tl.arange(0, 32)[:, None]
    total = tl.zeros([], dtype=tl.int32)
    for h0 in tl.range(0, N // 32, TILE):
        ptrs = counts_BN + row * N + low * (N // 32) + h0 + tl.arange(0, TILE)[None, :]
        counts = tl.reshape(tl.trans(tl.load(ptrs)), [32 * TILE])  # in bin order
        ends = total + tl.cumsum(counts, axis=0)
        tl.store(ptrs, tl.trans(tl.reshape(ends, [TILE, 32])))
        total += tl.sum(counts, axis=0)


@triton.jit
def _bin_at(ends_BN, row, rank, N: tl.constexpr, LOG_N: tl.constexpr):
    """The first bin whose end passes ``rank`` (a scalar): a binary search of the row's
    nondecreasing ends, one load a halving (bins below the answer are those whose end is at or
    before the rank)."""
    at = tl.zeros_like(rank)
    for i in tl.static_range(LOG_N):
        end = tl.load(ends_BN + row * N + _slot(at + ((N >> 1) >> i) - 1))
        at = tl.where(end <= rank, at + ((N >> 1) >> i), at)
    return at


@triton.jit
def _bins_at(ends_BN, row, rank, first, last, N: tl.constexpr):
    """`_bin_at` for ranks (a vector) whose bins are known to lie in ``[first, last]``: as
    many halvings as that range needs (a few in the crowded middle of a row)."""
    at = tl.zeros_like(rank) + first
    step = tl.full([], 1, tl.int32)
    while step <= last - first:
        step *= 2
    while step > 1:
        step //= 2
        probe = at + step - 1
        end = tl.load(ends_BN + row * N + _slot(probe), mask=probe < last, other=0x7FFFFFFF)
        at = tl.where(end <= rank, at + step, at)
    return at


@triton.jit
def _expand_kernel(
    rows_BV, ends_BN, sorted_BV, V, N: tl.constexpr, LOG_N: tl.constexpr, BLOCK: tl.constexpr
):
    first_rank = tl.program_id(0) * BLOCK
    row = tl.program_id(1).to(tl.int64)
    rank = first_rank + tl.arange(0, BLOCK)
    first = _bin_at(ends_BN, row, first_rank, N, LOG_N)
    last = _bin_at(ends_BN, row, tl.minimum(first_rank + BLOCK, V) - 1, N, LOG_N)
    bits = bin_value(_bins_at(ends_BN, row, rank, first, last, N))
    value = bits.to(tl.int16).to(rows_BV.dtype.element_ty, bitcast=True)
    tl.store(sorted_BV + row * V + rank, value.to(tl.float32), mask=rank < V)


@triton.jit
def _token_kernel(
    rows_BV, ends_BN, rank_B, token_B, V, N: tl.constexpr, LOG_N: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    rank = tl.load(rank_B + row).to(tl.int32)
    d = _bin_at(ends_BN, row, rank, N, LOG_N)
    before = tl.load(ends_BN + row * N + _slot(d - 1), mask=d > 0, other=0)  # values above d
    nth = rank - before + 1  # the drawn bin's nth value in id order, from 1
    cols = tl.arange(0, BLOCK)
    seen = tl.zeros([], dtype=tl.int32)
    token = tl.zeros([], dtype=tl.int32) + V
    start = tl.zeros([], dtype=tl.int32)
    while (token == V) & (start < V):  # up to the block that holds it
        same = (descending_bin(_patterns(rows_BV, row, start + cols, V)) == d) & (start + cols < V)
        count = seen + tl.cumsum(same.to(tl.int32), axis=0)
        token = tl.min(tl.where(same & (count == nth), start + cols, V), axis=0)
        seen += tl.sum(same.to(tl.int32), axis=0)
        start += BLOCK
    # Always found (the rank's bin holds nth values); V - 1 only guards an index.
    tl.store(token_B + row, tl.minimum(token, V - 1).to(tl.int64))


@triton.jit
def _exp_kernel(x_BV, y_BV, live_B, V, BLOCK: tl.constexpr):
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_BV + row * V + cols, mask=cols < V, other=float("-inf"))
    tl.store(y_BV + row * V + cols, exp64(x.to(tl.float64)), mask=cols < V)
    tl.atomic_add(live_B + row, tl.sum((x > float("-inf")).to(tl.int64), axis=0), sem="relaxed")


def walk_exponentials(x_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_BV.double().exp(), (x_BV > -inf).sum(-1))`` for float32 rows ``[B, V]``
    (contiguous) in one pass instead of four, with the bits of torch's float64 ``exp`` on the
    GPU (`token_draw.exp64`: the same CUDA function); under the interpreter numpy's."""
    check_kernel_device("x_BV", x_BV)
    if x_BV.dtype != torch.float32 or x_BV.dim() != 2:
        raise ValueError(
            f"x_BV must be float32 [B, V]; got {x_BV.dtype} of shape {tuple(x_BV.shape)}"
        )
    check_contiguous("x_BV", x_BV)
    B, V = x_BV.shape
    y_BV = torch.empty(B, V, dtype=torch.float64, device=x_BV.device)
    live_B = torch.zeros(B, dtype=torch.int64, device=x_BV.device)
    if x_BV.numel():
        with device_of(x_BV):
            _exp_kernel[(triton.cdiv(V, EXP_BLOCK), B)](
                x_BV, y_BV, live_B, V, BLOCK=EXP_BLOCK, num_warps=8
            )
    return y_BV, live_B


def _check_rows(rows_BV: torch.Tensor) -> None:
    check_kernel_device("rows_BV", rows_BV)
    if rows_BV.dtype not in DTYPES or rows_BV.dim() != 2 or rows_BV.shape[1] < 1:
        raise ValueError(
            f"rows_BV must be bfloat16 or float16 [B, V] with V >= 1; got {rows_BV.dtype} of "
            f"shape {tuple(rows_BV.shape)}"
        )
    check_contiguous("rows_BV", rows_BV)


def sort_values(rows_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted [B, V] float32, ends [B, N] int32)``: each row's values in descending order,
    as FP32 (``torch.sort(rows_BV, descending=True)[0].float()`` bit for bit but that both
    zeros are +0.0), and the bins' running counts that `token_at_rank` maps a rank back with."""
    _check_rows(rows_BV)
    B, V = rows_BV.shape
    device = rows_BV.device
    ends_BN = torch.zeros(B, NUM_BINS, dtype=torch.int32, device=device)
    sorted_BV = torch.empty(B, V, dtype=torch.float32, device=device)
    if B == 0:
        return sorted_BV, ends_BN
    with device_of(rows_BV):
        _count_kernel[(B, triton.cdiv(V, BLOCK))](
            rows_BV, ends_BN, V, N=NUM_BINS, BLOCK=BLOCK, num_warps=4
        )
        _scan_kernel[(B,)](ends_BN, N=NUM_BINS, TILE=SCAN_TILE, num_warps=4)
        _expand_kernel[(triton.cdiv(V, BLOCK), B)](
            rows_BV, ends_BN, sorted_BV, V, N=NUM_BINS, LOG_N=16, BLOCK=BLOCK,
            num_warps=4,
        )  # fmt: skip
    return sorted_BV, ends_BN


def token_at_rank(
    rows_BV: torch.Tensor, ends_BN: torch.Tensor, rank_B: torch.Tensor
) -> torch.Tensor:
    """int64 ``[B]``: the id the stable descending sort of each row puts at ``rank_B`` (int64
    ``[B]``, in ``[0, V)``), from `sort_values`' ``ends``; one scan of each row."""
    _check_rows(rows_BV)
    B, V = rows_BV.shape
    if ends_BN.shape != (B, NUM_BINS) or ends_BN.dtype != torch.int32:
        raise ValueError(
            f"ends_BN must be int32 [{B}, {NUM_BINS}]; got {ends_BN.dtype} of shape "
            f"{tuple(ends_BN.shape)}"
        )
    if rank_B.shape != (B,) or rank_B.dtype != torch.int64:
        raise ValueError(
            f"rank_B must be int64 [{B}]; got {rank_B.dtype} of shape {tuple(rank_B.shape)}"
        )
    for name, t in (("ends_BN", ends_BN), ("rank_B", rank_B)):
        check_device(name, t, rows_BV.device)
        check_contiguous(name, t)
    token_B = torch.empty(B, dtype=torch.int64, device=rows_BV.device)
    if B:
        with device_of(rows_BV):
            _token_kernel[(B,)](
                rows_BV, ends_BN, rank_B, token_B, V, N=NUM_BINS, LOG_N=16, BLOCK=SCAN_BLOCK,
                num_warps=4,
            )  # fmt: skip
    return token_B
