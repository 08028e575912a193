"""`@triton.jit` loads and stores of one chunk (BLOCK_R rows x BLOCK_K columns of x) of ``[R, K]``.

Every kernel walks its rows in chunks of BLOCK_K columns and sees a chunk as pairs
``[BLOCK_R, NB, 8]`` (``NB = BLOCK_K // 16`` blocks of 8 (even, odd) element pairs): the even
element of a pair goes to a byte's low nibble and the odd one to its high nibble, so splitting
the pair dimension right after the load packs codes without moving data between threads. K is a
multiple of 16 and BLOCK_K a power of two >= 16, so a chunk never splits a block.

The per-row arrays a chunk touches have K / DIV entries per row: x and its fake-quant output
(DIV 1), packed codes and bf16 x seen as int32 pairs (2), compact mantissa bits (8), block
scales (16).
"""

import triton
import triton.language as tl

from fp4rl.kernels.numerics import round_to


@triton.jit
def chunk_offsets(rows_R, row_ok_R, k0, K, DIV: tl.constexpr, WIDTH: tl.constexpr):
    """Offsets ``[BLOCK_R, WIDTH]`` (int64) and mask of the chunk at column k0 of x in an array
    with ``K // DIV`` entries per row."""
    cols_W = k0 // DIV + tl.arange(0, WIDTH)
    offsets = rows_R.to(tl.int64)[:, None] * (K // DIV) + cols_W[None, :]
    return offsets, row_ok_R[:, None] & (cols_W < K // DIV)[None, :]


@triton.jit
def load_pairs(x_RK, rows_R, row_ok_R, k0, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """x's chunk upcast exactly to FP32, as (even, odd) ``[BLOCK_R, NB, 8]``; 0 outside x.

    bf16 x arrives as int32 pairs (`launch.pair_view`): a pair's two FP32 values are its high
    and low halves moved to the top, two integer ops and no data movement between threads.
    """
    if x_RK.dtype.element_ty == tl.int32:
        offsets, mask = chunk_offsets(rows_R, row_ok_R, k0, K, 2, BLOCK_K // 2)
        pairs = tl.load(x_RK + offsets, mask=mask, other=0)
        pairs = tl.reshape(pairs, [BLOCK_R, BLOCK_K // 16, 8])
        return (pairs << 16).to(tl.float32, bitcast=True), (pairs & -65536).to(
            tl.float32, bitcast=True
        )
    offsets, mask = chunk_offsets(rows_R, row_ok_R, k0, K, 1, BLOCK_K)
    x_RC = tl.load(x_RK + offsets, mask=mask, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x_RC, [BLOCK_R, BLOCK_K // 16, 8, 2]))


@triton.jit
def load_code_pairs(
    codes_RK2, rows_R, row_ok_R, k0, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Packed E2M1 codes as (even, odd) int32 codes ``[BLOCK_R, NB, 8]``."""
    offsets, mask = chunk_offsets(rows_R, row_ok_R, k0, K, 2, BLOCK_K // 2)
    packed = tl.load(codes_RK2 + offsets, mask=mask, other=0).to(tl.int32)
    packed = tl.reshape(packed, [BLOCK_R, BLOCK_K // 16, 8])
    return packed & 0xF, packed >> 4


@triton.jit
def load_bit_pairs(bits_RK8, rows_R, row_ok_R, k0, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Compact mantissa bits (element 8j+b in bit b of byte j) as (even, odd) ``[BLOCK_R, NB,
    8]``. Pair p holds elements 2p and 2p+1: both in byte p // 4, at bits 2(p % 4) and +1."""
    pairs_P = tl.arange(0, BLOCK_K // 2)
    cols_P = k0 // 8 + pairs_P // 4
    offsets = rows_R.to(tl.int64)[:, None] * (K // 8) + cols_P[None, :]
    mask = row_ok_R[:, None] & (cols_P < K // 8)[None, :]
    byte = tl.load(bits_RK8 + offsets, mask=mask, other=0).to(tl.int32)
    shift = (2 * (pairs_P % 4))[None, :]
    even = tl.reshape((byte >> shift) & 1, [BLOCK_R, BLOCK_K // 16, 8])
    odd = tl.reshape((byte >> (shift + 1)) & 1, [BLOCK_R, BLOCK_K // 16, 8])
    return even, odd


@triton.jit
def load_block_scale_bytes(block_scale_RKB, rows_R, row_ok_R, k0, K, BLOCK_K: tl.constexpr):
    """float8_e4m3fn block scales (stored as uint8) as int32 bytes ``[BLOCK_R, NB]``."""
    offsets, mask = chunk_offsets(rows_R, row_ok_R, k0, K, 16, BLOCK_K // 16)
    return tl.load(block_scale_RKB + offsets, mask=mask, other=0).to(tl.int32)


@triton.jit
def store_codes(
    codes_RK2,
    block_scale_RKB,
    rows_R,
    row_ok_R,
    k0,
    K,
    code_even,
    code_odd,
    block_scale_byte,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Pack (even, odd) int32 codes two to a byte and store them with the block-scale bytes."""
    packed = tl.reshape(code_even | (code_odd << 4), [BLOCK_R, BLOCK_K // 2]).to(tl.uint8)
    offsets, mask = chunk_offsets(rows_R, row_ok_R, k0, K, 2, BLOCK_K // 2)
    tl.store(codes_RK2 + offsets, packed, mask=mask)
    offsets, mask = chunk_offsets(rows_R, row_ok_R, k0, K, 16, BLOCK_K // 16)
    tl.store(block_scale_RKB + offsets, block_scale_byte.to(tl.uint8), mask=mask)


@triton.jit
def store_values(
    out_RK, rows_R, row_ok_R, k0, K, even, odd, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr
):
    """Interleave (even, odd) FP32 values back into the chunk and store them in out's dtype."""
    values_RC = tl.reshape(tl.join(even, odd), [BLOCK_R, BLOCK_K])
    offsets, mask = chunk_offsets(rows_R, row_ok_R, k0, K, 1, BLOCK_K)
    tl.store(out_RK + offsets, round_to(values_RC, out_RK.dtype.element_ty), mask=mask)


@triton.jit
def row_amax(
    x_RK, rows_R, row_ok_R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """``(max |x|, all finite)`` of each of the BLOCK_R rows, walking them chunk by chunk.

    Accumulates elementwise and reduces once after the loop, so the loop has no cross-thread
    shuffles. A non-finite value is flagged by summing ``x * 0`` (NaN for inf and NaN) with
    multiply-adds: the GPU's `max.f32` drops NaN, so the max alone cannot tell.
    """
    amax = tl.zeros([BLOCK_R, BLOCK_K // 16, 8], tl.float32)
    poison = tl.zeros([BLOCK_R, BLOCK_K // 16, 8], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        even, odd = load_pairs(x_RK, rows_R, row_ok_R, k0, K, BLOCK_R, BLOCK_K)
        amax = tl.maximum(amax, tl.maximum(tl.abs(even), tl.abs(odd)))
        poison = tl.fma(even, 0.0, tl.fma(odd, 0.0, poison))
    return reduce_rows(amax, poison)


@triton.jit
def pairs_amax(even, odd):
    """`row_amax` of one chunk already in registers (rows that fit in a single chunk)."""
    return reduce_rows(tl.maximum(tl.abs(even), tl.abs(odd)), tl.fma(even, 0.0, odd * 0.0))


@triton.jit
def reduce_rows(amax, poison):
    """Per-row ``(max, all finite)`` of elementwise ``[BLOCK_R, NB, 8]`` accumulators."""
    amax_R = tl.max(tl.max(amax, axis=2), axis=1)
    return amax_R, tl.sum(tl.sum(poison, axis=2), axis=1) == 0.0
