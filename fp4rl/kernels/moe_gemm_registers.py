"""`moe_gemm`'s product with the NVFP4 weights decoded straight into the tensor cores' registers.

The same function as `moe_gemm.launch` on packed weights (one program per ``BLOCK_N`` output
columns of a tile of one expert's rows, found on the device from ``counts_E``), written in
Triton's Gluon dialect so that the layouts are chosen here rather than by the compiler. The
difference is where the decoded weights go. `moe_gemm`'s `tl.dot` on Hopper is a wgmma whose
weight operand sits in shared memory, so every decoded tile is stored there and read back. Here
the product is a chain of ``mma.sync.m16n8k16`` (Gluon's `mma_v2`), whose operands live in
registers: each thread decodes exactly the weights its fragment of the operand holds, and no
weight passes through shared memory.

What makes that possible is a permutation of K (`fragments`): within a step of ``BLOCK_K``,
real k is assigned to the fragments' positions such that the 8 a thread holds per 32 values of
K are the 8 codes of one packed word. The rows of x, the other operand, are loaded in real
order (8 consecutive values per thread, one 16-byte load) and put in the same order; both
reorderings are register renamings, checked at compile time. Rows stored in
`launch.permuted_rows`' order (``X_PERMUTED``: `moe_gemm.launch`'s ``x_permuted_by``) are read
with the same loads from other addresses, so that a quad's loads share cache lines; each thread
holds the same values either way.

A split tile (``GemmTile.split_k`` > 1) lays that many warps along K instead of N: each takes
its own ``BLOCK_K`` of a step of ``split_k * BLOCK_K``, the weights' and x's tiles hold the
slices stacked along their rows, the product is batched over them (a 3-D `mma_v2`), and the
slices' FP32 sums are added once after the loop (across warps, through shared memory, in a
fixed order). A lone token's w13 walks its 2,048 of K in half the steps per warp that way.
Unsplit tiles keep the 2-D layouts, which compile to fewer registers.

Decode: by byte-table lookup (`fragments.byte_tables`, `fragments.look_up`: 15 instructions for
8 weights) against about 40 for the arithmetic per code (`_decode`, kept for 32-wide K steps
and as the lookup's reference in the tests). See `LOOKUP`.

Numerics: each weight entering a product is ``round_bf16((e2m1 * sf) * s)`` from `packed_words`'
pieces, the bits `moe_gemm` decodes (the lookup's tables hold exactly those values for the 8
magnitudes, and a negative code flips the sign bit, as the symmetric rounding does); products
of BF16 values are exact in FP32 and accumulate in FP32 (in the tensor cores' own order over a
k16 step, then step by step along K), rounded to BF16 once at the end. Only the order of the
FP32 sum differs from `moe_gemm` and from `reference_gemm`. The global scale stays inside the
weight (the contract), not on the accumulator.

Compiled only (sm_89 and newer): Triton's interpreter runs no Gluon, so the CPU runs
`moe_gemm`'s program, the reference for this one's tests on the GPU.

Legend: A rows (token-expert assignments), K reduction, N output columns, E experts, W words of
8 codes, CH chunks of 32 values of K in a step; U and V the stacked rows of x's and the weights'
tiles (a split's slices one above the other), S the slices.
"""

from __future__ import annotations

import math

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from fp4rl.kernels import dependent_launch, fragments, packed_words
from fp4rl.kernels.packed_words import BLOCK_SCALE_BIAS, GLOBAL_SCALE_BIAS

# The recipe's code decode as a Gluon function: the same Python body. (A block scale byte
# becomes FP32 through the GPU's E4M3 conversion, as `numerics.e4m3_value` does when compiled.)
_packed_code = gluon.jit(packed_words.packed_code.fn)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.constexpr_function
def _warps(step, rows, warps_n, split):
    """Warp bases of ``split`` stacked K slices of ``rows`` rows each: ``warps_n`` warps along
    the rows, ``step`` apart (16, the MMA's m16; 0 where they all hold the same values), then
    one slice a warp, in the warp order of `NVMMADistributedLayout` on ``[split, rows, cols]``."""
    along = [[step << i, 0] for i in range(int(math.log2(warps_n)))]
    return along + [[rows << i, 0] for i in range(int(math.log2(split)))]


@gluon.constexpr_function
def words_layout(block_n, block_k, warps_n, split):
    """``[split * BLOCK_N, BLOCK_K // 8]`` packed words (slice s of the step's K on rows ``s *
    BLOCK_N ..``), each held by the thread whose operand fragment holds its 8 codes: lanes (c,
    g) of a quad layout, warps along N as the MMA's, then one K slice each."""
    ch = block_k // 32
    regs = [[0, 1 << i] for i in range(int(math.log2(ch)))] + [[8, 0]]
    regs += [[16 * warps_n << i, 0] for i in range(int(math.log2(block_n // (16 * warps_n))))]
    lanes = [[0, ch], [0, 2 * ch], [1, 0], [2, 0], [4, 0]]
    warps = _warps(16, block_n, warps_n, split)
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [split * block_n, block_k // 8])


@gluon.constexpr_function
def blocks_layout(block_n, block_k, warps_n, split):
    """``[split * BLOCK_N, BLOCK_K // 16]`` blocks of 16 codes, each held by the thread that
    holds its two words in `words_layout` (BLOCK_K >= 64)."""
    ch = block_k // 32
    regs = [[0, 1 << i] for i in range(int(math.log2(ch)) - 1)] + [[8, 0]]
    regs += [[16 * warps_n << i, 0] for i in range(int(math.log2(block_n // (16 * warps_n))))]
    lanes = [[0, ch // 2], [0, ch], [1, 0], [2, 0], [4, 0]]
    warps = _warps(16, block_n, warps_n, split)
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [split * block_n, block_k // 16])


@gluon.constexpr_function
def _rows_layout(block_m, block_k, warps_n, split):
    """``[split * BLOCK_M, BLOCK_K]`` rows of x in real K order (slice s of the step's K on rows
    ``s * BLOCK_M ..``): each thread holds the 8 consecutive values matching each word it
    decodes, for its rows; the warps along N hold the same values, each slice's its own."""
    ch = block_k // 32
    regs = [[0, 1], [0, 2], [0, 4]] + [[0, 8 << i] for i in range(int(math.log2(ch)))]
    regs += [[8 << i, 0] for i in range(int(math.log2(block_m // 8)))]
    lanes = [[0, 8 * ch], [0, 16 * ch], [1, 0], [2, 0], [4, 0]]
    warps = _warps(0, block_m, warps_n, split)
    return gl.DistributedLinearLayout(regs, lanes, warps, [], [split * block_m, block_k])


@gluon.constexpr_function
def _mma_layout(warps_n, split):
    """The MMA's accumulator layout: warps along N, and with a split one K slice a warp,
    batched (``[split, BLOCK_N, BLOCK_M]``). Unsplit tiles keep the plain 2-D layout, which
    compiles to fewer registers."""
    if split == 1:
        return gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[warps_n, 1], instr_shape=[16, 8]
        )
    return gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[split, warps_n, 1], instr_shape=[1, 16, 8]
    )


@gluon.constexpr_function
def _stacked_shape(split, shape):
    """The accumulator's shape: ``shape``, batched over the slices of a split."""
    return shape if split == 1 else [split, *shape]


@gluon.jit
def _unstacked(v, ROWS: gl.constexpr, SPLIT: gl.constexpr):
    """(row within its slice, slice) of stacked row numbers ``v``."""
    if SPLIT > 1:
        row = v % ROWS
        piece = v // ROWS
    else:
        row = v
        piece = 0
    return row, piece


@gluon.jit
def _stacked(t, SPLIT: gl.constexpr):
    """``[SPLIT * ROWS, BLOCK_K]`` stacked slices as the product's first operand's shape."""
    if SPLIT > 1:
        t = gl.reshape(t, [SPLIT, t.shape[0] // SPLIT, t.shape[1]])
    return t


@gluon.jit
def _stacked_t(t, SPLIT: gl.constexpr):
    """``[SPLIT * ROWS, BLOCK_K]`` stacked slices, each transposed: the second operand's shape."""
    if SPLIT > 1:
        t = gl.permute(gl.reshape(t, [SPLIT, t.shape[0] // SPLIT, t.shape[1]]), [0, 2, 1])
    else:
        t = gl.permute(t, [1, 0])
    return t


@gluon.jit
def _weight(words, J: gl.constexpr, scale, s):
    """Code J of each word as its BF16 weight ``round((e2m1 * sf) * s)`` (biased scales)."""
    return ((_packed_code(words, J) * scale) * s).to(gl.bfloat16)


@gluon.jit
def _decode(words, scale, s, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` BF16 weights of ``[BLOCK_N, BLOCK_K // 8]`` words, real K order."""
    return fragments.joined(
        _weight(words, 0, scale, s), _weight(words, 1, scale, s),
        _weight(words, 2, scale, s), _weight(words, 3, scale, s),
        _weight(words, 4, scale, s), _weight(words, 5, scale, s),
        _weight(words, 6, scale, s), _weight(words, 7, scale, s),
        BLOCK_N, BLOCK_K,
    )  # fmt: skip


@gluon.jit
def rows_of(ptrs, row_ok, other, CLAMPED: gl.constexpr):
    """A load of x's rows (or their ids): masked to the tile's rows, or, with rows clamped into
    them, unmasked."""
    return gl.load(ptrs) if CLAMPED else gl.load(ptrs, mask=row_ok, other=other)


@gluon.jit
def expert_tile(counts_E, tile, num_rows, E, BLOCK_M: gl.constexpr, BLOCK_E: gl.constexpr,
                 NUM_WARPS: gl.constexpr):  # fmt: skip
    """(tiles in all, expert, first row, end of the expert's rows), as `moe_gemm`'s. Every warp
    holds all the counts (the layout repeats them across warps), so the scans and sums stay
    within a warp: no barrier, no shared memory, for a few more instructions each."""
    each: gl.constexpr = max(1, BLOCK_E // 32)
    e_E = gl.arange(0, BLOCK_E, layout=gl.BlockedLayout([each], [32], [NUM_WARPS], [0]))
    counts = gl.load(counts_E + e_E, mask=e_E < E, other=0).to(gl.int32)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = gl.associative_scan(tiles, 0, _add)
    row_end = gl.associative_scan(counts, 0, _add)
    expert = gl.sum((tile_end <= tile).to(gl.int32), 0)
    mine = e_E == expert
    first_tile = gl.sum(gl.where(mine, tile_end - tiles, 0), 0)
    rows_end = gl.sum(gl.where(mine, row_end, 0), 0)
    rows_start = rows_end - gl.sum(gl.where(mine, counts, 0), 0)
    return (
        gl.sum(tiles, 0),
        expert,
        rows_start + (tile - first_tile) * BLOCK_M,
        gl.minimum(rows_end, num_rows),
    )


@gluon.jit
def _k_step(acc, words, scales, word_ptrs, scale_ptrs, x_ptrs, more, row_ok_U, s_rows,
            weights_l: gl.constexpr, rows_l: gl.constexpr, words_l: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT: gl.constexpr,
            PREFETCH: gl.constexpr, LOOKUP: gl.constexpr, CLAMP_ROWS: gl.constexpr):  # fmt: skip
    """One K step of the product: the accumulator, this step's words and block scales as loaded
    and the three pointers -> the same for the next step, ``more`` saying whether there is
    one (with ``PREFETCH`` its words are loaded before this step decodes, else after).
    ``s_rows``: the rows' biased global scales, in the blocks' layout (LOOKUP) or the words'."""
    STEP: gl.constexpr = SPLIT * BLOCK_K
    if PREFETCH:  # the next step's words in flight while this step decodes
        next_words = gl.load(word_ptrs + STEP // 8, mask=more, other=0)
        next_scales = gl.load(scale_ptrs + STEP // 16, mask=more, other=0)
    sf = scales.to(gl.float8e4nv, bitcast=True).to(gl.float32)
    if LOOKUP:
        w_VK = fragments.looked_up(
            words, sf, s_rows[:, None], SPLIT * BLOCK_N, BLOCK_K, words_l, PAGE_SIGNS=False
        )
    else:
        w_VK = _decode(words, sf * BLOCK_SCALE_BIAS, s_rows[:, None], SPLIT * BLOCK_N, BLOCK_K)
    w = fragments.hardware_order(w_VK, SPLIT * BLOCK_N, BLOCK_K)
    w = gl.convert_layout(_stacked(w, SPLIT), weights_l, assert_trivial=True)
    x_UK = rows_of(x_ptrs, row_ok_U[:, None], 0.0, CLAMP_ROWS)
    x = _stacked_t(fragments.hardware_order(x_UK, x_UK.shape[0], BLOCK_K), SPLIT)
    acc = mma_v2(w, gl.convert_layout(x, rows_l, assert_trivial=True), acc)
    word_ptrs += STEP // 8
    scale_ptrs += STEP // 16
    x_ptrs += STEP
    if PREFETCH:
        words = next_words
        scales = next_scales
    else:
        if more:
            words = gl.load(word_ptrs)
            scales = gl.load(scale_ptrs)
    return acc, words, scales, word_ptrs, scale_ptrs, x_ptrs


@gluon.jit(do_not_specialize=["A", "top_k"])
def _moe_gemm_registers_kernel(
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
    PREFETCH: gl.constexpr,
    LOOKUP: gl.constexpr,
    WARPS_N: gl.constexpr,
    SPLIT: gl.constexpr,
    CLAMP_ROWS: gl.constexpr,
    UNROLL: gl.constexpr,
    X_PERMUTED: gl.constexpr,
    PDL: gl.constexpr,
):
    dependent_launch.gluon_wait_for_prior(PDL)
    mma: gl.constexpr = _mma_layout(WARPS_N, SPLIT)
    weights_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    words_l: gl.constexpr = words_layout(BLOCK_N, BLOCK_K, WARPS_N, SPLIT)
    x_l: gl.constexpr = _rows_layout(BLOCK_M, BLOCK_K, WARPS_N, SPLIT)
    STEP: gl.constexpr = SPLIT * BLOCK_K  # of K, per pass of the loop

    num_tiles, expert, row0, rows_end = expert_tile(
        counts_E, gl.program_id(1), A, E, BLOCK_M, BLOCK_E, WARPS_N * SPLIT
    )
    if gl.program_id(1) >= num_tiles:
        return

    # Stacked slices: row u of x's tile is row u % BLOCK_M at K offset (u // BLOCK_M) * BLOCK_K.
    u_U = gl.arange(0, SPLIT * BLOCK_M, layout=gl.SliceLayout(1, x_l))
    m_U, slice_U = _unstacked(u_U, BLOCK_M, SPLIT)
    rows_U = row0 + m_U
    if CLAMP_ROWS:  # rows past the tile's last read that row again (see `GemmTile.clamp_rows`)
        rows_U = gl.minimum(rows_U, rows_end - 1)
    row_ok_U = rows_U < rows_end
    x_rows_U = rows_U.to(gl.int64)
    if GATHER:  # x holds tokens: row a of the product is token order[a] // top_k
        x_rows_U = rows_of(order_A + rows_U, row_ok_U, 0, CLAMP_ROWS).to(gl.int64) // top_k
    k_K = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, x_l))
    if X_PERMUTED:  # real k at its place in `launch.permuted_rows`' order, in 8-value pieces
        Q: gl.constexpr = BLOCK_K // 4  # of the step's K per lane of a quad
        k_K = 8 * (4 * ((k_K % Q) // 8) + k_K // Q) + k_K % 8
        k_K = gl.max_contiguous(gl.multiple_of(k_K, 8), 8)  # else Triton loads 2 bytes at a time
    x_ptrs = x_AK + x_rows_U[:, None] * K + k_K[None, :]

    # Likewise row v of the weights' tile is column v % BLOCK_N at slice v // BLOCK_N.
    v_V = gl.arange(0, SPLIT * BLOCK_N, layout=gl.SliceLayout(1, words_l))
    n_V, slice_V = _unstacked(v_V, BLOCK_N, SPLIT)
    w_rows_V = expert.to(gl.int64) * N + (gl.program_id(0) * BLOCK_N + n_V)
    s_V = gl.load(scale_G + w_rows_V // rows_per_group) * GLOBAL_SCALE_BIAS
    word_W = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, words_l))
    word_ptrs = codes_ENW + w_rows_V[:, None] * (K // 8) + word_W[None, :]
    if LOOKUP:  # block scales per block, and each block's byte tables built once
        blocks_l: gl.constexpr = blocks_layout(BLOCK_N, BLOCK_K, WARPS_N, SPLIT)
        v_B = gl.arange(0, SPLIT * BLOCK_N, layout=gl.SliceLayout(1, blocks_l))
        n_B, slice_B = _unstacked(v_B, BLOCK_N, SPLIT)
        w_rows_B = expert.to(gl.int64) * N + (gl.program_id(0) * BLOCK_N + n_B)
        s_rows = gl.load(scale_G + w_rows_B // rows_per_group) * GLOBAL_SCALE_BIAS
        block_B = gl.arange(0, BLOCK_K // 16, layout=gl.SliceLayout(0, blocks_l))
        scale_ptrs = block_scale_ENB + w_rows_B[:, None] * (K // 16) + block_B[None, :]
        slice_S = slice_B
    else:  # a word's block scale: one byte per two words (a block is 16 codes)
        scale_ptrs = block_scale_ENB + w_rows_V[:, None] * (K // 16) + (word_W // 2)[None, :]
        slice_S = slice_V
        s_rows = s_V
    if SPLIT > 1:  # slice s starts s * BLOCK_K into each step
        x_ptrs += (slice_U * BLOCK_K)[:, None]
        word_ptrs += (slice_V * (BLOCK_K // 8))[:, None]
        scale_ptrs += (slice_S * (BLOCK_K // 16))[:, None]

    acc = gl.zeros(_stacked_shape(SPLIT, [BLOCK_N, BLOCK_M]), gl.float32, layout=mma)
    words = gl.load(word_ptrs)
    scales = gl.load(scale_ptrs)
    if UNROLL:  # K known at compile time: the steps unrolled there (`UNROLL_MAX_STEPS`)
        for k in gl.static_range(0, K, STEP):
            acc, words, scales, word_ptrs, scale_ptrs, x_ptrs = _k_step(
                acc, words, scales, word_ptrs, scale_ptrs, x_ptrs, k + STEP < K, row_ok_U,
                s_rows, weights_l, rows_l, words_l, BLOCK_N, BLOCK_K, SPLIT, PREFETCH, LOOKUP,
                CLAMP_ROWS,
            )  # fmt: skip
    else:
        for k in range(0, K, STEP):
            acc, words, scales, word_ptrs, scale_ptrs, x_ptrs = _k_step(
                acc, words, scales, word_ptrs, scale_ptrs, x_ptrs, k + STEP < K, row_ok_U,
                s_rows, weights_l, rows_l, words_l, BLOCK_N, BLOCK_K, SPLIT, PREFETCH, LOOKUP,
                CLAMP_ROWS,
            )  # fmt: skip

    if SPLIT > 1:  # the slices' sums added in a fixed order (across warps: shared memory)
        acc_NM = gl.sum(acc, 0)
        out_l: gl.constexpr = gl.SliceLayout(0, mma)
    else:
        acc_NM = acc
        out_l: gl.constexpr = mma
    cols_out = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_l))
    rows_out = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_l))
    y_ptrs = y_AN + rows_out.to(gl.int64)[None, :] * N + cols_out[:, None]
    gl.store(y_ptrs, acc_NM.to(gl.bfloat16), mask=(rows_out < rows_end)[None, :])


# Decode by byte-table lookup (`fragments`; tiles with BLOCK_K >= 64) rather than by arithmetic
# per code (`_decode`): 4.5 against 7.0 loop instructions per weight at a 16:64:256 tile
# (SASS for sm_90, `python benchmarks/sass.py`); 1.04-1.18x faster from 1 to 256 tokens
# even before its tables were built by doubling (one H200, `python benchmarks/moe.py`,
# BENCHMARKS.md "Routed-expert GEMM: the register kernel"). Both are the contract's bits; the
# arithmetic decode stays for 32-wide K steps, whose blocks span two threads, and as the
# lookup's reference in the GPU tests.
LOOKUP = True

# Reductions of at most this many K steps unroll their loop at compile time (`_k_step`, the same
# products in the same order): each step's prefetched words land in registers of their own
# instead of being copied over the last step's, the increments become constant offsets, and
# ptxas interleaves one step's loads with the last one's decode. On one H200 the 8-row tile ran
# 1.02-1.17x faster from 1 to 64 tokens (w13's 8 steps, w2's 3), bitwise the loop's; the
# unrolled w13 is about 62 KB of code, whose fetch its warps already wait on (`python
# benchmarks/moe.py`, ncu; BENCHMARKS.md "Routed-expert GEMM: the K loop unrolled at compile
# time"). The 16-step reductions of the 128-wide K steps (w13 under the medium and wide tiles,
# which other GPUs than Hopper take) keep the loop: twice that code, not measured.
UNROLL_MAX_STEPS = 8


def check_tile(
    block_m: int, block_n: int, block_k: int, num_warps: int, n: int, k: int, split_k: int = 1
) -> None:
    """Raise ValueError naming the value unless the tile fits these fragments and the weight's
    N and K (``split_k`` of the warps along K, the rest along N)."""
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"register tile: num_warps must be 1, 2, 4 or 8; got {num_warps}")
    if split_k not in (1, 2, 4, 8) or num_warps % split_k:
        raise ValueError(
            f"register tile: split_k must be 1, 2, 4 or 8 and divide num_warps={num_warps}; "
            f"got {split_k}"
        )
    if block_m < 8:
        raise ValueError(f"register tile: block_m must be at least 8 (the MMA's n8); got {block_m}")
    if block_n < 16 * (num_warps // split_k):
        raise ValueError(
            f"register tile: block_n={block_n} must be at least 16 x num_warps={num_warps}"
            + (f" // split_k={split_k}" if split_k > 1 else "")
        )
    if block_k < 32:
        raise ValueError(f"register tile: block_k must be at least 32; got {block_k}")
    if n % block_n or k % (block_k * split_k):
        raise ValueError(
            f"register tile {block_n}x{block_k} (block_n x block_k), split_k={split_k}: block_n "
            f"and block_k x split_k must divide the weight's N={n} and K={k}"
        )


def launch_kernel(grid, x_AK, members, counts_E, y_AN, order_A, *, A, E, N, K, rows_per_group,
                  top_k, tile, x_permuted=False) -> None:  # fmt: skip
    """Launch over ``grid`` with `moe_gemm.launch`'s checked arguments (``members``: the codes
    as int32, the block scales as bytes, the global scale per group; ``x_permuted``: x's rows
    in `launch.permuted_rows`' order for ``tile.block_k``)."""
    check_tile(tile.block_m, tile.block_n, tile.block_k, tile.num_warps, N, K, tile.split_k)
    _moe_gemm_registers_kernel[grid](
        x_AK, *members, counts_E, y_AN, x_AK if order_A is None else order_A,
        A, E, rows_per_group, top_k,
        N=N, K=K, GATHER=order_A is not None,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        BLOCK_E=triton.next_power_of_2(E), PREFETCH=tile.num_stages >= 2,
        LOOKUP=LOOKUP and tile.block_k >= 64, WARPS_N=tile.num_warps // tile.split_k,
        SPLIT=tile.split_k, CLAMP_ROWS=tile.clamp_rows,
        UNROLL=K // (tile.block_k * tile.split_k) <= UNROLL_MAX_STEPS, X_PERMUTED=x_permuted,
        num_warps=tile.num_warps,
        # Products feed additions only inside the MMA; no FMA may merge the two scalings.
        enable_fp_fusion=False,
        **dependent_launch.keywords(x_AK.device),
    )  # fmt: skip
