"""The MoE dispatch's sort of assignments by expert as a counting sort in one launch.

`fp4rl.model.experts.sort_by_expert` orders the A = T*k token-expert assignments by expert id,
ties in flat order: the permutation ``torch.argsort(ids, stable=True)`` gives. With at most a
few hundred experts that order is a counting sort. One program reads the ids twice:

1. the assignments of each expert (``tl.histogram``, ``COUNT_CHUNK`` ids a step), whose
   exclusive cumulative sum is each expert's first slot, ``next_slot``;
2. chunk by chunk (``CHUNK`` ids), assignment a goes to ``next_slot[id[a]]`` plus the number of
   assignments before a in its chunk with its id (a ``[CHUNK, CHUNK]`` comparison, so the work
   does not grow with the number of experts), and ``next_slot`` moves past the chunk's
   assignments (their histogram). It stores ``order[slot] = a``.

Slots are exact integers, so the result is the stable argsort bit for bit.

Bounds: a program holds one ``[CHUNK, CHUNK]`` tile and two ``[E_BLOCK]`` vectors whatever A,
so registers bound the tile and the experts (`MAX_EXPERTS` bins, as in DeepSeek-V3's 256), not
A. A bounds the time: the chunks run one after another on one SM, ``A / CHUNK`` steps, while
torch's sort spreads a large A over many blocks. `MAX_ASSIGNMENTS` (decode batches: 1,024
tokens of 8 experts) is where `fp4rl.ops` stops sending sorts here, set before a GPU measured
where the two cross (`benchmarks/expert_sort.py` times both). The launch depends on shapes only
(nothing is read on the host), so it can be captured in a CUDA graph.

The ids must lie in ``[0, num_experts)`` (the callers' guarantee, as for `sort_by_expert`);
others make a wrong order but never a store outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4rl.kernels.launch import check_contiguous, check_kernel_device, device_of

ID_DTYPES = (torch.int32, torch.int64)
MAX_ASSIGNMENTS = 8192
MAX_EXPERTS = 256
MAX_COUNT_CHUNK = 1024


@dataclass(frozen=True, slots=True)
class SortTile:
    """Rank chunks of up to ``chunk`` ids (a power of two >= 16: ``[chunk, chunk]``
    comparisons a step) on ``num_warps`` warps. Fewer, larger steps shorten the serial walk
    until the tile no longer fits the registers (sm_90, Triton 3.6: 64 on 4 warps takes 128
    registers a thread, 128 on 8 warps 254)."""

    chunk: int
    num_warps: int

    def __post_init__(self) -> None:
        if self.chunk < 16 or self.chunk & (self.chunk - 1):
            raise ValueError(f"chunk must be a power of two >= 16; got {self.chunk}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16; got {self.num_warps}")


DEFAULT_TILE = SortTile(chunk=64, num_warps=4)  # 32 comparisons per thread a step


@triton.jit
def _expert_sort_kernel(
    ids_A, order_A, A, CHUNK: tl.constexpr, COUNT_CHUNK: tl.constexpr, E_BLOCK: tl.constexpr
):
    # Pass 1: assignments per expert; each expert's first slot.
    counts = tl.zeros([E_BLOCK], dtype=tl.int32)
    lanes = tl.arange(0, COUNT_CHUNK)
    for start in range(0, A, COUNT_CHUNK):
        a = start + lanes
        ok = a < A
        ids = tl.load(ids_A + a, mask=ok, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_BLOCK, mask=ok)
    next_slot = tl.cumsum(counts, axis=0) - counts
    # Pass 2: slot = next_slot[id] + the assignments before a in the chunk with a's id.
    rows = tl.arange(0, CHUNK)
    before = rows[None, :] < rows[:, None]
    for start in range(0, A, CHUNK):
        a = start + rows
        ok = a < A
        ids = tl.load(ids_A + a, mask=ok, other=0).to(tl.int32)
        same = (ids[:, None] == ids[None, :]) & before
        slot = tl.gather(next_slot, ids, 0) + tl.sum(same.to(tl.int32), axis=1)
        # In range whenever the ids are; the bound keeps ids that are not from writing elsewhere.
        tl.store(order_A + slot, a.to(tl.int64), mask=ok & (slot >= 0) & (slot < A))
        next_slot += tl.histogram(ids, E_BLOCK, mask=ok)


def supported(num_assignments: int, num_experts: int) -> bool:
    """Whether `launch` takes a sort of this size (shapes only)."""
    return num_assignments <= MAX_ASSIGNMENTS and 0 < num_experts <= MAX_EXPERTS


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def launch(ids: torch.Tensor, num_experts: int, tile: SortTile = DEFAULT_TILE) -> torch.Tensor:
    """``torch.argsort(ids.flatten(), stable=True)`` (int64 ``[A]``) for int32 or int64 ids in
    ``[0, num_experts)``, in one launch; ``supported(A, num_experts)`` must hold. ``tile``
    other than the default is for benchmarking variants (benchmarks/expert_sort.py)."""
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
    if A == 0:
        return order_A
    # Tiles as powers of two of at least 16, no larger than A needs: few compiled variants.
    whole = max(16, _pow2_at_least(A))
    with device_of(ids):
        _expert_sort_kernel[(1,)](
            ids, order_A, A,
            CHUNK=min(tile.chunk, whole), COUNT_CHUNK=min(MAX_COUNT_CHUNK, whole),
            E_BLOCK=max(16, _pow2_at_least(num_experts)), num_warps=tile.num_warps,
        )  # fmt: skip
    return order_A
