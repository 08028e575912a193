"""`@triton.jit` loads and stores of one chunk (BLOCK_R rows x BLOCK_K columns) of ``[R, K]``.

Every kernel walks its rows in chunks of BLOCK_K columns (a power of two >= 16, so a chunk never
splits a 16-value block) and sees a chunk as (even, odd) element pairs ``[BLOCK_R, NB, 8]``:
NB = BLOCK_K // 16 blocks of 8 pairs. The even element of a pair goes to a byte's low nibble and
the odd one to its high nibble, so codes pack without moving data between threads.

A block is loaded as its two halves (4 pairs each: 16 bytes of bf16 x, 4 bytes of codes), two
loads of ``[BLOCK_R, NB, 4]`` joined along a new last axis. Triton lays both loads out alike and
keeps a joined axis in registers, so each thread holds whole blocks whatever its version's
layout heuristics: block maxima are reduced without shuffles and each block's scale is computed
once, by the thread that owns it. Joined and reshaped, the pair axis runs ``i = 2 * j + h`` for
pair ``j`` of half ``h``, i.e. pair ``q = 4 * h + j`` of the block; every load and store here
uses that order, so kernels never see it.

Block-level values are ``[BLOCK_R, NB]`` (`per_block` lifts them onto the pairs), row-level ones
``[BLOCK_R]`` (`per_row`). The arrays a chunk touches have ``PER_BLOCK`` entries per block:
x as int32 pairs and packed codes 8, x as elements 16, block scales 1.

`quantize_chunk` is the round-to-nearest work on one loaded chunk, shared by the quantize kernels
that differ only in how they find each row's global scale (`nearest`, `expert_quant`).
"""

import triton
import triton.language as tl

from fp4rl.kernels.numerics import (
    block_ratio,
    block_reciprocal,
    code_byte,
    e2m1_round,
    e4m3_rne_satfinite,
    global_scale_from_amax,
    is_finite,
    max_nan,
    nan_like,
    ratio_divisor,
    round_to,
    scale_back,
    with_sign_of,
)
from fp4rl.kernels.packed_words import page_words


@triton.jit
def program_rows(R, BLOCK_R: tl.constexpr):
    """This program's rows ``[BLOCK_R]`` and which of them exist (the last program's may not)."""
    rows_R = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows_R, rows_R < R


@triton.jit
def per_block(v_RB):
    """A ``[BLOCK_R, NB]`` block value broadcastable against ``[BLOCK_R, NB, 8]`` pairs."""
    return v_RB[:, :, None]


@triton.jit
def per_row(v_R):
    """A ``[BLOCK_R]`` row value broadcastable against ``[BLOCK_R, NB, 8]`` pairs."""
    return v_R[:, None, None]


@triton.jit
def half_offsets(rows_R, row_ok_R, k0, K, PER_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Offsets ``[BLOCK_R, NB, PER_BLOCK // 2]`` (int64) and mask of the first half of each of
    the chunk's blocks (add ``PER_BLOCK // 2`` for the second) in an array with PER_BLOCK entries
    per block."""
    blocks_B = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    offsets = (
        per_row(rows_R.to(tl.int64)) * (K // 16 * PER_BLOCK)
        + blocks_B[None, :, None] * PER_BLOCK
        + tl.arange(0, PER_BLOCK // 2)[None, None, :]
    )
    return offsets, per_row(row_ok_R) & (blocks_B < K // 16)[None, :, None]


@triton.jit
def join_halves(first, second):
    """``[BLOCK_R, NB, W]`` halves -> ``[BLOCK_R, NB, 2 * W]`` in the pair order above."""
    return tl.reshape(tl.join(first, second), [first.shape[0], first.shape[1], 2 * first.shape[2]])


@triton.jit
def split_halves(v):
    """The inverse of `join_halves`."""
    return tl.split(tl.reshape(v, [v.shape[0], v.shape[1], v.shape[2] // 2, 2]))


@triton.jit
def block_offsets(rows_R, row_ok_R, k0, K, BLOCK_K: tl.constexpr):
    """Offsets ``[BLOCK_R, NB]`` and mask of the chunk's blocks in a ``[R, K // 16]`` array."""
    blocks_B = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    offsets = rows_R.to(tl.int64)[:, None] * (K // 16) + blocks_B[None, :]
    return offsets, row_ok_R[:, None] & (blocks_B < K // 16)[None, :]


@triton.jit
def load_halves(ptr, rows_R, row_ok_R, k0, K, PER_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Both halves of every block of the chunk, joined: ``[BLOCK_R, NB, PER_BLOCK]``."""
    offsets, mask = half_offsets(rows_R, row_ok_R, k0, K, PER_BLOCK, BLOCK_K)
    first = tl.load(ptr + offsets, mask=mask, other=0)
    second = tl.load(ptr + offsets + PER_BLOCK // 2, mask=mask, other=0)
    return join_halves(first, second)


@triton.jit
def permuted_shift(pieces, PERMUTE_BY: tl.constexpr):
    """How far, in values, each of ``pieces`` (indices of 8-value pieces along a row) moves in
    `launch.permuted_rows`' order of K steps of PERMUTE_BY: within a step, piece j
    of quarter c goes to place ``4 * j + c``."""
    PIECES: tl.constexpr = PERMUTE_BY // 8  # a step's
    QUARTER: tl.constexpr = PIECES // 4
    local = pieces % PIECES
    return 8 * (4 * (local % QUARTER) + local // QUARTER - local)


@triton.jit
def store_halves(ptr, rows_R, row_ok_R, k0, K, v, BLOCK_K: tl.constexpr,
                 PERMUTE_BY: tl.constexpr = 0):  # fmt: skip
    """Store ``[BLOCK_R, NB, PER_BLOCK]`` values held in the joined order. With PERMUTE_BY
    (values, PER_BLOCK 16) each block's two halves, one piece of 8 each, go where
    `launch.permuted_rows` puts them for K steps of that width."""
    first, second = split_halves(v)
    offsets, mask = half_offsets(rows_R, row_ok_R, k0, K, v.shape[2], BLOCK_K)
    second_offsets = offsets + v.shape[2] // 2
    if PERMUTE_BY:
        pieces = 2 * (k0 // 16 + tl.arange(0, BLOCK_K // 16))[None, :, None]
        offsets += permuted_shift(pieces, PERMUTE_BY)
        second_offsets += permuted_shift(pieces + 1, PERMUTE_BY)
    tl.store(ptr + offsets, first, mask=mask)
    tl.store(ptr + second_offsets, second, mask=mask)


@triton.jit
def load_raw(x_RK, rows_R, row_ok_R, k0, K, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
    """x's chunk as stored, 0 outside x: bf16 as int32 pairs (`launch.pair_view`) ``[BLOCK_R,
    NB, 8]``, other dtypes as values ``[BLOCK_R, NB, 16]`` (`unpack_raw` upcasts either).

    Split from the upcast so that a kernel can issue the next chunk's loads before it works on
    this one; EVICT is `tl.load`'s L2 eviction policy ("" for the default).
    """
    if x_RK.dtype.element_ty == tl.int32:
        offsets, mask = half_offsets(rows_R, row_ok_R, k0, K, 8, BLOCK_K)
        first = tl.load(x_RK + offsets, mask=mask, other=0, eviction_policy=EVICT)
        second = tl.load(x_RK + offsets + 4, mask=mask, other=0, eviction_policy=EVICT)
    else:
        offsets, mask = half_offsets(rows_R, row_ok_R, k0, K, 16, BLOCK_K)
        first = tl.load(x_RK + offsets, mask=mask, other=0, eviction_policy=EVICT)
        second = tl.load(x_RK + offsets + 8, mask=mask, other=0, eviction_policy=EVICT)
    return join_halves(first, second)


@triton.jit
def unpack_raw(raw):
    """A `load_raw` chunk upcast exactly to FP32, as (even, odd) ``[BLOCK_R, NB, 8]``.

    A bf16 pair's two FP32 values are its low and high halves moved to the top, one integer op
    each and no data movement between threads.
    """
    if raw.dtype == tl.int32:
        even = (raw << 16).to(tl.float32, bitcast=True)
        odd = (raw & -65536).to(tl.float32, bitcast=True)
    else:
        values = raw.to(tl.float32)
        # Joined halves of 8 values: element e of half h sits at 2 * e + h; pair j of half h is
        # elements 2j, 2j + 1, i.e. positions 4j + h and 4j + 2 + h, and must land at 2j + h.
        values = tl.reshape(values, [values.shape[0], values.shape[1], 4, 2, 2])
        values = tl.permute(values, [0, 1, 2, 4, 3])
        even, odd = tl.split(tl.reshape(values, [values.shape[0], values.shape[1], 8, 2]))
    return even, odd


@triton.jit
def load_pairs(x_RK, rows_R, row_ok_R, k0, K, BLOCK_K: tl.constexpr):
    """x's chunk upcast exactly to FP32, as (even, odd) ``[BLOCK_R, NB, 8]``; 0 outside x."""
    return unpack_raw(load_raw(x_RK, rows_R, row_ok_R, k0, K, BLOCK_K, ""))


@triton.jit
def store_values(out_RK, rows_R, row_ok_R, k0, K, even, odd, BLOCK_K: tl.constexpr,
                 PERMUTE_BY: tl.constexpr = 0):  # fmt: skip
    """Interleave (even, odd) FP32 values back into the chunk and store them in out's dtype
    (with PERMUTE_BY in `store_halves`' permuted order)."""
    values = tl.reshape(tl.join(even, odd), [even.shape[0], even.shape[1], 4, 2, 2])
    values = tl.reshape(tl.permute(values, [0, 1, 2, 4, 3]), [even.shape[0], even.shape[1], 16])
    store_halves(
        out_RK, rows_R, row_ok_R, k0, K, round_to(values, out_RK.dtype.element_ty), BLOCK_K,
        PERMUTE_BY,
    )  # fmt: skip


@triton.jit
def load_code_pairs(codes_RK2, rows_R, row_ok_R, k0, K, BLOCK_K: tl.constexpr):
    """Packed E2M1 codes as (even, odd) int32 codes ``[BLOCK_R, NB, 8]``."""
    packed = load_halves(codes_RK2, rows_R, row_ok_R, k0, K, 8, BLOCK_K).to(tl.int32)
    return packed & 0xF, packed >> 4


@triton.jit
def store_codes(
    codes_RK8, block_scale_RKB, rows_R, row_ok_R, k0, K, packed, block_scale_byte,
    BLOCK_K: tl.constexpr, PAGE_SIGNS: tl.constexpr = False,
):  # fmt: skip
    """Store each pair's code byte (``packed``, integers below 256 in the pair order above) and
    the block-scale bytes. ``codes_RK8`` is the packed codes seen as int32 words
    (`launch.word_view`): a half block's four bytes are summed into one word by multiplies,
    which the GPU runs on its multiply-add units, rather than assembled with byte permutes; a
    block's two words go out as one 8-byte store. With PAGE_SIGNS the words' sign bits go where
    KV pages keep them (`packed_words.page_words`)."""
    first, second = split_halves(packed.to(tl.int32))  # [BLOCK_R, NB, 4] bytes of each half
    weight = (1 << (8 * tl.arange(0, 4)))[None, None, :]
    words = tl.join(tl.sum(first * weight, axis=2), tl.sum(second * weight, axis=2))
    if PAGE_SIGNS:
        words = page_words(words)
    offsets, mask = block_offsets(rows_R, row_ok_R, k0, K, BLOCK_K)
    word_offsets = 2 * offsets[:, :, None] + tl.arange(0, 2)[None, None, :]
    tl.store(codes_RK8 + word_offsets, words, mask=mask[:, :, None])
    tl.store(block_scale_RKB + offsets, block_scale_byte.to(tl.uint8), mask=mask)


@triton.jit
def load_bit_pairs(bits_RK8, rows_R, row_ok_R, k0, K, BLOCK_K: tl.constexpr):
    """Compact mantissa bits (element 8j+b in bit b of byte j) as (even, odd) ``[BLOCK_R, NB,
    8]``. A block's 16 bits are two bytes; its pair q holds bits 2q and 2q + 1."""
    offsets, mask = block_offsets(rows_R, row_ok_R, k0, K, BLOCK_K)
    low = tl.load(bits_RK8 + 2 * offsets, mask=mask, other=0).to(tl.int32)
    high = tl.load(bits_RK8 + 2 * offsets + 1, mask=mask, other=0).to(tl.int32)
    i = tl.arange(0, 8)
    pair = 4 * (i % 2) + i // 2  # the pair order above
    bits = per_block(low | (high << 8)) >> (2 * pair)[None, None, :]
    return bits & 1, (bits >> 1) & 1


@triton.jit
def load_block_scale_bytes(block_scale_RKB, rows_R, row_ok_R, k0, K, BLOCK_K: tl.constexpr):
    """float8_e4m3fn block scales (stored as uint8) as int32 bytes ``[BLOCK_R, NB]``."""
    offsets, mask = block_offsets(rows_R, row_ok_R, k0, K, BLOCK_K)
    return tl.load(block_scale_RKB + offsets, mask=mask, other=0).to(tl.int32)


@triton.jit
def block_amax(even, odd):
    """``max |x|`` of each block, ``[BLOCK_R, NB]``: inf if the block holds an inf, NaN if it
    holds a NaN (the maximum propagates NaN), so the block maximum also says whether the block
    is finite. Reduced within each thread (see the module docstring)."""
    return tl.reduce(max_nan(tl.abs(even), tl.abs(odd)), 2, max_nan)


@triton.jit
def row_amax(
    x_RK, rows_R, row_ok_R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    """``max |x|`` of each of the BLOCK_R rows (NaN-propagating), walking them chunk by chunk.

    Accumulates block maxima and reduces across threads once, after the loop.
    """
    amax = tl.zeros([BLOCK_R, BLOCK_K // 16], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        even, odd = load_pairs(x_RK, rows_R, row_ok_R, k0, K, BLOCK_K)
        amax = max_nan(amax, block_amax(even, odd))
    return tl.reduce(amax, 1, max_nan)


@triton.jit
def quantize_chunk(
    x_even, x_odd, block_amax_RB, s_R, scale_R, d_scaled_R, reciprocal_R, out_RK, codes_RK8,
    block_scale_RKB, rows_R, row_ok_R, k0, K, POISON_BLOCKS: tl.constexpr, FAKE: tl.constexpr,
    BLOCK_K: tl.constexpr, PAGE_SIGNS: tl.constexpr = False, PERMUTE_BY: tl.constexpr = 0,
):  # fmt: skip
    """Quantize a loaded chunk (`load_pairs`, its `block_amax`) under the rows' global scales
    ``s_R`` (with ``scale_R, d_scaled_R, reciprocal_R`` from `numerics.ratio_divisor`) and store
    its codes and block-scale bytes (with PAGE_SIGNS in KV pages' layout), or with FAKE its
    dequantized values in ``out_RK``'s dtype (with PERMUTE_BY in `store_halves`' permuted
    order).

    A non-finite x makes its group's scale NaN, and so every block scale of the group; under a
    caller's scale (POISON_BLOCKS) the blocks holding inf/NaN are poisoned alone.
    """
    s_RB = s_R[:, None]
    ratio = block_ratio(block_amax_RB, s_RB, scale_R[:, None], d_scaled_R[:, None],
                        reciprocal_R[:, None])  # fmt: skip
    block_byte, block_scale = e4m3_rne_satfinite(ratio)
    if POISON_BLOCKS:
        bad = ~is_finite(block_amax_RB)
        block_byte = tl.where(bad, 0x7F, block_byte)
        block_scale = tl.where(bad, nan_like(block_scale), block_scale)
    live, recip = block_reciprocal(block_scale, s_RB)
    # Dead blocks (zero or NaN scale) round everything to +0: no saturation cap, no sign.
    cap = per_block(tl.where(live, 6.0, 0.0))
    sign_mask = per_block(tl.where(live, -0x80000000, 0))
    y_even, y_odd = x_even * per_block(recip), x_odd * per_block(recip)
    q_even = with_sign_of(e2m1_round(y_even, cap), y_even, sign_mask)
    q_odd = with_sign_of(e2m1_round(y_odd, cap), y_odd, sign_mask)
    if FAKE:
        sf, s = per_block(block_scale), per_row(s_R)
        store_values(
            out_RK, rows_R, row_ok_R, k0, K, scale_back(q_even, sf, s), scale_back(q_odd, sf, s),
            BLOCK_K, PERMUTE_BY,
        )  # fmt: skip
    else:
        store_codes(
            codes_RK8, block_scale_RKB, rows_R, row_ok_R, k0, K, code_byte(q_even, q_odd),
            block_byte, BLOCK_K, PAGE_SIGNS,
        )  # fmt: skip
    return q_even, q_odd, block_byte


@triton.jit
def store_record(
    record_RK, record_block_scale_RKB, record_global_scale_R, record_rows_R, row_ok_R, k0, K,
    q_even, q_odd, block_byte, s_R, RECORD: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Store a quantized chunk (`quantize_chunk`'s returns) as a site's record at rows
    ``record_rows_R``: with RECORD 1 ("full") its codes (``record_RK`` the packed codes as int32
    words, `launch.word_view`), with RECORD 2 ("compact") its mantissa bits (``record_RK`` the
    bits as int16, a block's 16 in one), and either way the block-scale bytes and, from the
    chunk at column 0, the rows' FP32 global scales ``s_R``. RECORD 0 stores nothing."""
    if RECORD != 0:
        packed = code_byte(q_even, q_odd)
        if RECORD == 1:
            store_codes(
                record_RK, record_block_scale_RKB, record_rows_R, row_ok_R, k0, K, packed,
                block_byte, BLOCK_K,
            )  # fmt: skip
        else:
            # A pair's two mantissa bits (bit 0 of each nibble) go to bits 2q and 2q + 1 of its
            # block's 16 for pair q of the block (the pair order above); bits do not overlap.
            bits = ((packed & 1) | ((packed >> 3) & 2)).to(tl.int32)
            i = tl.arange(0, 8)
            pair = 4 * (i % 2) + i // 2
            block_bits = tl.sum(bits << (2 * pair)[None, None, :], axis=2)
            offsets, mask = block_offsets(record_rows_R, row_ok_R, k0, K, BLOCK_K)
            tl.store(record_RK + offsets, block_bits.to(tl.int16), mask=mask)
            tl.store(record_block_scale_RKB + offsets, block_byte.to(tl.uint8), mask=mask)
        tl.store(record_global_scale_R + record_rows_R, s_R, mask=row_ok_R & (k0 == 0))


@triton.jit
def fake_quantize_rows(
    x_even, x_odd, out_RK, rows_R, row_ok_R, K, record_RK, record_block_scale_RKB,
    record_global_scale_R, record_rows_R, RECORD: tl.constexpr, BLOCK_K: tl.constexpr,
    PERMUTE_BY: tl.constexpr = 0,
):  # fmt: skip
    """Whole rows held as pairs (one chunk, BLOCK_K >= K) stored as their per-row
    round-to-nearest fake quantization in ``out_RK``'s dtype: each row's global scale from its
    amax, then `quantize_chunk` with FAKE, what `nearest`'s kernel stores for such rows (with
    PERMUTE_BY in `store_halves`' permuted order); with RECORD also the site's record of them
    at rows ``record_rows_R`` (`store_record`, in real order)."""
    block_amax_RB = block_amax(x_even, x_odd)
    amax_R = tl.reduce(block_amax_RB, 1, max_nan)
    s_R = global_scale_from_amax(amax_R, is_finite(amax_R))
    scale_R, d_scaled_R, reciprocal_R = ratio_divisor(s_R)
    q_even, q_odd, block_byte = quantize_chunk(
        x_even, x_odd, block_amax_RB, s_R, scale_R, d_scaled_R, reciprocal_R, out_RK, out_RK,
        out_RK, rows_R, row_ok_R, 0, K, POISON_BLOCKS=False, FAKE=True, BLOCK_K=BLOCK_K,
        PERMUTE_BY=PERMUTE_BY,
    )  # fmt: skip
    store_record(
        record_RK, record_block_scale_RKB, record_global_scale_R, record_rows_R, row_ok_R, 0, K,
        q_even, q_odd, block_byte, s_R, RECORD, BLOCK_K,
    )  # fmt: skip
