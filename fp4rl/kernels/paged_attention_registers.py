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
  ALU pipe, this kernel's busiest (`_as_operand_a`). The head dim comes out permuted as the
  output's rows and is put back when stored (`_real_order`).

Against the first layout of this kernel (q as operand A, its 8 heads twice over the MMA's 16
rows, K^T and V as operand B): a third fewer products, half the softmax, and 160 registers a
thread instead of 228 (SASS for sm_90, `python benchmarks/sass.py`).

Loads and decode: `kv_page_registers` (byte tables per block and PRMT lookups; K's and V's
blocks each have their tables built once, by the one thread that holds them, and each row's
global scale is computed once, by one lane).

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

from fp4rl.kernels import dependent_launch, fragments
from fp4rl.kernels.kv_page_registers import (
    bits,
    decoded,
    key_layout,
    members,
    pages_step,
    row_lanes,
    step_offsets,
)
from fp4rl.kernels.launch import register_kernels_refusal

HEADS = gl.constexpr(8)  # the MMA's N: the query heads of one KV head, padded


@gluon.constexpr_function
def _pairs_layout(block_n, d):
    """`key_layout` of ``[BLOCK_N, D]`` values, its registers ordered value first, so that
    each two consecutive values of a token are one register's pair (`_as_operand_a`)."""
    regs = [[0, 1 << i] for i in bits(d // 4)] + [[8 << i, 0] for i in bits(block_n // 8)]
    lanes = [[0, d // 4], [0, d // 2], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [block_n, d])


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
    """``[BLOCK_N, D]`` BF16 values of V as decoded in K's layout (`key_layout`: lane (g, c)
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
    kw_l: gl.constexpr = key_layout(BLOCK_N, D // 8)
    kb_l: gl.constexpr = key_layout(BLOCK_N, D // 16)
    # K's block scales as loaded: a lane's two of a row (its 32 values of the row) as one
    # 2-byte word (`_e4m3_pairs`).
    K_PAIRS: gl.constexpr = D % 128 == 0
    ks_l: gl.constexpr = key_layout(BLOCK_N, D // 32) if K_PAIRS else kb_l
    rows_l: gl.constexpr = row_lanes(BLOCK_N)
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
    at = step_offsets(num_kv_heads, kv_head, kw_l, ks_l, rows_l, BLOCK_N, D, K_PAIRS)
    k_words, k_scales, k_maxes = pages_step(
        k_pages, k_block_scale, k_amax, table_row, start, end, num_kv_heads, kv_head, at,
        kw_l, ks_l, rows_l, BLOCK_N, PAGE, D, K_PAIRS,
    )  # fmt: skip
    v_words, v_scales, v_maxes = pages_step(
        v_pages, v_block_scale, v_amax, table_row, start, end, num_kv_heads, kv_head, at,
        kw_l, ks_l, rows_l, BLOCK_N, PAGE, D, K_PAIRS,
    )  # fmt: skip
    for n0 in range(start, end, BLOCK_N):
        # The next step's K in flight while this one computes (zeros past the end).
        next_k = pages_step(
            k_pages, k_block_scale, k_amax, table_row, n0 + BLOCK_N, end, num_kv_heads,
            kv_head, at, kw_l, ks_l, rows_l, BLOCK_N, PAGE, D, K_PAIRS,
        )  # fmt: skip

        # Scores S^T = K . q^T [BLOCK_N, HEADS]: the keys are the MMA's rows.
        k_ND = decoded(k_words, k_scales, k_maxes, kw_l, kb_l, BLOCK_N, D, K_PAIRS)
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
        v_ND = decoded(v_words, v_scales, v_maxes, kw_l, kb_l, BLOCK_N, D, K_PAIRS)
        v_a = _as_operand_a(v_ND, a_l, BLOCK_N, D)
        # The next step's V loaded only now that this one's is decoded: into the same
        # registers, where loaded with K's the two steps' V would be live at once and each
        # step's copied over the other's at the end of the loop.
        next_v = pages_step(
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
