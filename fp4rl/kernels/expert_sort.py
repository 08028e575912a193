"""The MoE dispatch's sort of assignments by expert as a counting sort in one launch.

`fp4rl.model.experts.sort_by_expert` orders the A = T*k token-expert assignments by expert id,
ties in flat order: the permutation ``torch.argsort(ids, stable=True)`` gives. Assignment a's
place in it is the number of assignments with a smaller id, plus the number before a with its
id. Program p takes the chunk of ``CHUNK`` assignments from ``p * CHUNK`` on and splits the
second count at its chunk's start:

1. over all ids (``COUNT_CHUNK`` a step), one histogram of ``2 * id + (b >= start)``: its
   exclusive cumulative sum at bin ``2 * e + 1`` is the number of assignments with an id below
   e plus those of id e before the chunk, ``next_slot[e]``;
2. for its chunk, slot = ``next_slot[id[a]]`` (a gather) plus the assignments before a in the
   chunk with its id (a ``[CHUNK, CHUNK]`` comparison, so no step grows with the number of
   experts), and it stores ``order[slot] = a`` and ``inverse[a] = slot``.

Program 0 also stores the histogram's pairs of bins summed, the assignments per expert (the
grouped GEMMs' ``counts``), which eagerly take a zero fill, a ones fill and an index-add.

Slots are exact integers, so the result is the stable argsort bit for bit, and its inverse
permutation (the dispatch's ``row_order``: the sorted row of each assignment, which the
combine gathers by) comes with it for one more store instead of an arange and a scatter. The
programs share nothing, so the launch takes as long as one program: one pass over the ids and
one chunk.

Bounds: a program holds one ``[CHUNK, CHUNK]`` tile and a histogram of ``2 * E_BLOCK`` bins
whatever A; `MAX_EXPERTS` (256, as in DeepSeek-V3) keeps that small. Every program reads all
A ids, ``A**2 / CHUNK`` reads in all: at `MAX_ASSIGNMENTS` (8,192: decode batches up to 1,024
tokens of 8 experts) 128 programs read 8 MB from L2 in 8 steps each, past it the reads grow
quadratically and torch's multi-block sort (`fp4rl.ops` sends larger sorts there) wins.
`benchmarks/expert_sort.py` times both. The launch depends on shapes only (nothing is read on
the host), so it can be captured in a CUDA graph.

The ids must lie in ``[0, num_experts)`` (the callers' guarantee, as for `sort_by_expert`);
others make a wrong order and inverse but never a store outside them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4rl.kernels import dependent_launch
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import check_contiguous, check_kernel_device, device_of

ID_DTYPES = (torch.int32, torch.int64)
MAX_ASSIGNMENTS = 8192
MAX_EXPERTS = 256
MAX_COUNT_CHUNK = 1024


@dataclass(frozen=True, slots=True)
class SortTile:
    """Programs of ``chunk`` assignments (a power of two >= 16: ``[chunk, chunk]``
    comparisons each) on ``num_warps`` warps. Larger chunks mean fewer programs reading all
    the ids, until the tile no longer fits the registers."""

    chunk: int
    num_warps: int

    def __post_init__(self) -> None:
        if self.chunk < 16 or self.chunk & (self.chunk - 1):
            raise ValueError(f"chunk must be a power of two >= 16; got {self.chunk}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16; got {self.num_warps}")


DEFAULT_TILE = SortTile(chunk=64, num_warps=4)  # 32 comparisons per thread


@triton.jit
def _expert_sort_kernel(
    ids_A,
    order_A,
    inverse_A,
    counts_E,
    A,
    E,
    CHUNK: tl.constexpr,
    COUNT_CHUNK: tl.constexpr,
    E_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    start = tl.program_id(0) * CHUNK
    # Bin 2 * id + (b >= start): below bin 2e + 1 lie the assignments of smaller ids and those
    # of id e before this chunk.
    bins = tl.zeros([2 * E_BLOCK], dtype=tl.int32)
    lanes = tl.arange(0, COUNT_CHUNK)
    for base in range(0, A, COUNT_CHUNK):
        b = base + lanes
        ok = b < A
        ids = tl.load(ids_A + b, mask=ok, other=0).to(tl.int32)
        bins += tl.histogram(2 * ids + (b >= start).to(tl.int32), 2 * E_BLOCK, mask=ok)
    below = tl.cumsum(bins, axis=0) - bins
    if tl.program_id(0) == 0:  # every program holds all the counts; one stores them
        experts = tl.arange(0, E_BLOCK)
        counts = tl.sum(tl.reshape(bins, [E_BLOCK, 2]), axis=1)
        tl.store(counts_E + experts, counts.to(tl.int64), mask=experts < E)
    # This chunk: slot = below[2 * id + 1] + the assignments before a in it with a's id.
    rows = tl.arange(0, CHUNK)
    a = start + rows
    ok = a < A
    ids = tl.load(ids_A + a, mask=ok, other=0).to(tl.int32)
    same = (ids[:, None] == ids[None, :]) & (rows[None, :] < rows[:, None])
    slot = tl.gather(below, 2 * ids + 1, 0) + tl.sum(same.to(tl.int32), axis=1)
    # In range whenever the ids are; the bound keeps ids that are not from writing elsewhere.
    tl.store(order_A + slot, a.to(tl.int64), mask=ok & (slot >= 0) & (slot < A))
    tl.store(inverse_A + a, slot.to(tl.int64), mask=ok)


def supported(num_assignments: int, num_experts: int) -> bool:
    """Whether `launch` takes a sort of this size (shapes only)."""
    return num_assignments <= MAX_ASSIGNMENTS and 0 < num_experts <= MAX_EXPERTS


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def launch(
    ids: torch.Tensor, num_experts: int, tile: SortTile = DEFAULT_TILE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, inverse, counts)`` for int32 or int64 ids in ``[0, num_experts)``, in one
    launch: ``order = torch.argsort(ids.flatten(), stable=True)`` and its inverse permutation,
    ``inverse[order] = arange(A)`` (int64 ``[A]`` each), and the assignments per expert,
    ``torch.bincount(ids.flatten(), minlength=num_experts)`` (int64 ``[num_experts]``);
    ``supported(A, num_experts)`` must hold.
    ``tile`` other than the default is for benchmarking variants (benchmarks/expert_sort.py)."""
    check_kernel_device("ids", ids)
    if ids.dtype not in ID_DTYPES:
        raise ValueError(f"ids must be one of {ID_DTYPES}; got {ids.dtype}")
    check_contiguous("ids", ids)
    A = ids.numel()
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise ValueError(f"num_experts must be an int; got {num_experts!r}")
    if not supported(A, num_experts):
        raise ValueError(
            f"the kernel sorts at most {MAX_ASSIGNMENTS} assignments over 1 to {MAX_EXPERTS} "
            f"experts; got {A} assignments, num_experts={num_experts}"
        )
    order_A = torch.empty(A, dtype=torch.int64, device=ids.device)
    inverse_A = torch.empty_like(order_A)
    if A == 0:
        return order_A, inverse_A, torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts_E = torch.empty(num_experts, dtype=torch.int64, device=ids.device)
    # Tiles as powers of two of at least 16, no larger than A needs: few compiled variants.
    whole = max(16, _pow2_at_least(A))
    chunk = min(tile.chunk, whole)
    with device_of(ids):
        _expert_sort_kernel[(-(-A // chunk),)](
            ids, order_A, inverse_A, counts_E, A, num_experts,
            CHUNK=chunk, COUNT_CHUNK=min(MAX_COUNT_CHUNK, whole),
            E_BLOCK=max(16, _pow2_at_least(num_experts)), num_warps=tile.num_warps,
            **dependent_launch.keywords(ids.device),
        )  # fmt: skip
    return order_A, inverse_A, counts_E
