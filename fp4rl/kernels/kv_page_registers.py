"""NVFP4 KV pages read straight into registers and decoded there, for the register decode
attention (`paged_attention_registers`): the layouts in which a step's code words, block scales
and row amaxes are loaded, the step's loads through the block table, the rows' global scales
from their amaxes, and the values ``round_bf16((e2m1 * sf) * s)``.

A step is ``BLOCK_N`` tokens of one KV head. Lane (g, c) of a warp holds tokens ``g + 8 j`` and,
per 32 values of the head dim, one packed word of each token's codes (the words its operand-A
fragments need, `fragments`' order: 16 contiguous bytes a token for D = 128) with the two block
scales of those words; K and V lie alike in their pages and are loaded alike.

Decode: byte tables per block and PRMT lookups (`fragments.byte_tables`, `fragments.look_up`);
each block has its tables built once, by the one thread that holds it, and each row's global
scale is computed once, by one lane (`row_lanes`), then moved by shuffles to the lanes of the
row's blocks.

Compiled only (Gluon): Triton's interpreter runs none of it.

Legend: N tokens of a step, D head dim, W = D / 8 words of codes per row, P page size.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fp4rl.fp4.format import GLOBAL_SCALE_DIVISOR, MIN_GLOBAL_SCALE
from fp4rl.kernels import fragments
from fp4rl.kernels.packed_words import GLOBAL_SCALE_BIAS

_DIVISOR = gl.constexpr(GLOBAL_SCALE_DIVISOR)
_MIN_SCALE = gl.constexpr(MIN_GLOBAL_SCALE)
# RN(1 / 2688) in FP32
_RECIPROCAL = gl.constexpr(torch.tensor(1.0 / GLOBAL_SCALE_DIVISOR, dtype=torch.float32).item())


@gluon.constexpr_function
def bits(n):
    """The bit positions of a power of two's index range: ``range(log2(n))``."""
    return range(int(math.log2(n)))


@gluon.constexpr_function
def key_layout(block_n, cols):
    """K's (and V's) ``[BLOCK_N, cols]`` words (``cols = D/8``) or block scales (``D/16``): lane
    (g, c) holds keys ``g + 8 j`` and, of each, the columns its operand-A fragments need
    (`fragments`' order); a block scale sits with the thread that holds its two words."""
    per = cols // 4  # columns a lane holds of a key
    regs = [[0, 1 << i] for i in bits(per)] + [[8 << i, 0] for i in bits(block_n // 8)]
    lanes = [[0, per], [0, 2 * per], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [block_n, cols])


@gluon.constexpr_function
def row_lanes(block_n):
    """``[BLOCK_N]`` rows one a lane (up to 32 rows; with 16 each row in two lanes): a row's
    amax is loaded and its global scale computed once there, then moved to the 4 lanes that
    hold the row's blocks, instead of each of those lanes computing the scale of both rows it
    holds. Lane (g, c) takes row ``g + 8 (c % 2) + 16 (c // 2)``, the rows ``g + 8 j`` of its
    own quad (`key_layout`, K's and V's): one butterfly shuffle moves a lane's two rows where
    row r in lane r took two indexed ones."""
    lanes = [[8], [16 if block_n > 16 else 0], [1], [2], [4]]
    regs = [[32 << i] for i in bits(max(1, block_n // 32))]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [block_n])


@gluon.jit
def global_scales(amax_N):
    """The FP32 global scales of rows from the amaxes their pages keep, bit for bit
    `numerics.global_scale_from_amax`'s but for the NaN's payload: ``amax / 2688`` correctly
    rounded, 0 below MIN_GLOBAL_SCALE (masked rows load an amax of 0), a NaN where the amax is
    not finite (from the arithmetic: inf - inf).

    The quotient of a BF16 or FP16 amax is Markstein's: ``q = amax * y`` for ``y = RN(1 /
    2688)``, then ``q + (amax - 2688 q) * y`` in one rounding (the residual is exact). For every
    finite BF16 and FP16 amax this is the IEEE quotient once flushed below MIN_GLOBAL_SCALE,
    checked value by value; three FP32 instructions where ``div.rn.f32`` costs about fifteen.
    FP32 amaxes, not covered by that check, take ``div.rn.f32``."""
    a = amax_N.to(gl.float32)
    if amax_N.dtype == gl.float32:
        s = gl.div_rn(a, gl.full_like(a, _DIVISOR))
        s = gl.where(gl.abs(a) < float("inf"), s, float("nan"))
    else:
        q = a * _RECIPROCAL
        # q * -2688 is -(2688 q) exactly; -q would be 0 - q, one more instruction.
        s = gl.fma(gl.fma(q, -_DIVISOR, a), _RECIPROCAL, q)
    return gl.where(s < _MIN_SCALE, 0.0, s)


@gluon.jit
def step_offsets(num_kv_heads, kv_head, words_l: gl.constexpr, scales_l: gl.constexpr,
                  rows_l: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                  PAIRS: gl.constexpr):  # fmt: skip
    """What of a step's addresses no step changes, computed once before the loop: each code
    word's, block scale's (or pair of block scales', where ``PAIRS``) and amax's offset in
    elements from its step's first cache row ``slot * K`` (token i's row is ``(slot + i) * K +
    kv head``), and the tokens' indices in the step, to mask with (`pages_step`)."""
    i_N = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, scales_l))
    SCALES: gl.constexpr = D // 32 if PAIRS else D // 16
    col_S = gl.arange(0, SCALES, layout=gl.SliceLayout(0, scales_l))
    scales_NS = (i_N * num_kv_heads + kv_head)[:, None] * SCALES + col_S[None, :]
    i_W = gl.convert_layout(i_N, gl.SliceLayout(1, words_l), assert_trivial=True)
    word_W = gl.arange(0, D // 8, layout=gl.SliceLayout(0, words_l))
    words_NW = (i_W * num_kv_heads + kv_head)[:, None] * (D // 8) + word_W[None, :]
    j_N = gl.arange(0, BLOCK_N, layout=rows_l)
    rows_J = j_N * num_kv_heads + kv_head
    # Unsigned (no offset is negative): the loop adds each to a 64-bit address as it is, where
    # a signed one would be sign-extended and its upper word kept live in a register.
    return (words_NW.to(gl.uint32), scales_NS.to(gl.uint32), rows_J.to(gl.uint32), i_N, j_N)


@gluon.jit
def pages_step(pages, block_scale, amax, table_row, n0, end, num_kv_heads, kv_head, offsets,
                words_l: gl.constexpr, scales_l: gl.constexpr, rows_l: gl.constexpr,
                BLOCK_N: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr,
                PAIRS: gl.constexpr):  # fmt: skip
    """The codes ``[BLOCK_N, W]``, block-scale bytes ``[BLOCK_N, D/16]`` (where ``PAIRS``, each
    two of a row's as one 2-byte word ``[BLOCK_N, D/32]``) and row amaxes of tokens ``n0 .. n0
    + BLOCK_N`` in the layouts given, as loaded (nothing waits on them here: the next step's
    are loaded ahead); zeros past ``end`` (cache row = slot * K + kv head, the slot found
    through the sequence's block table; ``offsets``: `step_offsets`').

    Where a step lies in one page, a step's address of each array is one 64-bit multiply-add,
    base + ``slot * K`` rows (``IMAD.WIDE.U32``), to which each load adds its lane's 32-bit
    offset. ``slot * K``, a cache row, is computed in 32 bits: a cache of 2^32 rows would hold
    2 * 2^32 * D/2 bytes of K and V codes alone (512 GiB at D = 128); page indices, as slots,
    are never negative. Where a step spans pages, each row finds its own."""
    words_NW, scales_NS, rows_J, i_N, j_N = offsets
    if PAIRS:
        block_scale = block_scale.to(gl.pointer_type(gl.uint16))
    SCALES: gl.constexpr = D // 32 if PAIRS else D // 16
    left = end - n0  # token i is in the context where i < left, as n0 + i < end
    ok_N = i_N < left
    ok_W = gl.convert_layout(ok_N, gl.SliceLayout(1, words_l), assert_trivial=True)
    if PAGE % BLOCK_N == 0:  # steps start at multiples of BLOCK_N: a step lies in one page
        t0 = n0.to(gl.uint32)  # never negative: unsigned, // and % need no sign fix-up
        page = gl.load(table_row + t0 // PAGE, mask=n0 < end, other=0).to(gl.uint32)
        row0 = ((page * PAGE + t0 % PAGE) * num_kv_heads.to(gl.uint32)).to(gl.uint64)
        scales = gl.load(block_scale + row0 * SCALES + scales_NS, mask=ok_N[:, None], other=0)
        # The amaxes one row a lane (`row_lanes`), each row's scale computed once (`decoded`).
        amax_N = gl.load(amax + row0 + rows_J, mask=j_N < left, other=0.0)
        words = gl.load(pages + row0 * (D // 8) + words_NW, mask=ok_W[:, None], other=0)
    else:
        t_N = n0 + i_N
        page_N = gl.load(table_row + t_N // PAGE, mask=ok_N, other=0)
        rows_N = (page_N.to(gl.int64) * PAGE + t_N % PAGE) * num_kv_heads + kv_head
        col_S = gl.arange(0, SCALES, layout=gl.SliceLayout(0, scales_l))
        scales = gl.load(block_scale + rows_N[:, None] * SCALES + col_S[None, :],
                         mask=ok_N[:, None], other=0)  # fmt: skip
        amax_N = gl.load(amax + gl.convert_layout(rows_N, rows_l), mask=j_N < left, other=0.0)
        rows_W = gl.convert_layout(rows_N, gl.SliceLayout(1, words_l), assert_trivial=True)
        word_W = gl.arange(0, D // 8, layout=gl.SliceLayout(0, words_l))
        words = gl.load(pages + rows_W[:, None] * (D // 8) + word_W[None, :], mask=ok_W[:, None],
                        other=0)  # fmt: skip
    return words, scales, amax_N


@gluon.jit
def _e4m3_pairs(pairs):
    """The FP32 values of 2-byte words of two E4M3 block scales each (low byte first), by the
    instructions Triton converts E4M3 with (``cvt.rn.f16x2.e4m3x2``, each half widened), fed the
    word as loaded (Triton loads a lane's two bytes of a row as this one word): converted as
    bytes, the word's two would be split apart as loaded and joined again for the conversion,
    four instructions a word."""
    return gl.inline_asm_elementwise(
        """{ .reg .b16 lo, hi; .reg .b32 h;
        cvt.rn.f16x2.e4m3x2 h, $2;
        mov.b32 {lo, hi}, h;
        cvt.f32.f16 $0, lo;
        cvt.f32.f16 $1, hi; }""",
        "=r,=r,h",
        [pairs],
        dtype=(gl.float32, gl.float32),
        is_pure=True,
        pack=1,
    )


@gluon.jit
def decoded(words, scales, amax_N, words_l: gl.constexpr, blocks_l: gl.constexpr,
             BLOCK_N: gl.constexpr, D: gl.constexpr, PAIRS: gl.constexpr):  # fmt: skip
    """``[BLOCK_N, D]`` BF16 values of a step's codes, real order, in the threads that hold the
    codes: ``round((e2m1 * sf) * s)`` by byte-table lookup, s from the rows' amaxes (one a
    lane, `row_lanes`), moved by warp shuffles to the lanes of the rows' blocks. ``scales`` as
    `pages_step` loads them."""
    # Biased in the one lane that computed it: one product a row (exact, a power of two),
    # rather than one in each lane that holds the row.
    s_N = gl.convert_layout(global_scales(amax_N) * GLOBAL_SCALE_BIAS, gl.SliceLayout(1, blocks_l))
    if PAIRS:
        lo, hi = _e4m3_pairs(scales)
        sf = gl.reshape(gl.join(lo, hi), [BLOCK_N, D // 16])
        sf = gl.convert_layout(sf, blocks_l, assert_trivial=True)
    else:
        sf = scales.to(gl.float8e4nv, bitcast=True).to(gl.float32)
    return fragments.looked_up(words, sf, s_N[:, None], BLOCK_N, D, words_l, PAGE_SIGNS=True)


def members(pages) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes as int32 words, block-scale bytes, row amaxes) of `NVFP4Rows` pages, as this
    kernel reads them (the launcher has checked them with `paged_kv.page_members`)."""
    return pages.codes.view(torch.int32), pages.block_scale.view(torch.uint8), pages.amax
