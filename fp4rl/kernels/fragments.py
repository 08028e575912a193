"""NVFP4 codes decoded straight into the register fragments of ``mma.sync.m16n8k16``.

The Gluon kernels that multiply NVFP4 values on the tensor cores without passing them through
shared memory (`moe_gemm_registers`: expert weights; `paged_attention_registers`: K and V
pages) share these pieces: the reduction order that makes a thread's fragment one packed word,
and the byte-table decode.

The order. A thread of an m16n8k16 fragment holds, per row (operand A) or column (operand B)
and per 32 values of the reduction, the 8 hardware positions ``{2c, 2c + 1, 2c + 8, 2c + 9} +
{0, 16}`` (c its lane's index in a quad). A dot product does not care in which order it is
summed, so real k is assigned to those positions such that a thread's 8 are the 8 codes of one
packed int32 word: for a reduction of ``BLOCK_K`` (``CH = BLOCK_K // 32`` chunks), word ``c * CH
+ ch`` fills chunk ``ch`` of quad position c, its code ``J = 4 t + 2 b2 + b0`` at hardware
position ``32 ch + 16 t + 8 b2 + 2 c + b0`` (`hardware_order`). The other operand is loaded in
real order and put in the same order; both reorderings are register renamings, which the
kernels check at compile time (``convert_layout(..., assert_trivial=True)``).

The decode. A block's 16 codes can take only 8 magnitudes, so a kernel first computes, per
block, those 8 BF16 values and splits them into byte tables (`byte_tables`: four of the
contract's products, and the other four as exact doublings of two of them); a word's 8 values
are then table lookups, sign flips and pairings by PRMT, 15 instructions for 8 values, 13 for
KV pages, whose sign bits sit where the flips take them (`look_up`). Each value is
``round_bf16((e2m1 * sf) * s)``, the bits `packed_words` defines (a negative code flips the sign
bit, as the symmetric rounding does).

Compiled only (sm_89 and newer): Triton's interpreter runs no Gluon.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def hardware_order(t, ROWS: gl.constexpr, BLOCK_K: gl.constexpr):
    """``[ROWS, BLOCK_K]`` from real K order to the fragments' order (the module docstring):
    word ``c * CH + ch``'s code ``J = 4 t + 2 b2 + b0`` to ``32 ch + 16 t + 8 b2 + 2 c + b0``."""
    CH: gl.constexpr = BLOCK_K // 32
    t = gl.reshape(t, [ROWS, 4, CH, 2, 2, 2])  # k = 8 * (c * CH + ch) + 4 t + 2 b2 + b0
    t = gl.permute(t, [0, 2, 3, 4, 1, 5])  # -> 32 ch + 16 t + 8 b2 + 2 c + b0
    return gl.reshape(t, [ROWS, BLOCK_K])


@gluon.jit
def byte_tables(sf, s):
    """The 8 BF16 magnitudes a block's codes can take, ``round((e2m1 * sf) * s)`` for the E2M1
    indices 0..7 (``sf`` the block scale's FP32 value, ``s`` the global scale times
    ``GLOBAL_SCALE_BIAS``), as byte tables for PRMT: (low bytes of indices 0-3, of 4-7, high
    bytes of 0-3, of 4-7), int32 each.

    Four entries are the contract's products, as the arithmetic decode computes them per code:
    0 (``0.5`` times 0: NaN where the scales make one), 0.5, 1 and 1.5. The other four are those
    of 1 and 1.5 doubled and quadrupled in BF16 (one ``fma.rn.bf16x2`` each): the same bits,
    because scaling by a power of two commutes with both roundings while the values stay normal,
    and every nonzero product of 1 or 1.5 is at least ``2**-9 * 2**-117``, the smallest E4M3
    scale times the smallest global scale the recipe keeps (`fp4rl.fp4.format.MIN_GLOBAL_SCALE`;
    below it the recipe writes 0). Overflow is inf either way. 15 instructions a block, against
    23 for eight products."""
    half = (2.0**-9 * sf) * s  # 0.5 * sf * 2**-8, as the biased code's product
    return gl.inline_asm_elementwise(
        """{ .reg .b32 p0, p1, p2, p3, two, four, nz;
        cvt.rn.bf16x2.f32 p0, $5, $4;
        cvt.rn.bf16x2.f32 p1, $7, $6;
        mov.b32 two, 0x40004000;
        mov.b32 four, 0x40804080;
        mov.b32 nz, 0x80008000;
        fma.rn.bf16x2 p2, p1, two, nz;
        fma.rn.bf16x2 p3, p1, four, nz;
        prmt.b32 $0, p0, p1, 0x6420;
        prmt.b32 $1, p2, p3, 0x6420;
        prmt.b32 $2, p0, p1, 0x7531;
        prmt.b32 $3, p2, p3, 0x7531; }""",
        "=r,=r,=r,=r,f,f,f,f",
        [
            half * 0.0,  # 0, or NaN where sf or s is NaN (or s inf), as `half`
            half,
            (2.0**-8 * sf) * s,
            (1.5 * 2.0**-8 * sf) * s,
        ],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
        is_pure=True,
        pack=1,
    )


@gluon.constexpr_function
def _look_up_asm(page_signs, packed):
    """`look_up`'s PTX: (template, constraints). Inputs follow the outputs (8 BF16 halves, or
    with ``packed`` 4 words of two)."""
    w = 4 if packed else 8  # the packed word's operand number
    if page_signs:
        signs_lo = f"lop3.b32 h0, h0, ${w}, 0x80808080, 0x78;"
        signs_hi = "lop3.b32 h1, h1, w4, 0x80808080, 0x78;"
    else:
        signs_lo = f"prmt.b32 sg, w4, ${w}, 0xD9C8; lop3.b32 h0, h0, sg, 0x80808080, 0x78;"
        signs_hi = f"prmt.b32 sg, w4, ${w}, 0xFBEA; lop3.b32 h1, h1, sg, 0x80808080, 0x78;"
    t = [f"${w + 1 + i}" for i in range(4)]  # lo0, lo1, hi0, hi1
    pairs = [("l0", "h0", "0x5140"), ("l0", "h0", "0x7362"), ("l1", "h1", "0x5140"),
             ("l1", "h1", "0x7362")]  # fmt: skip
    if packed:
        out = " ".join(
            f"prmt.b32 ${i}, {lo}, {hi}, {sel};" for i, (lo, hi, sel) in enumerate(pairs)
        )
    else:
        out = " ".join(
            f"prmt.b32 q, {lo}, {hi}, {sel}; mov.b32 {{${2 * i}, ${2 * i + 1}}}, q;"
            for i, (lo, hi, sel) in enumerate(pairs)
        )
    template = (
        "{ .reg .b32 m, mh, w4, l0, h0, l1, h1, sg, q; "
        f"and.b32 m, ${w}, 0x77777777; mul.hi.u32 mh, m, 65536; shl.b32 w4, ${w}, 4; "
        f"prmt.b32 l0, {t[0]}, {t[1]}, m; prmt.b32 h0, {t[2]}, {t[3]}, m; {signs_lo} "
        f"prmt.b32 l1, {t[0]}, {t[1]}, mh; prmt.b32 h1, {t[2]}, {t[3]}, mh; {signs_hi} "
        f"{out} }}"
    )
    outputs = "=r," * 4 if packed else "=h," * 8
    return template, outputs + "r,r,r,r,r"


@gluon.jit
def look_up(words, lo0, lo1, hi0, hi1, PAGE_SIGNS: gl.constexpr, PACKED: gl.constexpr = False):
    """The 8 BF16 weights of each word, codes 0..7, from its block's byte tables (with
    ``PACKED``, as 4 int32 words of two BF16 each, codes (0, 1), (2, 3), ..., the lower code in
    the low half). Per half word (4 codes): a PRMT picks the 4 low bytes by the codes' magnitude
    indices and one the 4 high bytes; the top bit of each code's sign byte flips its high byte's
    sign (a block scale may be negative: the table then holds negative values); two PRMTs pair
    low and high bytes into BF16x2 words. The upper half word's selectors come down by
    ``mul.hi`` (an IMAD on the FMA pipe) rather than a shift, and ptxas writes the nibble shift
    as an IMAD too.

    The sign bytes: in `pack_e2m1`'s layout a sign-replicating PRMT of the word (and of the word
    shifted by a nibble) gives 0xFF for each negative code: 15 instructions for 8 values, all
    but two on the ALU pipe, the decoding kernels' busiest (though not all that holds them: with
    the decode made free, one H200 ran the decode attention 14-19 % faster and the batch-64
    expert GEMM no faster, BENCHMARKS.md "The decode made free"). KV pages keep the signs where
    the flip takes them (PAGE_SIGNS, `reference.PAGE_SIGNS`): the word itself and the word
    shifted by a nibble are the sign bytes, 13 instructions."""
    asm: gl.constexpr = _look_up_asm(PAGE_SIGNS, PACKED)
    operands = [words, lo0, lo1, hi0, hi1]
    if PACKED:
        values = gl.inline_asm_elementwise(
            asm[0], asm[1], operands, dtype=(gl.int32,) * 4, is_pure=True, pack=1
        )
    else:
        values = gl.inline_asm_elementwise(
            asm[0], asm[1], operands, dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1
        )
    return values


@gluon.jit
def per_word(t, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, words_l: gl.constexpr):
    """``[BLOCK_N, BLOCK_K // 16]`` per block -> ``[BLOCK_N, BLOCK_K // 8]`` per word."""
    t = gl.reshape(gl.join(t, t), [BLOCK_N, BLOCK_K // 8])
    return gl.convert_layout(t, words_l, assert_trivial=True)


@gluon.jit
def joined(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """Codes 0..7 of each word ``[BLOCK_N, BLOCK_K // 8]`` -> ``[BLOCK_N, BLOCK_K]``, real K."""
    d = gl.join(
        gl.join(gl.join(v0, v1), gl.join(v2, v3)), gl.join(gl.join(v4, v5), gl.join(v6, v7))
    )
    # [N, W, j0, j1, j2] for J = 4 j2 + 2 j1 + j0
    return gl.reshape(gl.permute(d, [0, 1, 4, 3, 2]), [BLOCK_N, BLOCK_K])


@gluon.jit
def looked_up(
    words, sf, s, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, words_l: gl.constexpr,
    PAGE_SIGNS: gl.constexpr, PACKED: gl.constexpr = False,
):  # fmt: skip
    """``[ROWS, BLOCK_K]`` BF16 values of ``[ROWS, BLOCK_K // 8]`` words in ``words_l``, real K
    order, in the threads that hold the words: each block's byte tables from its block scale
    (``sf [ROWS, BLOCK_K // 16]`` as FP32, held by the thread that holds the block's two words)
    and the biased global scale ``s`` (broadcast over the blocks), then the lookups (with
    PAGE_SIGNS of words in KV pages' layout). With ``PACKED``, ``[ROWS, BLOCK_K // 2]`` int32
    pairs of those values as `look_up` packs them, a thread's 4 pairs of a word in consecutive
    registers in K order (one 16-byte store to shared memory)."""
    lo0, lo1, hi0, hi1 = byte_tables(sf, s)
    tables = (
        per_word(lo0, ROWS, BLOCK_K, words_l),
        per_word(lo1, ROWS, BLOCK_K, words_l),
        per_word(hi0, ROWS, BLOCK_K, words_l),
        per_word(hi1, ROWS, BLOCK_K, words_l),
    )
    if PACKED:
        p0, p1, p2, p3 = look_up(words, *tables, PAGE_SIGNS, PACKED=True)
        # The last join takes the lowest register bit: pair m = 2 m1 + m0 as [m1, m0].
        values = gl.reshape(gl.join(gl.join(p0, p2), gl.join(p1, p3)), [ROWS, BLOCK_K // 2])
    else:
        v0, v1, v2, v3, v4, v5, v6, v7 = look_up(words, *tables, PAGE_SIGNS)
        values = joined(v0, v1, v2, v3, v4, v5, v6, v7, ROWS, BLOCK_K)
    return values
