"""Decode attention over paged KV, read where it lies: BF16 pages or NVFP4 pages.

One query token per sequence attends to its sequence's cached context (itself included): the
context's ``context_B[b]`` tokens sit in pages named by row b of ``block_table_BN`` (token t in
page ``block_table_BN[b, t // P]`` at offset ``t % P``). Query heads are grouped over the KV
heads (head ``h`` reads KV head ``h // G``). Each program takes one sequence, one KV head (all
G query heads that share it) and one stretch of the context, and walks it BLOCK_N tokens at a
time with an online softmax; nothing is gathered to memory. A tile either takes the query rows
as the dots' rows (scores ``q @ k.T``, output ``p @ v``) or, `DecodeTile.keys_first`, the
tokens (``k @ q.T`` and ``v.T @ p``): the same products, transposed. Keys first, the decoded K
tile is the first operand of a Hopper tensor-core instruction, which takes that operand from
registers; Triton 3.6 still moves the decoded tile into the operand's register layout through
shared memory (a store, then a load in the operand layout: its TTGIR for sm_90). Where it can run
(NVFP4 pages, BF16 queries, head dim 128, sm_89 or newer, more than SMALL_LAUNCH
sequence-heads), the launcher takes `paged_attention_registers` instead: the same attention in
Gluon with both products' operands in registers (`DecodeTile.registers`, `page_format`).

Numerics, the contract of `reference_decode` (the twin below: ``attend_fp32`` over
``KVCache.read`` in `fp4rl.rollout`, restricted to one query token):

- K and V enter the dot products as exactly the values ``KVCache.read`` returns in the query
  dtype: BF16 pages cast to it, NVFP4 pages decoded in registers as ``reference.dequantize``
  computes them, ``(e2m1 * f32(block_scale)) * global_scale`` in FP32, then cast (the decode is
  `moe_gemm`'s: the first product is exact, the second rounds once, for every global scale below
  2**120), each row's global scale made from the amax its pages keep.
- Scores ``(q . k) * (1 / sqrt(D))`` and the softmax are FP32. With BF16 queries, q . k runs on
  the tensor cores (BF16 products are exact, FP32 sums) and so does p . v: each FP32
  probability is split into three BF16 parts whose sum is exactly p, so all three products are
  exact and only the FP32 summation order differs from the reference. FP32 queries use IEEE
  FP32 dot products.
- The output is ``acc / l`` (an IEEE division), cast once to the query dtype. Against the
  reference only the order of FP32 sums and the exp approximation differ: ~1e-6 of the output's
  scale, then the one rounding to the query dtype.
- Tokens past a context are never read (masked loads), so padding pages may hold anything,
  NaN included; a NaN K or V value inside a context makes its KV head's outputs NaN, as in
  the reference. A context of 0 gives NaN (0 / 0), as the reference's all-masked softmax does.

Work split: for long contexts at small batch, each context is cut into ``num_splits``
stretches (flash-decoding); each program writes its unnormalized output, running maximum and
sum, and a second small kernel combines the stretches. The number of stretches depends on
host-known shapes only (batch, heads, table width; `attention_tiles`, with the tiles) and the
launch reads nothing back, so it can be captured in a CUDA graph: contexts and tables may change
between replays. Where the stretches fall depends on each sequence's context, read on the GPU
(`stretch_of`): a table wider than the contexts still leaves every stretch its share.

Legend: B sequences, Hq query heads, K KV heads, G = Hq / K, D head dim, N table columns, P
page (block) size, S context splits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fp4rl.fp4.tensor import NVFP4Rows
from fp4rl.kernels import dependent_launch
from fp4rl.kernels.attention_tiles import DecodeTile, page_format, plan_for, stretches_for
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import check_contiguous, check_device, device_of
from fp4rl.kernels.numerics import dot, round_to
from fp4rl.kernels.paged_kv import (
    MIN_BF16_NVFP4_REDUCTION,
    KVPages,
    bf16_nvfp4_supported,
    check_queries,
    context_step,
    page_members,
    probabilities_times_values,
    read_rows,
)


@triton.jit
def _fold_twins(x_GC, TWIN: tl.constexpr, HALF: tl.constexpr, SUM: tl.constexpr):
    """Per-row values ``[BLOCK_G, C]`` of the twin rows folded onto the upper half: the sum of
    the two halves (SUM; the split products of V) or either (they are equal)."""
    if not TWIN:
        return x_GC
    halves = tl.reshape(x_GC, [2, HALF, x_GC.shape[1]])
    return tl.sum(halves, 0) if SUM else tl.max(halves, 0)


@triton.jit
def stretch_of(context, table_tokens, split, splits, BLOCK_N: tl.constexpr):
    """``(start, end)`` of stretch ``split`` of ``splits`` of a sequence's context (no further
    than its table covers): the context cut into equal stretches of whole ``BLOCK_N`` steps, the
    last one shorter, trailing ones empty where the context is short. Cut by each context, not
    by the table, so that a table wider than its context (the engine's graphs take the longest
    a sequence may grow to) leaves no program without work while another walks it all."""
    context = tl.minimum(context, table_tokens)
    stretch = tl.cdiv(tl.cdiv(context, splits), BLOCK_N) * BLOCK_N
    start = split * stretch
    return start, tl.minimum(start + stretch, context)


# Batch and table width change with every step: no recompiling for each.
@triton.jit(do_not_specialize=["num_kv_heads", "table_cols"])
def _paged_decode_kernel(
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
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NVFP4: tl.constexpr,
    SPLIT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    KEYS_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    DTYPE: tl.constexpr = q_BHD.dtype.element_ty
    b = tl.program_id(0) // num_kv_heads
    kv_head = tl.program_id(0) % num_kv_heads
    split = tl.program_id(1)
    # The dot needs 16 query rows; with G <= BLOCK_G / 2 heads the padding rows hold a second
    # copy of the heads (TWIN), which computes the same scores and probabilities and lets the
    # split product with V take two dots instead of three. Other padding rows stay zero.
    HALF: tl.constexpr = BLOCK_G // 2
    TWIN: tl.constexpr = G <= HALF
    g_G = tl.arange(0, BLOCK_G)
    d_D = tl.arange(0, D)
    head_G = g_G % HALF if TWIN else g_G
    # Query rows b * Hq + kv_head * G + head.
    q_rows = b.to(tl.int64) * (num_kv_heads * G) + kv_head * G + head_G
    q_GD = tl.load(
        q_BHD + q_rows[:, None] * D + d_D[None, :], mask=(head_G < G)[:, None], other=0.0
    )

    # This program's stretch of its sequence's context (`stretch_of`).
    start, end = stretch_of(tl.load(context_B + b), table_cols * PAGE, split, tl.num_programs(1),
                            BLOCK_N)  # fmt: skip
    table_row = table_BN + b.to(tl.int64) * table_cols
    m_G = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_G = tl.zeros([BLOCK_G], tl.float32)
    if KEYS_FIRST:
        # Tokens are the dots' rows: the decoded K tile is the first operand of the scores
        # (the one Hopper's tensor cores take from registers) and V's transpose that of the
        # output; the same arithmetic, transposed.
        acc_DG = tl.zeros([D, BLOCK_G], tl.float32)
        for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
            ok_N, k_ND, v_ND = context_step(
                k_pages, k_block_scale, k_amax, v_pages, v_block_scale, v_amax,
                table_row, n0, end, num_kv_heads, kv_head, BLOCK_N, PAGE, D, NVFP4, DTYPE,
            )  # fmt: skip
            scores = dot(k_ND, tl.trans(q_GD), tl.zeros([BLOCK_N, BLOCK_G], tl.float32))
            scores = tl.where(ok_N[:, None], scores * softmax_scale, float("-inf"))
            m_new = tl.maximum(m_G, tl.max(scores, 0))
            alpha = tl.exp(m_G - m_new)
            p_NG = tl.exp(scores - m_new[None, :])
            l_G = l_G * alpha + tl.sum(p_NG, 0)
            acc_DG = probabilities_times_values(
                p_NG, tl.trans(v_ND), acc_DG * alpha[None, :], TWIN, True
            )
            m_G = m_new
        acc_GD = tl.trans(acc_DG)
    else:
        acc_GD = tl.zeros([BLOCK_G, D], tl.float32)
        for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
            ok_N, k_ND, v_ND = context_step(
                k_pages, k_block_scale, k_amax, v_pages, v_block_scale, v_amax,
                table_row, n0, end, num_kv_heads, kv_head, BLOCK_N, PAGE, D, NVFP4, DTYPE,
            )  # fmt: skip
            scores = dot(q_GD, tl.trans(k_ND), tl.zeros([BLOCK_G, BLOCK_N], tl.float32))
            scores = tl.where(ok_N[None, :], scores * softmax_scale, float("-inf"))
            # Every step holds at least one token of the context (n0 < end): m_new is finite
            # unless the scores are not, and exp(-inf - m_new) = 0 on the first step.
            m_new = tl.maximum(m_G, tl.max(scores, 1))
            alpha = tl.exp(m_G - m_new)
            p_GN = tl.exp(scores - m_new[:, None])
            l_G = l_G * alpha + tl.sum(p_GN, 1)
            acc_GD = probabilities_times_values(p_GN, v_ND, acc_GD * alpha[:, None], TWIN, False)
            m_G = m_new

    # From here on rows are heads: the twins folded onto the upper half.
    H: tl.constexpr = HALF if TWIN else BLOCK_G
    m_H = tl.reshape(_fold_twins(m_G[:, None], TWIN, HALF, False), [H])
    l_H = tl.reshape(_fold_twins(l_G[:, None], TWIN, HALF, False), [H])
    acc_HD = _fold_twins(acc_GD, TWIN, HALF, True)
    h_H = tl.arange(0, H)
    out_rows = b.to(tl.int64) * (num_kv_heads * G) + kv_head * G + h_H
    head_ok = (h_H < G)[:, None]
    if SPLIT:
        # An empty stretch writes (-inf, 0, 0): the combine gives it weight 0.
        part = out_rows * tl.num_programs(1) + split
        tl.store(part_m + part, m_H, mask=h_H < G)
        tl.store(part_l + part, l_H, mask=h_H < G)
        tl.store(part_o + part[:, None] * D + d_D[None, :], acc_HD, mask=head_ok)
    else:
        out = tl.math.div_rn(acc_HD, l_H[:, None])
        tl.store(out_BHD + out_rows[:, None] * D + d_D[None, :], round_to(out, DTYPE), mask=head_ok)


@triton.jit
def _combine_splits_kernel(part_m, part_l, part_o, out_BHD, num_splits, D: tl.constexpr,
                           BLOCK_S: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """One query row: ``sum_s w_s acc_s / sum_s w_s l_s`` with ``w_s = exp(m_s - max m)``."""
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    s_S = tl.arange(0, BLOCK_S)
    ok_S = s_S < num_splits
    m_S = tl.load(part_m + row * num_splits + s_S, mask=ok_S, other=float("-inf"))
    l_S = tl.load(part_l + row * num_splits + s_S, mask=ok_S, other=0.0)
    w_S = tl.where(ok_S, tl.exp(m_S - tl.max(m_S, 0)), 0.0)
    d_D = tl.arange(0, D)
    o_SD = tl.load(
        part_o + (row * num_splits + s_S)[:, None] * D + d_D[None, :], mask=ok_S[:, None], other=0
    )
    out = tl.math.div_rn(tl.sum(w_S[:, None] * o_SD, 0), tl.sum(w_S * l_S, 0))
    tl.store(out_BHD + row * D + d_D, round_to(out, out_BHD.dtype.element_ty))


def launch(
    q_BHD: torch.Tensor,
    k: KVPages,
    v: KVPages,
    block_table_BN: torch.Tensor,
    context_B: torch.Tensor,
    *,
    config: DecodeTile | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention ``[B, Hq, D]`` in q's dtype (bfloat16 or float32): query b over the
    first ``context_B[b]`` tokens of its pages ``block_table_BN[b]`` (int32 block ids; columns
    past a context are not read). ``k``/``v``: one layer's pages, ``[num_blocks, P, K, D]``
    values (bfloat16, float16 or float32) or `NVFP4Rows` with codes ``[num_blocks, P, K,
    D/2]``, block scales ``[..., D/16]`` and row amaxes ``[..., 1]``.

    Not checked (it would need a device sync): that contexts fit their table (a longer one
    attends to the table's ``N * P`` tokens only) and that block ids within a context are
    valid pages.
    """
    check_queries("q_BHD", q_BHD, "[B, Hq, D]")
    B, Hq, D = q_BHD.shape
    if type(k) is not type(v):
        raise TypeError(f"k and v pages must be of one format; got {type(k).__name__}/"
                        f"{type(v).__name__}")  # fmt: skip
    nvfp4 = isinstance(k, NVFP4Rows)
    k_shape, v_shape = tuple(k.shape), tuple(v.shape)
    if len(k_shape) != 4 or k_shape != v_shape:
        raise ValueError(
            f"k and v pages must both be [num_blocks, P, K, D]; got {k_shape} and {v_shape}"
        )
    _, page, K, page_d = k_shape
    if page_d != D:
        raise ValueError(f"pages hold head dim D={page_d} but q_BHD is [B, Hq, D]={(B, Hq, D)}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim D={D} must be a power of two >= 16")
    if Hq % K:
        raise ValueError(f"query heads Hq={Hq} must be a multiple of the pages' KV heads K={K}")
    members = (*page_members("k", k), *page_members("v", v))
    for name, t in (("k", members[0]), ("v", members[3]), ("block_table_BN", block_table_BN),
                    ("context_B", context_B)):  # fmt: skip
        check_device(name, t, q_BHD.device)
    if (
        block_table_BN.dtype != torch.int32
        or block_table_BN.dim() != 2
        or (block_table_BN.shape[0] != B)
    ):
        raise ValueError(
            f"block_table_BN must be int32 of shape ({B}, N); got {block_table_BN.dtype} of "
            f"shape {tuple(block_table_BN.shape)}"
        )
    check_contiguous("block_table_BN", block_table_BN)
    if context_B.dtype != torch.int32 or tuple(context_B.shape) != (B,):
        raise ValueError(
            f"context_B must be int32 of shape ({B},); got {context_B.dtype} of shape "
            f"{tuple(context_B.shape)}"
        )
    check_contiguous("context_B", context_B)

    out_BHD = torch.empty_like(q_BHD)
    if B == 0:
        return out_BHD
    N = block_table_BN.shape[1]
    G = Hq // K
    if config is None:
        fmt = page_format(q_BHD, nvfp4, D, G)
        config, planned = plan_for(fmt, B * K, N * page, q_BHD.device)
        num_splits = planned if num_splits is None else num_splits
    tile = config
    if tile.registers:
        from fp4rl.kernels import paged_attention_registers

        paged_attention_registers.check_launch(q_BHD, nvfp4, D, G)
    elif nvfp4 and q_BHD.dtype == torch.bfloat16 and not bf16_nvfp4_supported(D, tile.block_n):
        raise ValueError(
            f"BF16 queries over NVFP4 pages need head dim and block_n >= "
            f"{MIN_BF16_NVFP4_REDUCTION} (shorter reductions miscompile on sm_90, see "
            f"MIN_BF16_NVFP4_REDUCTION); got D={D}, block_n={tile.block_n}"
        )
    splits = stretches_for(B * K, N * page, tile, q_BHD.device, num_splits)
    part_m = part_l = part_o = out_BHD  # stand-ins, not written without splits
    if splits > 1:
        part_m = torch.empty((B * Hq, splits), dtype=torch.float32, device=q_BHD.device)
        part_l = torch.empty_like(part_m)
        part_o = torch.empty((B * Hq, splits, D), dtype=torch.float32, device=q_BHD.device)
    with device_of(q_BHD):
        if tile.registers:
            paged_attention_registers.launch_kernel(
                (B * K, splits), q_BHD, k, v, block_table_BN, context_B, out_BHD,
                (part_m, part_l, part_o), block_n=tile.block_n,
            )  # fmt: skip
        else:
            _paged_decode_kernel[(B * K, splits)](
                q_BHD, *members, block_table_BN, context_B, out_BHD, part_m, part_l, part_o,
                1.0 / math.sqrt(D), K, N,
                G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, PAGE=page,
                BLOCK_N=tile.block_n, NVFP4=nvfp4, SPLIT=splits > 1, NUM_STAGES=tile.num_stages,
                KEYS_FIRST=tile.keys_first, num_warps=tile.num_warps,
                # The decode's two products must not merge into an FMA with anything.
                enable_fp_fusion=False,
                **dependent_launch.keywords(q_BHD.device),
            )  # fmt: skip
        if splits > 1:
            _combine_splits_kernel[(B * Hq,)](
                part_m, part_l, part_o, out_BHD, splits, D=D,
                BLOCK_S=triton.next_power_of_2(splits), num_warps=4, enable_fp_fusion=False,
                **dependent_launch.keywords(q_BHD.device),
            )  # fmt: skip
    return out_BHD


def reference_decode(
    q_BHD: torch.Tensor,
    k: KVPages,
    v: KVPages,
    block_table_BN: torch.Tensor,
    context_B: torch.Tensor,
) -> torch.Tensor:
    """The kernel's specification in plain PyTorch: ``attend_fp32`` (`fp4rl.rollout.attention`)
    over the rows ``KVCache.read`` returns, for one query token per sequence, op for op.

    Context rows are gathered through the block table and read in q's dtype (BF16 pages cast,
    NVFP4 rows dequantized by `reference.dequantize`); scores ``(q . k) * (1 / sqrt(D))``, the
    softmax over the context and the probability-value product run in FP32; the output is cast
    to q's dtype. Positions past a sequence's context read nothing: their scores are masked and
    their V taken as 0, so padding pages cannot leak NaN into other sequences. Reads the
    longest context on the host.
    """
    B, Hq, D = q_BHD.shape
    page, K = k.shape[1], k.shape[2]
    C = int(context_B.max()) if B else 0
    c_C = torch.arange(C, device=q_BHD.device)
    visible_BC = c_C < context_B.long()[:, None]
    table = block_table_BN.long()
    blocks_BC = table.gather(1, (c_C // page).clamp_max(max(table.shape[1] - 1, 0)).expand(B, C))
    slots_BC = torch.where(visible_BC, blocks_BC * page + c_C % page, 0)

    k_BCKD, v_BCKD = read_rows(k, slots_BC, q_BHD.dtype), read_rows(v, slots_BC, q_BHD.dtype)
    v_BCKD = v_BCKD.masked_fill(~visible_BC[:, :, None, None], 0)
    # attend_fp32 with one query per sequence: the same operations on the same shapes.
    q = q_BHD.float().view(B, 1, K, Hq // K, D)
    scores_BKGQC = torch.einsum("bqkgd,bckd->bkgqc", q, k_BCKD.float()) * (1.0 / math.sqrt(D))
    scores_BKGQC = scores_BKGQC.masked_fill(~visible_BC[:, None, None, None], float("-inf"))
    p = torch.softmax(scores_BKGQC, dim=-1)
    o = torch.einsum("bkgqc,bckd->bqkgd", p, v_BCKD.float()).reshape(B, Hq, D)
    return o.to(q_BHD.dtype)
