"""`moe_gemm_wgmma`'s product with decode and MMA in different warps: a warp-specialized program.

In `moe_gemm_wgmma` every warp of a program decodes its weights into registers, waits at a
barrier of the whole program for the rows of x in shared memory, then waits for its ``wgmma``:
decode, barrier and MMA take turns. Here a program is two partitions (Gluon's
`warp_specialize`), which meet only at mbarriers:

- **decoders** (``GemmTile.decoders`` warps): each K step's packed words and block scales are
  copied asynchronously ``num_stages - 1`` steps ahead into shared slots, decoded by byte tables
  (the lookup of `fragments`, the same bits) and stored as BF16 into a ring of ``num_stages``
  buffers in the MMA's swizzled layout; an mbarrier says a buffer is ready;
- **the MMA warpgroup** (the program's 4 warps): copies the tile's rows of x ``num_stages - 1``
  steps ahead into their own slots, waits for a ready buffer, issues an asynchronous
  ``wgmma`` with both operands in shared memory, and frees the buffer that the ``wgmma``
  before it read.

The proxy fence that makes the decoders' stores visible to the tensor cores is the MMA
warpgroup's, after its wait: on sm_90 the fence compiles to a ``MEMBAR.ALL.CTA``, which waits
for the thread's memory operations in flight, and in the decoders it stalled each step on the
loads just issued for the next (moving it gained the most, BENCHMARKS.md).

Not chosen by the launcher (`moe_tiles`): a tile with ``decoders`` is opt-in. On one H200 it
runs 1.14-1.32x slower than the launcher's tiles at 96-384 tokens (BENCHMARKS.md,
"Routed-expert GEMM: a warp-specialized program"): with about as many decoder instructions a
weight as the register kernels, it is bound by its per-step synchronization and its
shared-memory traffic (each weight stored as BF16 and read back by the tensor cores).

Numerics: each weight entering a product is ``round_bf16((e2m1 * sf) * s)``, the register
kernels' bits; BF16 products are exact in FP32 and accumulate in FP32, in the tensor cores'
order within a k16 step and step by step along K (real K order: no permutation is needed when
both operands come from shared memory), rounded to BF16 once at the end.

Compiled only, for sm_90. Legend as in `moe_gemm_registers`.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fp4rl.kernels import dependent_launch, fragments
from fp4rl.kernels.moe_gemm_registers import expert_tile
from fp4rl.kernels.moe_gemm_wgmma import _barrier, _x_layout, store_tile, x_rows
from fp4rl.kernels.packed_words import GLOBAL_SCALE_BIAS

# The MMA warpgroup: the program's own warps (Gluon's default partition).
MMA_WARPS = gl.constexpr(4)
# Registers a thread of either partition keeps (``maxnreg``, and the decoders' ``setmaxnreg``):
# 80 let two programs of 12 warps share a multiprocessor (8 decoders), three of 8 (4).
REGISTERS = 80
# Of which the MMA warpgroup's FP32 accumulator may take (``block_n * block_m / 128``).
ACCUMULATOR_REGISTERS = 32
# Triton's asynchronous copy to shared memory: `async_copy_global_to_shared` up to 3.6,
# `async_load` in later releases.
_load_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# A shared buffer seen as another type: `_reinterpret` up to 3.6, `reinterpret` later.
_NEW_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

# A tile's ``num_stages`` is both the weights' buffers and the copies' slots (words, scales and
# rows of x, ``num_stages - 1`` steps ahead). One H200, the 16:128:128 tile's w13 at 128 / 256
# tokens, when slots and buffers were apart: 2 slots 147.6 / 205.6 us, 3 slots 154.7 / 216.3
# (2 buffers, two programs a multiprocessor); 2 slots and 3 buffers (one program) 193.1 / 273.5.


@gluon.constexpr_function
def _words_layouts(block_n, block_k, warps):
    """(words, blocks) layouts of the decoders: each thread holds ``CH = BLOCK_K // 32``
    consecutive words of a row (its blocks with them), 8 rows of a warp's 16 apart by lanes and
    by one register bit, the 4 K positions of a row on lanes such that the 8 lanes that share a
    16-byte store's wavefront hit 8 different bank groups of the MMA's swizzled buffer (its
    128-byte rows of 64 values): K lanes within a row's first 64 values first, then rows, then
    the other K lanes."""
    ch = block_k // 32
    within = [i for i in range(2) if (8 * ch) << i < 64]
    lanes = [[0, ch << i] for i in within] + [[1, 0], [2, 0], [4, 0]]
    lanes += [[0, ch << i] for i in range(2) if i not in within]
    rows = [[8, 0]] + [
        [16 * warps << i, 0] for i in range((block_n // (16 * warps)).bit_length() - 1)
    ]
    warp_bases = [[16 << i, 0] for i in range(warps.bit_length() - 1)]
    regs = [[0, 1 << i] for i in range(ch.bit_length() - 1)] + rows
    words = gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [block_n, block_k // 8])
    # A block is two words: one bit less along K, in the registers.
    regs = [[0, 1 << i] for i in range(ch.bit_length() - 2)] + rows
    lanes = [[r, c // 2] for r, c in lanes]
    blocks = gl.DistributedLinearLayout(regs, lanes, warp_bases, [], [block_n, block_k // 16])
    return words, blocks


@gluon.constexpr_function
def _at_most(a, b):
    return min(a, b)


@gluon.jit
def _decode_step(i, word_ptrs, scale_ptrs, words_s, scales_s, w_smem, ready, empty, s_B,
                 words_l: gl.constexpr, blocks_l: gl.constexpr, STEPS: gl.constexpr,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                 SLOT: gl.constexpr):  # fmt: skip
    """Step ``i`` of the decoders (``SLOT = i % STAGES``, known when compiling): step ``i +
    STAGES - 1``'s words and scales copied asynchronously, this step's (copied ``STAGES - 1``
    steps ago) decoded and, once buffer ``SLOT`` is free, stored there."""
    AHEAD: gl.constexpr = (SLOT + STAGES - 1) % STAGES  # the slot that step i - 1 read
    # Past the last step, the last step again into that slot (which nothing reads any more):
    # no copy group is ever empty, which Triton 3.6's lowering cannot take.
    ahead = gl.minimum(i + STAGES - 1, STEPS - 1)
    _load_async(words_s.index(AHEAD), word_ptrs + ahead * (BLOCK_K // 8))
    _load_async(scales_s.index(AHEAD), scale_ptrs + ahead * (BLOCK_K // 16))
    async_copy.commit_group()
    async_copy.wait_group(STAGES - 1)
    # The scales were copied by other threads than those that read them.
    _barrier()
    words = words_s.index(SLOT).load(words_l)
    scales = scales_s.index(SLOT).load(blocks_l)
    sf = scales.to(gl.float8e4nv, bitcast=True).to(gl.float32)
    w_NK = fragments.looked_up(
        words, sf, s_B[:, None], BLOCK_N, BLOCK_K, words_l, PAGE_SIGNS=False, PACKED=True
    )
    # Free once the MMA of step i - STAGES has read it (a fresh barrier counts as freed once).
    mbarrier.wait(empty.index(SLOT), ((i // STAGES) & 1) ^ 1)
    # The BF16 buffer's bytes as int32 pairs, swizzled alike.
    pairs_shared: gl.constexpr = gl.NVMMASharedLayout(128, 32, rank=2)
    if _NEW_REINTERPRET:
        pairs = w_smem.index(SLOT).reinterpret(gl.int32, [BLOCK_N, BLOCK_K // 2], pairs_shared)
    else:
        pairs = w_smem.index(SLOT)._reinterpret(gl.int32, [BLOCK_N, BLOCK_K // 2], pairs_shared)
    pairs.store(w_NK)
    # No proxy fence here: it waits for every copy in flight (MEMBAR.ALL.CTA), which would
    # stall each step on the copies it has just issued. The MMA warpgroup fences after its wait.
    mbarrier.arrive(ready.index(SLOT))


@gluon.jit
def _decoders(codes_ENW, block_scale_ENB, scale_G, words_s, scales_s, w_smem, ready, empty,
              expert, rows_per_group, N: gl.constexpr, K: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, DECODERS: gl.constexpr):  # fmt: skip
    """The decoder partition: every K step of the program's weights into the ring."""
    layouts: gl.constexpr = _words_layouts(BLOCK_N, BLOCK_K, DECODERS)
    words_l: gl.constexpr = layouts[0]
    blocks_l: gl.constexpr = layouts[1]
    # A row's scales of a step (4 to 16 bytes) in one copy.
    row_scales_l: gl.constexpr = gl.BlockedLayout(
        [1, BLOCK_K // 16], [32, 1], [DECODERS, 1], [1, 0]
    )
    STEPS: gl.constexpr = K // BLOCK_K

    n0 = gl.program_id(0) * BLOCK_N
    n_B = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blocks_l))
    s_B = gl.load(scale_G + (expert.to(gl.int64) * N + n_B) // rows_per_group) * GLOBAL_SCALE_BIAS
    n_S = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, row_scales_l))
    block_S = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, row_scales_l))
    scale_ptrs = block_scale_ENB + (expert.to(gl.int64) * N + n_S)[:, None] * (K // 16)
    scale_ptrs += block_S[None, :]
    n_W = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, words_l))
    word_W = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, words_l))
    word_ptrs = codes_ENW + (expert.to(gl.int64) * N + n_W)[:, None] * (K // 8) + word_W[None, :]

    for j in gl.static_range(STAGES - 1):  # (past the last step, as in `_decode_step`)
        _load_async(words_s.index(j), word_ptrs + _at_most(j, STEPS - 1) * (BLOCK_K // 8))
        _load_async(scales_s.index(j), scale_ptrs + _at_most(j, STEPS - 1) * (BLOCK_K // 16))
        async_copy.commit_group()
    # A pass of the loop takes STAGES steps, each with its slot known when compiling (the step
    # itself stays a runtime value: constant ones trip Triton 3.6's lowering to LLVM).
    for i0 in range(0, STEPS, STAGES):
        for j in gl.static_range(STAGES):
            if i0 + j < STEPS:
                _decode_step(i0 + j, word_ptrs, scale_ptrs, words_s, scales_s, w_smem, ready,
                             empty, s_B, words_l, blocks_l, STEPS, BLOCK_N, BLOCK_K, STAGES,
                             j)  # fmt: skip


@gluon.jit
def _mma_step(i, acc, x_ptrs, row_ok_M, w_smem, x_smem, ready, empty, STEPS: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, SLOT: gl.constexpr):  # fmt: skip
    """Step ``i`` of the MMA warpgroup (``SLOT = i % STAGES``): once its rows of x (copied
    ``STAGES - 1`` steps ago) and its weights are in, its ``wgmma``; once the one before has
    finished, that one's weight buffer freed and its rows' slot refilled with step ``i + STAGES
    - 1``'s."""
    BEFORE: gl.constexpr = (SLOT + STAGES - 1) % STAGES  # step i - 1's slot and buffer
    mbarrier.wait(ready.index(SLOT), (i // STAGES) & 1)
    async_copy.wait_group(STAGES - 2)
    # The decoders' stores (ordered before this by the barrier) and this warpgroup's copies,
    # made visible to the tensor cores' reads.
    fence_async_shared()
    _barrier()
    acc = warpgroup_mma(w_smem.index(SLOT), x_smem.index(SLOT).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
    mbarrier.arrive(empty.index(BEFORE), pred=i > 0)
    ahead = gl.minimum(i + STAGES - 1, STEPS - 1)  # (as in `_decode_step`)
    _load_async(x_smem.index(BEFORE), x_ptrs + ahead * BLOCK_K, mask=row_ok_M[:, None])
    async_copy.commit_group()
    return acc


@gluon.jit
def _mma(x_AK, order_A, w_smem, x_smem, ready, empty, row0, rows_end, top_k, K: gl.constexpr,
         GATHER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
         BLOCK_K: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    """The MMA partition: the tile's rows of x into their ring, and the tile's FP32 sums,
    ``[BLOCK_N, BLOCK_M]``."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[MMA_WARPS, 1], instr_shape=[16, BLOCK_M, 16]
    )
    x_l: gl.constexpr = _x_layout(BLOCK_K, MMA_WARPS)
    STEPS: gl.constexpr = K // BLOCK_K
    x_ptrs, row_ok_M = x_rows(x_AK, order_A, row0, rows_end, top_k, K, GATHER, BLOCK_M, BLOCK_K,
                              x_l)  # fmt: skip
    for j in gl.static_range(STAGES - 1):
        x_next = x_ptrs + _at_most(j, STEPS - 1) * BLOCK_K
        _load_async(x_smem.index(j), x_next, mask=row_ok_M[:, None])
        async_copy.commit_group()

    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    for i0 in range(0, STEPS, STAGES):  # STAGES steps a pass, as the decoders'
        for j in gl.static_range(STAGES):
            if i0 + j < STEPS:
                acc = _mma_step(i0 + j, acc, x_ptrs, row_ok_M, w_smem, x_smem, ready, empty,
                                STEPS, BLOCK_K, STAGES, j)  # fmt: skip
    # A tuple: what a partition returns is flattened into the region's results.
    return (warpgroup_mma_wait(num_outstanding=0, deps=(acc,)),)


# Batch and row counts change with every step: no recompiling for each.
@gluon.jit(do_not_specialize=["A", "top_k"])
def _moe_gemm_specialized_kernel(
    x_AK,
    codes_ENW,
    block_scale_ENB,
    scale_G,
    counts_E,
    y_AN,
    order_A,
    A,
    E,
    rows_per_group,
    top_k,
    N: gl.constexpr,
    K: gl.constexpr,
    GATHER: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    BLOCK_E: gl.constexpr,
    STAGES: gl.constexpr,
    DECODERS: gl.constexpr,
    REGISTERS: gl.constexpr,
    PDL: gl.constexpr,
):
    dependent_launch.gluon_wait_for_prior(PDL)
    num_tiles, expert, row0, rows_end = expert_tile(
        counts_E, gl.program_id(1), A, E, BLOCK_M, BLOCK_E, MMA_WARPS
    )
    if gl.program_id(1) >= num_tiles:
        return

    w_smem = gl.allocate_shared_memory(
        gl.bfloat16, [STAGES, BLOCK_N, BLOCK_K],
        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16),
    )  # fmt: skip
    x_smem = gl.allocate_shared_memory(
        gl.bfloat16, [STAGES, BLOCK_M, BLOCK_K],
        gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16),
    )  # fmt: skip
    # Words in 16-byte units, swizzled by row: the decoders' copies and loads without bank
    # conflicts (for K steps of 64 and 128).
    words_shared: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    words_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, BLOCK_K // 8], words_shared)
    scales_shared: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    scales_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, BLOCK_K // 16], scales_shared)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    results = gl.warp_specialize(
        [
            (
                _mma,
                (x_AK, order_A, w_smem, x_smem, ready, empty, row0, rows_end, top_k, K, GATHER,
                 BLOCK_M, BLOCK_N, BLOCK_K, STAGES),
            ),
            (
                _decoders,
                (codes_ENW, block_scale_ENB, scale_G, words_s, scales_s, w_smem, ready, empty,
                 expert, rows_per_group, N, K, BLOCK_N, BLOCK_K, STAGES, DECODERS),
            ),
        ],
        [DECODERS],
        [REGISTERS],
    )  # fmt: skip
    store_tile(y_AN, results[0], row0, rows_end, N, BLOCK_M, BLOCK_N)


# Shared memory a program may take (sm_90: 227 KiB).
SHARED_BYTES = 227 * 1024


def check_tile(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
               decoders: int, n: int, k: int) -> None:  # fmt: skip
    """Raise ValueError naming the value unless the tile fits: one MMA warpgroup, 4 or 8
    decoder warps of 16 weight rows at least, an accumulator within `ACCUMULATOR_REGISTERS`
    (``block_m`` up to 32 at 128 columns), K steps of 64 or 128, a ring of 2 stages or more
    that fits in shared memory, and at least as many K steps as stages."""
    if num_warps != MMA_WARPS.value:
        raise ValueError(
            f"warp-specialized tile: num_warps must be {MMA_WARPS.value} (the MMA warpgroup); "
            f"got {num_warps}"
        )
    if decoders not in (4, 8) or block_n % (16 * decoders):
        raise ValueError(
            f"warp-specialized tile: decoders must be 4 or 8, each over 16 of block_n={block_n} "
            f"rows at least; got {decoders}"
        )
    if block_n * block_m > 128 * ACCUMULATOR_REGISTERS:
        raise ValueError(
            f"warp-specialized tile: block_n x block_m must be at most "
            f"{128 * ACCUMULATOR_REGISTERS} (the accumulator's registers); got "
            f"{block_n}x{block_m}"
        )
    if block_k not in (64, 128):  # (Triton 3.6 fails to compile 256)
        raise ValueError(f"warp-specialized tile: block_k must be 64 or 128; got {block_k}")
    # Each stage: the weights' buffer, then the copies' slots (rows of x, words, scales).
    ring = num_stages * block_k * (2 * block_n + 2 * block_m + block_n // 2 + block_n // 16)
    if num_stages < 2 or ring > SHARED_BYTES - 1024:
        raise ValueError(
            f"warp-specialized tile: num_stages={num_stages} must be 2 or more and its ring "
            f"({ring} bytes) fit in shared memory"
        )
    if n % block_n or k % block_k:
        raise ValueError(
            f"warp-specialized tile {block_n}x{block_k} (block_n x block_k): both must divide "
            f"the weight's N={n} and K={k}"
        )
    if k // block_k < num_stages:  # (fewer fail to compile under Triton 3.6)
        raise ValueError(
            f"warp-specialized tile: K={k} must hold num_stages={num_stages} steps of "
            f"block_k={block_k} at least"
        )


def launch_kernel(grid, x_AK, members, counts_E, y_AN, order_A, *, A, E, N, K, rows_per_group,
                  top_k, tile) -> None:  # fmt: skip
    """Launch over ``grid`` with `moe_gemm.launch`'s checked arguments."""
    check_tile(tile.block_m, tile.block_n, tile.block_k, tile.num_warps, tile.num_stages,
               tile.decoders, N, K)  # fmt: skip
    _moe_gemm_specialized_kernel[grid](
        x_AK, *members, counts_E, y_AN, x_AK if order_A is None else order_A,
        A, E, rows_per_group, top_k,
        N=N, K=K, GATHER=order_A is not None,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        BLOCK_E=triton.next_power_of_2(E), STAGES=tile.num_stages,
        DECODERS=tile.decoders, REGISTERS=REGISTERS, num_warps=MMA_WARPS.value, maxnreg=REGISTERS,
        # Products feed additions only inside the MMA; no FMA may merge the two scalings.
        enable_fp_fusion=False,
        **dependent_launch.keywords(x_AK.device),
    )  # fmt: skip
