"""Prefill attention over paged KV, read where it lies: BF16 pages or NVFP4 pages.

A step's prefill segments each feed ``num`` new tokens of one sequence, at positions ``start ..
start + num - 1``; their K/V are already in the cache. Query row i of a segment attends
causally to the sequence's cached tokens ``0 .. start + i`` through the segment's block-table
row. One launch covers every prefill segment of a step: each program takes one KV head and one
*tile* of BLOCK_Q consecutive query tokens of one segment, i.e. ``BLOCK_Q * G`` rows (token,
query head), and walks the tile's context BLOCK_N tokens at a time with an online softmax, as
flash attention does. Nothing is gathered to memory. The tiles are listed on the host
(`plan`), once per step, so a launch reads no sizes back. A CUDA graph's plan is a fixed
number of tiles over tensors its caller rewrites each step (`plan_over`): the tiles it does not
need name a segment of no tokens, whose program reads no context and stores nothing.

Numerics: those of the decode kernel (`paged_attention`), whose steps this kernel reuses: K
and V enter the dots as exactly the values ``KVCache.read`` returns; scores ``(q . k) * (1 /
sqrt(D))`` and the softmax are FP32, with BF16 queries on the tensor cores (exact products,
FP32 sums); each FP32 probability meets V as three BF16 parts whose sum is exactly p; the
output is ``acc / l``, rounded once to the query dtype. Against the spec, `reference_prefill`
(``attend_fp32`` over ``KVCache.read``, one segment at a time, what the engine ran before),
only the order of the FP32 sums and the exp approximation differ.

NaN: a NaN K or V value at context position c of a sequence reaches only the rows of that
sequence and KV head whose tile reads position c, i.e. every row at position c or later and
possibly earlier rows of the same tile (a probability of 0 times NaN). The spec, which
multiplies every probability by every V row of the context, spreads a NaN V row to the whole
group. Tokens past a tile's last query are never read.

Legend: T step tokens, S segments, P programs (tiles), N table columns, Hq query heads, K KV
heads, G = Hq / K, D head dim.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4rl.fp4.tensor import NVFP4Rows
from fp4rl.kernels.launch import check_contiguous, check_device, device_of
from fp4rl.kernels.numerics import dot, round_to
from fp4rl.kernels.paged_kv import (
    KVPages,
    bf16_nvfp4_supported,
    check_queries,
    context_step,
    page_members,
    probabilities_times_values,
    read_rows,
)


@triton.jit(do_not_specialize=["num_kv_heads", "table_cols"])
def _paged_prefill_kernel(
    q_THD,
    k_pages,
    k_block_scale,
    k_amax,
    v_pages,
    v_block_scale,
    v_amax,
    table_SN,
    segments_S3,
    tiles_P2,
    out_THD,
    softmax_scale,
    num_kv_heads,
    table_cols,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NVFP4: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    DTYPE: tl.constexpr = q_THD.dtype.element_ty
    ROWS: tl.constexpr = BLOCK_Q * BLOCK_G
    kv_head = tl.program_id(1)
    seg = tl.load(tiles_P2 + 2 * tl.program_id(0))
    q0 = tl.load(tiles_P2 + 2 * tl.program_id(0) + 1)
    first_row = tl.load(segments_S3 + 3 * seg)
    start = tl.load(segments_S3 + 3 * seg + 1)
    num = tl.load(segments_S3 + 3 * seg + 2)

    # Row r of the tile: query token q0 + r // BLOCK_G of the segment, query head r % BLOCK_G of
    # the KV head's group. Rows past the segment or the group read nothing and store nothing;
    # they attend as the segment's last token does, so their softmax stays finite.
    r_R = tl.arange(0, ROWS)
    token_R = q0 + r_R // BLOCK_G
    head_R = r_R % BLOCK_G
    ok_R = (token_R < num) & (head_R < G)
    position_R = start + tl.minimum(token_R, num - 1)
    q_rows = (first_row + token_R).to(tl.int64) * (num_kv_heads * G) + kv_head * G + head_R
    d_D = tl.arange(0, D)
    q_RD = tl.load(q_THD + q_rows[:, None] * D + d_D[None, :], mask=ok_R[:, None], other=0.0)

    # The tile's context: every token up to its last query's position.
    end = tl.minimum(start + tl.minimum(q0 + BLOCK_Q, num), table_cols * PAGE)
    table_row = table_SN + seg.to(tl.int64) * table_cols
    m_R = tl.full([ROWS], float("-inf"), tl.float32)
    l_R = tl.zeros([ROWS], tl.float32)
    acc_RD = tl.zeros([ROWS, D], tl.float32)
    for n0 in tl.range(0, end, BLOCK_N, num_stages=NUM_STAGES):
        ok_N, k_ND, v_ND = context_step(
            k_pages, k_block_scale, k_amax, v_pages, v_block_scale, v_amax,
            table_row, n0, end, num_kv_heads, kv_head, BLOCK_N, PAGE, D, NVFP4, DTYPE,
        )  # fmt: skip
        scores = dot(q_RD, tl.trans(k_ND), tl.zeros([ROWS, BLOCK_N], tl.float32))
        t_N = n0 + tl.arange(0, BLOCK_N)
        visible = ok_N[None, :] & (t_N[None, :] <= position_R[:, None])
        scores = tl.where(visible, scores * softmax_scale, float("-inf"))
        # Every row sees context token 0 on the first step: m_new is finite from there on
        # unless the scores are not, and exp(-inf - m_new) = 0.
        m_new = tl.maximum(m_R, tl.max(scores, 1))
        alpha = tl.exp(m_R - m_new)
        p_RN = tl.exp(scores - m_new[:, None])
        l_R = l_R * alpha + tl.sum(p_RN, 1)
        acc_RD = probabilities_times_values(p_RN, v_ND, acc_RD * alpha[:, None], False, False)
        m_R = m_new
    out = tl.math.div_rn(acc_RD, l_R[:, None])
    tl.store(out_THD + q_rows[:, None] * D + d_D[None, :], round_to(out, DTYPE), mask=ok_R[:, None])


@dataclass(frozen=True, slots=True)
class PrefillTile:
    """One program: ``rows`` of the dots (query tokens times the group's heads padded to a power
    of two; at least one token) against ``block_n`` context tokens a step, ``num_stages`` steps
    of loads in flight. Powers of two; rows >= 16, the tensor cores' smallest tile."""

    rows: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("rows", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"PrefillTile.{name} must be a power of two >= 16; got {v}")

    def block_q(self, group: int) -> int:
        """Query tokens per tile for ``group`` query heads per KV head."""
        return max(1, self.rows // triton.next_power_of_2(group))


# For the Qwen3-30B-A3B attention shape (32 / 4 heads of 128: 8 tokens a tile) on one H200, from
# the sweep of benchmarks/prefill_attention.py recorded in BENCHMARKS.md: 64 rows against
# 64-token steps, 4 warps, 2 loads in flight, was the fastest over BF16 pages (64 prompts x 512
# tokens: 1.15 ms against 1.38 for 128 rows of 8 warps) and within 6 % of the fastest over
# NVFP4 pages. 64 rows against 128-token steps over NVFP4 pages fails to compile on Triton 3.6
# (TritonGPUOptimizeDotOperands), and 128-token steps with FP32 queries need more shared memory
# than an H200 has.
TILE = PrefillTile(rows=64, block_n=64, num_warps=4, num_stages=2)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """One step's prefill segments as the kernel reads them (device tensors, built once per step
    by `plan` and shared by every layer): ``segments_S3`` int32 rows of (first row in the
    step's token stream, start position, new tokens); ``table_SN`` their int32 block tables;
    ``tiles_P2`` int32 rows of (segment, first query token of the tile), one per program."""

    segments_S3: torch.Tensor
    table_SN: torch.Tensor
    tiles_P2: torch.Tensor
    tile: PrefillTile
    group: int  # query heads per KV head the plan was tiled for
    block_q: int  # query tokens per tile: ``tile.block_q(group)``


def plan(
    segments: Sequence[tuple[int, int, int]],
    block_tables: Sequence[Sequence[int]],
    group: int,
    device: torch.device | str,
    *,
    tile: PrefillTile | None = None,
) -> PrefillPlan:
    """The plan of prefill ``segments`` (``(first row, start, num)`` each: the segment's
    queries are rows ``first row ..`` of the step's ``q_THD``, at positions ``start ..
    start + num - 1``) over their ``block_tables`` (block ids covering ``start + num``
    positions), for ``group`` query heads per KV head."""
    tile = tile or TILE
    if group < 1:
        raise ValueError(f"group must be a positive number of query heads per KV head; got {group}")
    if len(segments) != len(block_tables):
        raise ValueError(
            f"one block table per segment: {len(segments)} segments, {len(block_tables)} tables"
        )
    for s in segments:
        if len(s) != 3 or min(s) < 0 or s[2] < 1:
            raise ValueError(f"a segment is (first row, start, num >= 1); got {tuple(s)}")
    block_q = tile.block_q(group)
    width = max((len(t) for t in block_tables), default=0)
    table = [list(t) + [0] * (width - len(t)) for t in block_tables]
    tiles = [(i, q0) for i, (_, _, num) in enumerate(segments) for q0 in range(0, num, block_q)]
    # One copy of the three, queued from pinned memory on a GPU (a copy from pageable memory
    # would wait for every kernel queued before it).
    host = torch.tensor(
        [*itertools.chain(*segments), *itertools.chain(*table), *itertools.chain(*tiles)],
        dtype=torch.int32,
    )
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    segments_S3, table_SN, tiles_P2 = host.to(device, non_blocking=True).split(
        [3 * len(segments), width * len(segments), 2 * len(tiles)]
    )
    return PrefillPlan(
        segments_S3=segments_S3.view(-1, 3),
        table_SN=table_SN.view(len(segments), width),
        tiles_P2=tiles_P2.view(-1, 2),
        tile=tile,
        group=group,
        block_q=block_q,
    )


def plan_over(
    segments_S3: torch.Tensor,
    table_SN: torch.Tensor,
    tiles_P2: torch.Tensor,
    group: int,
    *,
    tile: PrefillTile | None = None,
) -> PrefillPlan:
    """A plan over int32 tensors its caller fills step after step (a CUDA graph's inputs,
    read by every replay): rows as `plan` makes them, except that a segment may have no tokens
    (``num`` 0), and a tile of such a segment reads no context and stores nothing, so a tile
    list of a fixed length is padded with them. The caller lists the tiles of ``block_q`` tokens
    (`PrefillTile.block_q`)."""
    tile = tile or TILE
    if group < 1:
        raise ValueError(f"group must be a positive number of query heads per KV head; got {group}")
    for name, t, cols in (
        ("segments_S3", segments_S3, 3),
        ("table_SN", table_SN, None),
        ("tiles_P2", tiles_P2, 2),
    ):
        if t.dtype != torch.int32 or t.dim() != 2 or t.shape[1] != (cols or t.shape[1]):
            raise ValueError(f"{name} must be an int32 [rows, {cols or 'N'}] tensor; got "
                             f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
        check_contiguous(name, t)
        check_device(name, t, segments_S3.device)
    if table_SN.shape[0] != segments_S3.shape[0]:
        raise ValueError(f"one table row per segment: {segments_S3.shape[0]} segments, "
                         f"{table_SN.shape[0]} table rows")  # fmt: skip
    block_q = tile.block_q(group)
    return PrefillPlan(segments_S3, table_SN, tiles_P2, tile, group, block_q)


def launch(
    q_THD: torch.Tensor, k: KVPages, v: KVPages, prefill: PrefillPlan, out_THD: torch.Tensor
) -> torch.Tensor:
    """Write the prefill rows of ``out_THD`` (``[T, Hq, D]``, q's dtype; other rows are not
    touched): each segment's queries over its cached context through its block table. ``k``,
    ``v``: one layer's pages, ``[num_blocks, P, K, D]`` values or `NVFP4Rows` (as for
    `paged_attention.launch`). Returns ``out_THD``.

    Not checked (it would need a device sync or a walk over the plan): that the segments' rows
    lie within q, that their tables cover their contexts and name valid pages.
    """
    check_queries("q_THD", q_THD, "[T, Hq, D]")
    if out_THD.shape != q_THD.shape or out_THD.dtype != q_THD.dtype:
        raise ValueError(
            f"out_THD must be like q_THD ({q_THD.dtype} {tuple(q_THD.shape)}); got "
            f"{out_THD.dtype} {tuple(out_THD.shape)}"
        )
    check_contiguous("out_THD", out_THD)
    T, Hq, D = q_THD.shape
    if type(k) is not type(v) or tuple(k.shape) != tuple(v.shape) or len(k.shape) != 4:
        raise ValueError(
            f"k and v pages must be of one format and both [num_blocks, P, K, D]; got "
            f"{type(k).__name__} {tuple(k.shape)} and {type(v).__name__} {tuple(v.shape)}"
        )
    _, page, K, page_d = k.shape
    if page_d != D or D < 16 or D & (D - 1):
        raise ValueError(f"pages hold head dim {page_d}; q_THD's D={D} must equal it, a power "
                         "of two >= 16")  # fmt: skip
    if Hq % K or Hq // K != prefill.group:
        raise ValueError(
            f"query heads Hq={Hq} over the pages' K={K} KV heads must give the plan's group of "
            f"{prefill.group}"
        )
    nvfp4 = isinstance(k, NVFP4Rows)
    tile = prefill.tile
    if nvfp4 and q_THD.dtype == torch.bfloat16 and not bf16_nvfp4_supported(D, tile.block_n):
        raise ValueError(
            f"BF16 queries over NVFP4 pages need head dim and block_n >= 32 (shorter reductions "
            f"miscompile on sm_90); got D={D}, block_n={tile.block_n}"
        )
    members = (*page_members("k", k), *page_members("v", v))
    for name, t in (("k", members[0]), ("v", members[3]), ("out_THD", out_THD),
                    ("plan", prefill.tiles_P2)):  # fmt: skip
        check_device(name, t, q_THD.device)
    programs = prefill.tiles_P2.shape[0]
    if programs == 0:
        return out_THD
    G = prefill.group
    with device_of(q_THD):
        _paged_prefill_kernel[(programs, K)](
            q_THD, *members, prefill.table_SN, prefill.segments_S3, prefill.tiles_P2, out_THD,
            1.0 / math.sqrt(D), K, prefill.table_SN.shape[1],
            G=G, BLOCK_G=triton.next_power_of_2(G), BLOCK_Q=prefill.block_q, D=D, PAGE=page,
            BLOCK_N=tile.block_n, NVFP4=nvfp4, NUM_STAGES=tile.num_stages,
            num_warps=tile.num_warps,
            # The decode's two products must not merge into an FMA with anything.
            enable_fp_fusion=False,
        )  # fmt: skip
    return out_THD


def reference_prefill(
    q_THD: torch.Tensor,
    k: KVPages,
    v: KVPages,
    segments: Sequence[tuple[int, int, int]],
    block_tables: Sequence[Sequence[int]],
) -> torch.Tensor:
    """The kernel's specification in plain PyTorch: for each segment ``(first row, start,
    num)``, ``attend_fp32`` (`fp4rl.model.attention`, op for op: this layer may not import it)
    of its query rows over its context ``0 .. start + num - 1`` as ``KVCache.read`` returns it,
    what the engine's prefill ran before this kernel. Returns the prefill rows' outputs ``[sum
    num, Hq, D]`` in segment order."""
    page, K = k.shape[1], k.shape[2]
    _, Hq, D = q_THD.shape
    outs = []
    for (row, start, num), table in zip(segments, block_tables, strict=True):
        C = start + num
        c_C = torch.arange(C, device=q_THD.device)
        blocks = torch.tensor(table, device=q_THD.device)[c_C // page]
        slots_C = blocks * page + c_C % page
        k_1CKD = read_rows(k, slots_C, q_THD.dtype)[None]
        v_1CKD = read_rows(v, slots_C, q_THD.dtype)[None]
        positions_1Q = torch.arange(start, start + num, device=q_THD.device)[None]
        q = q_THD[None, row : row + num].float().view(1, num, K, Hq // K, D)
        scores = torch.einsum("bqkgd,bckd->bkgqc", q, k_1CKD.float()) * (1.0 / math.sqrt(D))
        visible = (c_C <= positions_1Q[:, :, None]) & (c_C < C)
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o = torch.einsum("bkgqc,bckd->bqkgd", p, v_1CKD.float()).reshape(1, num, Hq, D)
        outs.append(o[0].to(q_THD.dtype))
    return torch.cat(outs)
