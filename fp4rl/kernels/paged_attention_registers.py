"""`paged_attention`'s decode over NVFP4 pages with K and V decoded straight into the tensor cores'
registers.

The same function as `paged_attention.launch` for BF16 queries over NVFP4 pages (one program
per sequence, KV head and stretch of the context, an online softmax over steps of ``BLOCK_N``
tokens, the stretches combined by `paged_attention`'s second kernel), written in Triton's Gluon
dialect so that the layouts are chosen here. Both products are chains of
``mma.sync.m16n8k16`` whose operands live in registers (`fragments`): each thread decodes
exactly the K and V values its fragments hold, the probabilities and V's values cross lanes
only by ``movmatrix`` (an 8 x 8 transpose in registers), and no K or V value passes through
shared memory in the loop. (`paged_attention`'s Triton program, compiled for sm_90, stores each
decoded tile to shared memory and loads it back in the operand's layout.)

The products are transposed, the keys and the head dim as the MMA's rows (M) and the G <= 8
query heads as its 8 columns (N), so no row of the MMA is padding: ``S^T = K . q^T`` and
``O^T += V^T . P^T``. The layouts, for one warp:

- **Scores** ``S^T`` ``[BLOCK_N, 8]``: K is operand A with the head dim as the reduction, put in
  `fragments`' order, q^T operand B (16 registers a thread for D = 128). A thread (g, c) holds
  keys ``g + 8 j`` and, per 32 values of D, one packed word of each key's codes: the words
  ``c * D/32 ... c * D/32 + D/32 - 1`` of the row, 16 contiguous bytes for D = 128, and their
  two blocks' scales.
- **Softmax** down the columns of the scores' fragments (a thread holds keys g and g + 8 of
  heads ``2c, 2c + 1``; a head's max and sum reduce over the 8 lane groups).
- **Probabilities as operand B of O^T**: a thread needs keys ``2c, 2c + 1 (+ 8)`` of head g,
  the transpose of what it holds; one ``movmatrix`` per 8 keys moves them (`_as_operand_b`).
- **V^T as operand A** ``[D, BLOCK_N]``: V is loaded and decoded in K's layout (the same
  loads, the same lanes for each row's scale), which leaves a thread pairs of consecutive
  values of one token where the product, reducing over the tokens, needs pairs of tokens; one
  ``movmatrix`` per register pair transposes each 8 x 8 tile of 8 tokens by 8 values, off the
  ALU pipe that bounds this kernel (`_as_operand_a`). The head dim comes out permuted as the
  output's rows and is put back when stored (`_real_order`).

Against the first layout of this kernel (q as operand A, its 8 heads twice over the MMA's 16
rows, K^T and V as operand B): a third fewer products, half the softmax, and 160 registers a
thread instead of 228 (SASS for sm_90, `python benchmarks/sass.py`).

Decode: byte tables per block and PRMT lookups (`fragments.byte_tables`, `fragments.look_up`);
K's and V's blocks each have their tables built once, by the one thread that holds them, and
each row's global scale is computed once, by one lane (`_row_lanes`).

Numerics: `paged_attention`'s contract, op for op. K and V enter the products as
``round_bf16((e2m1 * sf) * s)``, the values ``KVCache.read`` returns; BF16 products are exact
and sum in FP32; scores ``(q . k) * (1 / sqrt(D))``, the online softmax (the same `exp`) and the
running sums are FP32; each probability enters P . V as three BF16 parts whose sum is exactly
p, one product each; a step in which
no running maximum moved skips the accumulator's rescale, a multiplication by 1; the output is
``acc / l`` (IEEE division), cast once. Only the order of FP32 sums differs from
`paged_attention`'s program.

Compiled only (sm_89 and newer): Triton's interpreter runs no Gluon, so the CPU runs
`paged_attention`'s program, the reference for this one's tests on the GPU.

Legend: B sequences, Hq query heads, K KV heads, G = Hq / K, D head dim, N tokens of a step, H
the MMA's 8 head columns, W = D / 8 words of codes per row, P page size.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from fp4rl.fp4.format import GLOBAL_SCALE_DIVISOR, MIN_GLOBAL_SCALE
from fp4rl.kernels import dependent_launch, fragments
from fp4rl.kernels.launch import register_kernels_refusal
from fp4rl.kernels.numerics import GLOBAL_SCALE_BIAS

HEADS = gl.constexpr(8)  # the MMA's N: the query heads of one KV head, padded
_DIVISOR = gl.constexpr(GLOBAL_SCALE_DIVISOR)
_MIN_SCALE = gl.constexpr(MIN_GLOBAL_SCALE)
# RN(1 / 2688) in FP32
_RECIPROCAL = gl.constexpr(torch.tensor(1.0 / GLOBAL_SCALE_DIVISOR, dtype=torch.float32).item())


@gluon.constexpr_function
def _bits(n):
    """The bit positions of a power of two's index range: ``range(log2(n))``."""
    return range(int(math.log2(n)))


@gluon.constexpr_function
def _key_layout(block_n, cols):
    """K's (and V's) ``[BLOCK_N, cols]`` words (``cols = D/8``) or block scales (``D/16``): lane
    (g, c) holds keys ``g + 8 j`` and, of each, the columns its operand-A fragments need
    (`fragments`' order); a block scale sits with the thread that holds its two words."""
    per = cols // 4  # columns a lane holds of a key
    regs = [[0, 1 << i] for i in _bits(per)] + [[8 << i, 0] for i in _bits(block_n // 8)]
    lanes = [[0, per], [0, 2 * per], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [block_n, cols])


@gluon.constexpr_function
def _pairs_layout(block_n, d):
    """`_key_layout` of ``[BLOCK_N, D]`` values, its registers ordered value first, so that
    each two consecutive values of a token are one register's pair (`_as_operand_a`)."""
    regs = [[0, 1 << i] for i in _bits(d // 4)] + [[8 << i, 0] for i in _bits(block_n // 8)]
    lanes = [[0, d // 4], [0, d // 2], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [block_n, d])


@gluon.constexpr_function
def _row_lanes(block_n):
    """``[BLOCK_N]`` rows one a lane (up to 32 rows; with 16 each row in two lanes): a row's
    amax is loaded and its global scale computed once there, then moved to the 4 lanes that
    hold the row's blocks, instead of each of those lanes computing the scale of both rows it
    holds. Lane (g, c) takes row ``g + 8 (c % 2) + 16 (c // 2)``, the rows ``g + 8 j`` of its
    own quad (`_key_layout`, K's and V's): one butterfly shuffle moves a lane's two rows where
    row r in lane r took two indexed ones."""
    lanes = [[8], [16 if block_n > 16 else 0], [1], [2], [4]]
    regs = [[32 << i] for i in _bits(max(1, block_n // 32))]
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
def _step_offsets(num_kv_heads, kv_head, words_l: gl.constexpr, scales_l: gl.constexpr,
                  rows_l: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                  PAIRS: gl.constexpr):  # fmt: skip
    """What of a step's addresses no step changes, computed once before the loop: each code
    word's, block scale's (or pair of block scales', where ``PAIRS``) and amax's offset in
    elements from its step's first cache row ``slot * K`` (token i's row is ``(slot + i) * K +
    kv head``), and the tokens' indices in the step, to mask with (`_pages_step`)."""
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
def _pages_step(pages, block_scale, amax, table_row, n0, end, num_kv_heads, kv_head, offsets,
                words_l: gl.constexpr, scales_l: gl.constexpr, rows_l: gl.constexpr,
                BLOCK_N: gl.constexpr, PAGE: gl.constexpr, D: gl.constexpr,
                PAIRS: gl.constexpr):  # fmt: skip
    """The codes ``[BLOCK_N, W]``, block-scale bytes ``[BLOCK_N, D/16]`` (where ``PAIRS``, each
    two of a row's as one 2-byte word ``[BLOCK_N, D/32]``) and row amaxes of tokens ``n0 .. n0
    + BLOCK_N`` in the layouts given, as loaded (nothing waits on them here: the next step's
    are loaded ahead); zeros past ``end`` (cache row = slot * K + kv head, the slot found
    through the sequence's block table; ``offsets``: `_step_offsets`').

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
        # The amaxes one row a lane (`_row_lanes`), each row's scale computed once (`_decoded`).
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
def _decoded(words, scales, amax_N, words_l: gl.constexpr, blocks_l: gl.constexpr,
             BLOCK_N: gl.constexpr, D: gl.constexpr, PAIRS: gl.constexpr):  # fmt: skip
    """``[BLOCK_N, D]`` BF16 values of a step's codes, real order, in the threads that hold the
    codes: ``round((e2m1 * sf) * s)`` by byte-table lookup, s from the rows' amaxes (one a
    lane, `_row_lanes`), moved by warp shuffles to the lanes of the rows' blocks. ``scales`` as
    `_pages_step` loads them."""
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


@gluon.jit
def _transposed(x):
    """``movmatrix.sync.aligned.m8n8.trans.b16`` on each register pair of BF16 ``x``: the pair a
    lane (g, c) holds, elements (g, 2c) and (g, 2c + 1) of an 8 x 8 tile, is replaced by the
    tile's elements (2c, g) and (2c + 1, g); the values move between lanes, not through shared
    memory."""
    return gl.inline_asm_elementwise(
        "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
        "=r,r",
        [x],
        dtype=gl.bfloat16,
        is_pure=True,
        pack=2,
    )


@gluon.jit
def _as_operand_a(v, a_l: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr):
    """``[BLOCK_N, D]`` BF16 values of V as decoded in K's layout (`_key_layout`: lane (g, c)
    holds tokens ``g + 8 h`` and values ``(D/4) c ... (D/4) c + D/4 - 1`` of each) -> V^T as
    operand A of ``O^T += V^T . P^T``, its rows in the output order (`_real_order`). The
    product reduces over the tokens, so a lane must hold pairs of tokens where it decoded pairs
    of values: each 8 x 8 tile of 8 tokens by a pair of values in each lane of a quad is
    transposed by ``movmatrix`` (between lanes, off the ALU pipe), then the tensor relabelled.
    """
    # Consecutive values as consecutive registers, the pairs `fragments.look_up` packed.
    v = gl.convert_layout(v, _pairs_layout(BLOCK_N, D), assert_trivial=True)
    t = _transposed(v)
    # t[8 h + g, (D/4) c + 8 w + 2 j + e] now holds V[8 h + 2 c + e, (D/4)(g // 2) + 8 w + 2 j
    # + g % 2]: relabel (h, g, c, w, j, e) as V^T's row 8 (4 w + j) + g, token 8 h + 2 c + e.
    t = gl.permute(gl.reshape(t, [BLOCK_N // 8, 8, 4, D // 32, 4, 2]), [3, 4, 1, 0, 2, 5])
    return gl.convert_layout(gl.reshape(t, [D, BLOCK_N]), a_l, assert_trivial=True)


@gluon.jit
def _real_order(t, ROWS_: gl.constexpr, D: gl.constexpr):
    """``[ROWS_, D]`` in the output's row order (`_as_operand_a`) -> real head-dim order: row
    ``8 (4 w + j) + 2 g1 + g0`` of ``O^T`` is ``d = (D/4) g1 + 8 w + 2 j + g0``."""
    t = gl.permute(gl.reshape(t, [ROWS_, D // 32, 4, 4, 2]), [0, 3, 1, 2, 4])
    return gl.reshape(t, [ROWS_, D])


@gluon.jit
def _as_operand_b(p, b_l: gl.constexpr, BLOCK_N: gl.constexpr):
    """``[BLOCK_N, HEADS]`` BF16 probabilities in the scores' accumulator layout -> the same
    values as operand B of ``O^T += V^T . P^T`` (reduction over the tokens). A thread holds
    tokens ``g + 8 h`` of heads ``2c, 2c + 1`` and needs tokens ``2c, 2c + 1 (+ 8 h)`` of head
    g: each 8 x 8 tile transposed by ``movmatrix`` (the values move between lanes, no shared
    memory), then the tensor relabelled to match."""
    t = _transposed(p)
    # t[8 h + g, 2 c + e] now holds p[8 h + 2 c + e, g]: relabel (h, g, c, e) -> (h, c, e, g).
    t = gl.permute(gl.reshape(t, [BLOCK_N // 8, 8, HEADS // 2, 2]), [0, 2, 3, 1])
    return gl.convert_layout(gl.reshape(t, [BLOCK_N, HEADS]), b_l, assert_trivial=True)


# Batch and table width change with every step: no recompiling for each.
@gluon.jit(do_not_specialize=["num_kv_heads", "table_cols"])
def _paged_decode_registers_kernel(
    q_BHD,
    k_pages,
    k_block_scale,
    k_amax,
    v_pages,
    v_block_scale,
    v_amax,
    table_BN,
    context_B,
    out_BHD,
    part_m,
    part_l,
    part_o,
    softmax_scale,
    num_kv_heads,
    table_cols,
    G: gl.constexpr,
    D: gl.constexpr,
    PAGE: gl.constexpr,
    BLOCK_N: gl.constexpr,
    SPLIT: gl.constexpr,
    PDL: gl.constexpr,
):
    dependent_launch.gluon_wait_for_prior(PDL)
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]
    )
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    kw_l: gl.constexpr = _key_layout(BLOCK_N, D // 8)
    kb_l: gl.constexpr = _key_layout(BLOCK_N, D // 16)
    # K's block scales as loaded: a lane's two of a row (its 32 values of the row) as one
    # 2-byte word (`_e4m3_pairs`).
    K_PAIRS: gl.constexpr = D % 128 == 0
    ks_l: gl.constexpr = _key_layout(BLOCK_N, D // 32) if K_PAIRS else kb_l
    rows_l: gl.constexpr = _row_lanes(BLOCK_N)
    io_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])

    b = gl.program_id(0) // num_kv_heads
    kv_head = gl.program_id(0) % num_kv_heads
    split = gl.program_id(1)

    # q^T as operand B [D, HEADS]: head h is column h, heads G.. zero.
    h_H = gl.arange(0, HEADS, layout=gl.SliceLayout(1, io_l))
    q_rows = b.to(gl.int64) * (num_kv_heads * G) + kv_head * G + h_H
    head_ok = h_H < G
    d_D = gl.arange(0, D, layout=gl.SliceLayout(0, io_l))
    q_HD = gl.load(q_BHD + q_rows[:, None] * D + d_D[None, :], mask=head_ok[:, None], other=0.0)
    q_b = gl.convert_layout(gl.permute(fragments.hardware_order(q_HD, HEADS, D), [1, 0]), b_l)

    # This program's stretch of its sequence's context (`paged_attention.stretch_of`; Gluon
    # calls no Triton function).
    context = gl.minimum(gl.load(context_B + b), table_cols * PAGE)
    stretch = gl.cdiv(gl.cdiv(context, gl.num_programs(1)), BLOCK_N) * BLOCK_N
    start = split * stretch
    end = gl.minimum(start + stretch, context)
    table_row = table_BN + b.to(gl.int64) * table_cols
    key_N = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))

    m_H = gl.full([HEADS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_H = gl.zeros([HEADS], gl.float32, layout=gl.SliceLayout(0, mma))
    acc = gl.zeros([D, HEADS], gl.float32, layout=mma)  # O^T, rows in the output order
    # K and V lie alike in their pages and are loaded alike: one set of offsets.
    at = _step_offsets(num_kv_heads, kv_head, kw_l, ks_l, rows_l, BLOCK_N, D, K_PAIRS)
    k_words, k_scales, k_maxes = _pages_step(
        k_pages, k_block_scale, k_amax, table_row, start, end, num_kv_heads, kv_head, at,
        kw_l, ks_l, rows_l, BLOCK_N, PAGE, D, K_PAIRS,
    )  # fmt: skip
    v_words, v_scales, v_maxes = _pages_step(
        v_pages, v_block_scale, v_amax, table_row, start, end, num_kv_heads, kv_head, at,
        kw_l, ks_l, rows_l, BLOCK_N, PAGE, D, K_PAIRS,
    )  # fmt: skip
    for n0 in range(start, end, BLOCK_N):
        # The next step's K in flight while this one computes (zeros past the end).
        next_k = _pages_step(
            k_pages, k_block_scale, k_amax, table_row, n0 + BLOCK_N, end, num_kv_heads,
            kv_head, at, kw_l, ks_l, rows_l, BLOCK_N, PAGE, D, K_PAIRS,
        )  # fmt: skip

        # Scores S^T = K . q^T [BLOCK_N, HEADS]: the keys are the MMA's rows.
        k_ND = _decoded(k_words, k_scales, k_maxes, kw_l, kb_l, BLOCK_N, D, K_PAIRS)
        k_a = gl.convert_layout(fragments.hardware_order(k_ND, BLOCK_N, D), a_l,
                                assert_trivial=True)  # fmt: skip
        scores = mma_v2(k_a, q_b, gl.zeros([BLOCK_N, HEADS], gl.float32, layout=mma))
        scores = gl.where(((n0 + key_N) < end)[:, None], scores * softmax_scale, float("-inf"))
        # Every step holds at least one token of the context (n0 < end): m_new is finite
        # unless the scores are not, and exp(-inf - m_new) = 0 on the first step.
        m_new = gl.maximum(m_H, gl.max(scores, 0))
        alpha = gl.exp(m_H - m_new)
        p = gl.exp(scores - m_new[None, :])
        l_H = l_H * alpha + gl.sum(p, 0)
        m_H = m_new

        # p = p1 + p2 + p3 exactly in BF16 parts, each a product of its own.
        p1 = p.to(gl.bfloat16)
        rest = p - p1.to(gl.float32)
        p2 = rest.to(gl.bfloat16)
        p3 = (rest - p2.to(gl.float32)).to(gl.bfloat16)
        v_ND = _decoded(v_words, v_scales, v_maxes, kw_l, kb_l, BLOCK_N, D, K_PAIRS)
        v_a = _as_operand_a(v_ND, a_l, BLOCK_N, D)
        # The next step's V loaded only now that this one's is decoded: into the same
        # registers, where loaded with K's the two steps' V would be live at once and each
        # step's copied over the other's at the end of the loop.
        next_v = _pages_step(
            v_pages, v_block_scale, v_amax, table_row, n0 + BLOCK_N, end, num_kv_heads,
            kv_head, at, kw_l, ks_l, rows_l, BLOCK_N, PAGE, D, K_PAIRS,
        )  # fmt: skip
        # Once the running maxima stop moving (alpha == 1 in every head, the usual case after a
        # few steps) the rescale is skipped: multiplying by 1 changes no bit.
        if gl.sum((alpha != 1.0).to(gl.int32), 0) > 0:
            acc = acc * alpha[None, :]
        acc = mma_v2(v_a, _as_operand_b(p1, b_l, BLOCK_N), acc)
        acc = mma_v2(v_a, _as_operand_b(p2, b_l, BLOCK_N), acc)
        acc = mma_v2(v_a, _as_operand_b(p3, b_l, BLOCK_N), acc)
        k_words, k_scales, k_maxes = next_k
        v_words, v_scales, v_maxes = next_v

    # Heads as rows from here on, the head dim back in real order.
    acc_HD = gl.convert_layout(_real_order(gl.permute(acc, [1, 0]), HEADS, D), io_l)
    m_io = gl.convert_layout(m_H, gl.SliceLayout(1, io_l))
    l_io = gl.convert_layout(l_H, gl.SliceLayout(1, io_l))
    if SPLIT:
        # An empty stretch writes (-inf, 0, 0): the combine gives it weight 0.
        part = q_rows * gl.num_programs(1) + split
        gl.store(part_m + part, m_io, mask=head_ok)
        gl.store(part_l + part, l_io, mask=head_ok)
        gl.store(part_o + part[:, None] * D + d_D[None, :], acc_HD, mask=head_ok[:, None])
    else:
        out = gl.div_rn(acc_HD, l_io[:, None])
        gl.store(out_BHD + q_rows[:, None] * D + d_D[None, :], out.to(gl.bfloat16),
                 mask=head_ok[:, None])  # fmt: skip


def supported(q_dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether this kernel computes a launch: BF16 queries, head dim 128, at most 8 query heads
    per KV head (NVFP4 pages; the caller checks the device). Head dim 256 compiles, but its
    accumulator alone takes half of a thread's registers and the rest spill (compiled for sm_90
    by Triton 3.6: 255 registers and 288 to 1,352 bytes of stack): `paged_attention`'s program
    serves it."""
    return q_dtype == torch.bfloat16 and head_dim == 128 and 1 <= group <= HEADS


def check_launch(q_BHD: torch.Tensor, nvfp4: bool, head_dim: int, group: int) -> None:
    """Raise ValueError naming the value unless this kernel can run the launch: NVFP4 pages,
    `supported` queries, head dim and group, a CUDA GPU of sm_89 or newer."""
    if not nvfp4:
        raise ValueError("a registers DecodeTile is for NVFP4 pages; k and v are not NVFP4Rows")
    if not supported(q_BHD.dtype, head_dim, group):
        raise ValueError(
            f"a registers DecodeTile takes bfloat16 queries, head dim 128 and at most 8 "
            f"query heads per KV head; got {q_BHD.dtype}, D={head_dim}, G={group}"
        )
    if (refusal := register_kernels_refusal(q_BHD.device)) is not None:
        raise ValueError(f"a registers DecodeTile (q_BHD's device) {refusal}")


def members(pages) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes as int32 words, block-scale bytes, row amaxes) of `NVFP4Rows` pages, as this
    kernel reads them (the launcher has checked them with `paged_kv.page_members`)."""
    return pages.codes.view(torch.int32), pages.block_scale.view(torch.uint8), pages.amax


def launch_kernel(grid, q_BHD, k, v, block_table_BN, context_B, out_BHD, parts, *,
                  block_n) -> None:  # fmt: skip
    """Launch over ``grid`` with `paged_attention.launch`'s checked arguments (``k``, ``v``: one
    layer's NVFP4 pages; ``parts``: the stretches' (m, l, o), or ``out_BHD`` thrice without
    splits)."""
    _, Hq, D = q_BHD.shape
    blocks, page, num_kv_heads, _ = k.shape
    if (rows := blocks * page * num_kv_heads) >= 2**32:  # a step's cache row is 32-bit
        raise ValueError(f"a registers DecodeTile takes under 2**32 cache rows; got {rows}")
    _paged_decode_registers_kernel[grid](
        q_BHD, *members(k), *members(v), block_table_BN, context_B, out_BHD, *parts,
        1.0 / math.sqrt(D), num_kv_heads, block_table_BN.shape[1],
        G=Hq // num_kv_heads, D=D, PAGE=page, BLOCK_N=block_n, SPLIT=grid[1] > 1, num_warps=1,
        # The decode's two products must not merge into an FMA with anything.
        enable_fp_fusion=False,
        **dependent_launch.keywords(q_BHD.device),
    )  # fmt: skip
