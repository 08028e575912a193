"""`moe_gemm`'s product on Hopper's warpgroup MMA: the NVFP4 weights decoded straight into its
register operand, the rows of x read by the tensor cores from shared memory.

The same function as `moe_gemm_registers` (one program per ``BLOCK_N`` output columns of a
tile of one expert's rows, found on the device from ``counts_E``; the weights decoded by byte
tables, `fragments`), for the batches with more rows per expert. There each warp of the
register kernel loads the tile's rows of x into its own registers and multiplies them by
``mma.sync``, so a tile of 32 rows holds them four times over (166 registers a thread, three
programs a multiprocessor) and decodes each weight once per 32 rows. Here a program is one or
two warpgroups and each K step's rows of x are stored once into shared memory, where
``wgmma`` (Gluon's `warpgroup_mma`) reads them as its second operand (N = ``BLOCK_M`` rows,
up to 256). The weights are its first operand, from registers: ``wgmma``'s register fragment
for 16-bit A is, warp by warp, that of ``mma.sync.m16n8k16``, so the same permutation of K
(`fragments.hardware_order`: a thread's 8 positions per 32 values of K are one packed word's
codes) makes each thread decode exactly its fragment, a register renaming that the compiler
checks. x takes the same permutation on its way into shared memory.

Numerics: each weight entering a product is ``round_bf16((e2m1 * sf) * s)``, the register
kernel's bits (the same decode); BF16 products are exact in FP32 and accumulate in FP32, in the
tensor cores' order within a k16 step and step by step along K, rounded to BF16 once at the
end. Only the order of the FP32 sums differs from the other programs and `reference_gemm`.

Compiled only, for sm_90 (``wgmma`` is Hopper's): Triton's interpreter runs no Gluon, and other
GPUs take `moe_gemm_registers`' tiles (`moe_tiles.register_config_for`).

Legend as in `moe_gemm_registers`: A rows, K reduction, N output columns, E experts, W words of
8 codes, B blocks of 16 codes.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from fp4rl.kernels import dependent_launch, fragments
from fp4rl.kernels.moe_gemm_registers import blocks_layout, expert_tile, rows_of, words_layout
from fp4rl.kernels.packed_words import GLOBAL_SCALE_BIAS

# Tiles of at most this many rows unroll their K loop at compile time (`_k_step`, bitwise the
# loop's): the 16-row tile's w13 / w2 at 96 / 128 / 192 tokens took 107.1 / 108.1 / 120.3 and
# 57.9 / 58.9 / 63.0 us against 113.1 / 114.5 / 129.0 and 61.0 / 62.1 / 67.0 looped, while
# the 32- and 64-row tiles lost up to 2.3x (w13 at 256 / 512 tokens 193.1 / 399.1 against
# 134.9 / 170.8), their registers grown from 128 to 159 and from 176 to 193 (one H200, `python
# benchmarks/moe.py`, BENCHMARKS.md "Routed-expert GEMM: the K loop unrolled at compile
# time").
UNROLL_MAX_ROWS = 16

# A barrier of all of a program's threads: Gluon's `thread_barrier` up to Triton 3.6, `barrier`
# in later releases.
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


@gluon.constexpr_function
def _x_layout(block_k, warps):
    """``[BLOCK_M, BLOCK_K]`` rows of x as loaded: 8 consecutive values (16 bytes) a thread,
    the warps over the rows."""
    along_k = min(32, block_k // 8)
    return gl.BlockedLayout([1, 8], [32 // along_k, along_k], [warps, 1], [1, 0])


@gluon.jit
def x_rows(x_AK, order_A, row0, rows_end, top_k, K: gl.constexpr, GATHER: gl.constexpr,
           BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, x_l: gl.constexpr):  # fmt: skip
    """(pointers to the first K step of the tile's ``BLOCK_M`` rows of x in ``x_l``, which of
    those rows are the expert's)."""
    rows_M = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_l))
    row_ok_M = rows_M < rows_end
    x_rows_M = rows_M.to(gl.int64)
    if GATHER:  # x holds tokens: row a of the product is token order[a] // top_k
        x_rows_M = rows_of(order_A + rows_M, row_ok_M, 0, False).to(gl.int64) // top_k
    k_K = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_l))
    return x_AK + x_rows_M[:, None] * K + k_K[None, :], row_ok_M


@gluon.jit
def store_tile(y_AN, acc, row0, rows_end, N: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr):  # fmt: skip
    """The tile's FP32 sums ``[BLOCK_N, BLOCK_M]`` (the MMA's layout) as BF16 into its rows of y
    that are the expert's."""
    mma: gl.constexpr = acc.type.layout
    cols_out = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    rows_out = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    y_ptrs = y_AN + rows_out.to(gl.int64)[None, :] * N + cols_out[:, None]
    gl.store(y_ptrs, acc.to(gl.bfloat16), mask=(rows_out < rows_end)[None, :])


@gluon.jit
def _k_step(acc, words, scales, x_MK, word_ptrs, scale_ptrs, x_ptrs, more, x_smem, buffer,
            row_ok_M, s_B, words_l: gl.constexpr, weights_l: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
    """One K step of the product: the accumulator, this step's words, scales and rows of x as
    loaded, and the three pointers -> the same for the next step, ``more`` saying whether there
    is one. The next step's words, scales and rows go in flight while this one decodes; this
    step's rows go to shared memory (``x_smem``'s ``buffer``, in the permuted K order) before
    the next step's are loaded, so that two steps' rows are never held at once."""
    next_words = gl.load(word_ptrs + BLOCK_K // 8, mask=more, other=0)
    next_scales = gl.load(scale_ptrs + BLOCK_K // 16, mask=more, other=0)
    rows_smem = x_smem.index(buffer)
    rows_smem.store(fragments.hardware_order(x_MK, BLOCK_M, BLOCK_K))
    x_ptrs += BLOCK_K
    x_MK = gl.load(x_ptrs, mask=row_ok_M[:, None] & more, other=0.0)
    sf = scales.to(gl.float8e4nv, bitcast=True).to(gl.float32)
    w_NK = fragments.looked_up(words, sf, s_B[:, None], BLOCK_N, BLOCK_K, words_l, PAGE_SIGNS=False)
    w = gl.convert_layout(
        fragments.hardware_order(w_NK, BLOCK_N, BLOCK_K), weights_l, assert_trivial=True
    )
    # Every warp's rows stored before any warp's wgmma reads them.
    fence_async_shared()
    _barrier()
    acc = warpgroup_mma(w, rows_smem.permute((1, 0)), acc)
    word_ptrs += BLOCK_K // 8
    scale_ptrs += BLOCK_K // 16
    return acc, next_words, next_scales, x_MK, word_ptrs, scale_ptrs, x_ptrs


# Batch and row counts change with every step: no recompiling for each.
@gluon.jit(do_not_specialize=["A", "top_k"])
def _moe_gemm_wgmma_kernel(
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
    WARPS: gl.constexpr,
    UNROLL: gl.constexpr,
    PDL: gl.constexpr,
):
    dependent_launch.gluon_wait_for_prior(PDL)
    # Warps along the weight rows, 16 each, in warpgroups of four (wgmma's m64).
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_M, 16]
    )
    weights_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    words_l: gl.constexpr = words_layout(BLOCK_N, BLOCK_K, WARPS, 1)
    blocks_l: gl.constexpr = blocks_layout(BLOCK_N, BLOCK_K, WARPS, 1)
    x_l: gl.constexpr = _x_layout(BLOCK_K, WARPS)
    x_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)

    num_tiles, expert, row0, rows_end = expert_tile(
        counts_E, gl.program_id(1), A, E, BLOCK_M, BLOCK_E, WARPS
    )
    if gl.program_id(1) >= num_tiles:
        return

    x_ptrs, row_ok_M = x_rows(x_AK, order_A, row0, rows_end, top_k, K, GATHER, BLOCK_M, BLOCK_K,
                              x_l)  # fmt: skip

    n_B = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blocks_l))
    w_rows_B = expert.to(gl.int64) * N + n_B
    s_B = gl.load(scale_G + w_rows_B // rows_per_group) * GLOBAL_SCALE_BIAS
    block_B = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, blocks_l))
    scale_ptrs = block_scale_ENB + w_rows_B[:, None] * (K // 16) + block_B[None, :]
    n_W = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, words_l))
    word_W = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, words_l))
    word_ptrs = codes_ENW + (expert.to(gl.int64) * N + n_W)[:, None] * (K // 8) + word_W[None, :]

    # Two buffers of rows: a step stores into the one that the step before last read, whose
    # product every warp has waited for before the barrier of the step before.
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_K], x_shared)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma)
    words = gl.load(word_ptrs)
    scales = gl.load(scale_ptrs)
    x_MK = gl.load(x_ptrs, mask=row_ok_M[:, None], other=0.0)
    # The loop carries its values by name, in this order: carried as one tuple, the same steps
    # compiled to other registers for the 32- to 128-row tiles, 4-5 % slower at 256 and 2,048
    # tokens (one H200).
    if UNROLL:  # K known at compile time: the steps unrolled there
        for k in gl.static_range(0, K, BLOCK_K):
            acc, words, scales, x_MK, word_ptrs, scale_ptrs, x_ptrs = _k_step(
                acc, words, scales, x_MK, word_ptrs, scale_ptrs, x_ptrs, k + BLOCK_K < K,
                x_smem, (k // BLOCK_K) % 2, row_ok_M, s_B, words_l, weights_l,
                BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    else:
        step = 0
        for k in range(0, K, BLOCK_K):
            acc, words, scales, x_MK, word_ptrs, scale_ptrs, x_ptrs = _k_step(
                acc, words, scales, x_MK, word_ptrs, scale_ptrs, x_ptrs, k + BLOCK_K < K,
                x_smem, step % 2, row_ok_M, s_B, words_l, weights_l, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
            # A counter of its own (Gluon has no enumerate): the buffer from ``k // BLOCK_K``
            # compiled to more instructions and registers.
            step += 1  # noqa: SIM113

    store_tile(y_AN, acc, row0, rows_end, N, BLOCK_M, BLOCK_N)


def check_tile(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
               n: int, k: int) -> None:  # fmt: skip
    """Raise ValueError naming the value unless the tile fits ``wgmma`` and the weight's N and K:
    one or two warpgroups, 16 weight rows a warp at least, up to 256 rows of x (wgmma's N),
    K steps of at least 64 (whole blocks a thread), one step loaded ahead."""
    if num_warps not in (4, 8):
        raise ValueError(f"wgmma tile: num_warps must be 4 or 8 (warpgroups); got {num_warps}")
    if block_n % (16 * num_warps):
        raise ValueError(
            f"wgmma tile: block_n={block_n} must be a multiple of 16 x num_warps={num_warps}"
        )
    if block_m > 256:
        raise ValueError(f"wgmma tile: block_m must be at most 256 (wgmma's N); got {block_m}")
    if block_k < 64:
        raise ValueError(f"wgmma tile: block_k must be at least 64; got {block_k}")
    if num_stages != 2:
        raise ValueError(f"wgmma tile: num_stages must be 2 (one step ahead); got {num_stages}")
    if n % block_n or k % block_k:
        raise ValueError(
            f"wgmma tile {block_n}x{block_k} (block_n x block_k): both must divide the "
            f"weight's N={n} and K={k}"
        )


def launch_kernel(grid, x_AK, members, counts_E, y_AN, order_A, *, A, E, N, K, rows_per_group,
                  top_k, tile) -> None:  # fmt: skip
    """Launch over ``grid`` with `moe_gemm.launch`'s checked arguments (``members``: the codes
    as int32, the block scales as bytes, the global scale per group)."""
    check_tile(tile.block_m, tile.block_n, tile.block_k, tile.num_warps, tile.num_stages, N, K)
    _moe_gemm_wgmma_kernel[grid](
        x_AK, *members, counts_E, y_AN, x_AK if order_A is None else order_A,
        A, E, rows_per_group, top_k,
        N=N, K=K, GATHER=order_A is not None,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        BLOCK_E=triton.next_power_of_2(E), WARPS=tile.num_warps,
        UNROLL=tile.block_m <= UNROLL_MAX_ROWS, num_warps=tile.num_warps,
        # Products feed additions only inside the MMA; no FMA may merge the two scalings.
        enable_fp_fusion=False,
        **dependent_launch.keywords(x_AK.device),
    )  # fmt: skip
