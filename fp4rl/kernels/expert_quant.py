"""Per-group NVFP4 quantize (`reference.quantize` with ``scaling=2`` on ``[E, N, K]`` experts, or
any group of consecutive rows) in one launch that reads each group from HBM once.

A group's global scale needs the amax of the whole group before its first code, so the group is
read twice: an amax pass, then the quantize pass. An expert's weight is a few MiB (W2 of
Qwen3-30B-A3B 3 MiB, W1+W3 6 MiB), far below an H200's 50 MB L2, so the second read hits L2 if
it follows the first closely. The kernel is persistent: a fixed grid of programs takes work
items from one ticket counter, in an order that puts the quantize items of group g right after
the amax items of group g + lag:

    amax(0) .. amax(lag - 1) | amax(lag) quant(0) | amax(lag + 1) quant(1) | .. | quant(G - 1)

(each ``amax(g)`` / ``quant(g)`` is the group's ``items_per_group`` items of ``item_rows``
rows). An amax item folds its rows' maximum into the group's int32 slot (`atomic_max` on the
FP32 bits, as `amax.group_amax_bits`, so the result does not depend on the order) and counts
itself done (acquire-release); the group's last one computes the global scale and publishes it
(release). A quantize item waits (acquire) for that scale, which the lag makes rare: a program
holds two tickets (the item it works on and the next), and with ``2 * lag * items_per_group``
tickets between amax(g) and quant(g) at least twice the number of programs plus one group, every
amax item of g is finished before quant(g) is dealt. Amax reads ask L2 to keep their lines
(``evict_last``), quantize reads to let them go (``evict_first``).

Within an item a program issues the loads of its next chunk before it works on the current one,
and it takes its next ticket and its group's scale while the item's first chunk is loading, so
the atomics' round trips hide behind memory traffic.

Tickets are dealt in order and only to running programs, and an item waits only on items with
smaller tickets: the smallest unfinished ticket is always being worked on or is next for a
program whose current item is done, so the kernel cannot deadlock however many programs are
resident (other kernels on the GPU, MPS). Under Triton's CPU interpreter, which runs programs
one after another, the first program does every item in order.

Per item the arithmetic is `tiles.quantize_chunk`, as in `nearest`'s kernel, so the bits are
the reference's. With FAKE the kernel stores ``dequantize(quantize(x))`` in x's dtype instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4rl.kernels.launch import device_of, interpreting, multiprocessors, pair_view
from fp4rl.kernels.numerics import global_scale_from_amax, is_finite, max_nan, ratio_divisor
from fp4rl.kernels.tiles import block_amax, load_raw, quantize_chunk, unpack_raw


@triton.jit
def _work_of(ticket, num_groups, items_per_group, lag):
    """``(quantize?, group, item)`` of a ticket in the order of the module docstring."""
    C = items_per_group
    lead = tl.minimum(lag, num_groups)  # groups whose amax items come before any quantize item
    paired = num_groups - lead  # pairs [amax(j + lead), quant(j)]
    u = ticket - lead * C
    v = u - paired * 2 * C
    in_pairs = (u >= 0) & (v < 0)
    second = tl.where(in_pairs, (u % (2 * C)) >= C, u >= 0)
    group = tl.where(
        u < 0,
        ticket // C,
        tl.where(in_pairs, u // (2 * C) + tl.where(second, 0, lead), paired + v // C),
    )
    item = tl.where(u < 0, ticket % C, tl.where(in_pairs, u % C, v % C))
    return second, group, item


@triton.jit
def _item(ticket, num_tickets, num_groups, items_per_group, item_rows, rows_per_group, lag):
    """``(quantize?, group, first row, end row)`` of a ticket's item; no rows past the last
    ticket."""
    second, g, item = _work_of(ticket, num_groups, items_per_group, lag)
    first_row = g * rows_per_group + item * item_rows
    end_row = tl.minimum(first_row + item_rows, (g + 1) * rows_per_group)
    return second, g, first_row, tl.where(ticket < num_tickets, end_row, first_row)


@triton.jit
def _chunk_rows(first_row, end_row, c, CHUNKS_PER_ROW: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_K: tl.constexpr):  # fmt: skip
    """Rows ``[BLOCK_R]``, their mask and the first column of an item's chunk c (row-major)."""
    rows_R = first_row + (c // CHUNKS_PER_ROW) * BLOCK_R + tl.arange(0, BLOCK_R)
    return rows_R, rows_R < end_row, (c % CHUNKS_PER_ROW) * BLOCK_K


@triton.jit
def _load_chunk(x_RK, first_row, end_row, c, K, second, CHUNKS_PER_ROW: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """`tiles.load_raw` of an item's chunk c. Amax reads (``second`` false) ask L2 to keep the
    lines for the quantize reads, which let them go."""
    rows_R, row_ok_R, k0 = _chunk_rows(first_row, end_row, c, CHUNKS_PER_ROW, BLOCK_R, BLOCK_K)
    if second:
        raw = load_raw(x_RK, rows_R, row_ok_R, k0, K, BLOCK_K, "evict_first")
    else:
        raw = load_raw(x_RK, rows_R, row_ok_R, k0, K, BLOCK_K, "evict_last")
    return raw


# Expert counts and row counts vary; K (a model dimension) is specialized.
@triton.jit(
    do_not_specialize=[
        "R", "rows_per_group", "num_groups", "items_per_group", "item_rows", "chunks_per_item",
        "lag",
    ]
)  # fmt: skip
def _expert_quantize_kernel(
    x_RK,
    codes_RK8,
    block_scale_RKB,
    fake_RK,
    global_scale_G,
    work,  # int32 zeros [1 + 3G]: the ticket counter, then per group its amax, done, scale word
    R,
    K,
    rows_per_group,
    num_groups,
    items_per_group,
    item_rows,
    chunks_per_item,
    lag,
    FAKE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNKS_PER_ROW: tl.constexpr,
):
    amax_bits_G = work + 1
    done_G = amax_bits_G + num_groups
    # The group's global scale once known, as ~bits (never 0: the bits of a scale are >= 0).
    scale_word_G = done_G + num_groups
    num_tickets = 2 * num_groups * items_per_group
    ticket = tl.atomic_add(work, 1, sem="relaxed")
    while ticket < num_tickets:
        second, g, first_row, end_row = _item(
            ticket, num_tickets, num_groups, items_per_group, item_rows, rows_per_group, lag
        )
        # The first chunk's loads go out before the round trips of the atomics below (the next
        # ticket; the group's scale), and inside the item each chunk's loads before the work on
        # the one before. (A loaded chunk carried from one item to the next would overlap more,
        # but Triton 3.6 fails to compile a tensor carried through this while loop.)
        raw = _load_chunk(x_RK, first_row, end_row, 0, K, second, CHUNKS_PER_ROW, BLOCK_R, BLOCK_K)
        next_ticket = tl.atomic_add(work, 1, sem="relaxed")
        word = tl.atomic_add(scale_word_G + g, 0, mask=second, sem="acquire")
        while second & (word == 0):  # the group's last amax item has not published its scale
            word = tl.atomic_add(scale_word_G + g, 0, sem="acquire")
        s_R = tl.zeros([BLOCK_R], tl.float32) + (~word).to(tl.float32, bitcast=True)
        scale_R, d_scaled_R, reciprocal_R = ratio_divisor(s_R)
        amax_RB = tl.zeros([BLOCK_R, BLOCK_K // 16], tl.float32)
        for c in range(0, chunks_per_item):
            # The next chunk of the item (none after the last: all its rows masked).
            last = c == chunks_per_item - 1
            raw_next = _load_chunk(
                x_RK, first_row, tl.where(last, first_row, end_row), c + 1, K, second,
                CHUNKS_PER_ROW, BLOCK_R, BLOCK_K,
            )  # fmt: skip
            x_even, x_odd = unpack_raw(raw)
            block_amax_RB = block_amax(x_even, x_odd)
            rows_R, row_ok_R, k0 = _chunk_rows(first_row, end_row, c, CHUNKS_PER_ROW, BLOCK_R,
                                               BLOCK_K)  # fmt: skip
            if second:
                quantize_chunk(
                    x_even, x_odd, block_amax_RB, s_R, scale_R, d_scaled_R, reciprocal_R, fake_RK,
                    codes_RK8, block_scale_RKB, rows_R, row_ok_R, k0, K, POISON_BLOCKS=False,
                    FAKE=FAKE, BLOCK_K=BLOCK_K,
                )  # fmt: skip
            else:
                amax_RB = max_nan(amax_RB, block_amax_RB)
            raw = raw_next
        if not second:
            # As bits, +inf and (positive) NaN rank above every number: a non-finite item
            # poisons its group. Release: the maximum lands before the count says so.
            amax = tl.reduce(tl.reduce(amax_RB, 1, max_nan), 0, max_nan)
            tl.atomic_max(amax_bits_G + g, amax.to(tl.int32, bitcast=True), sem="relaxed")
            finished = tl.atomic_add(done_G + g, 1, sem="acq_rel")
            if finished == items_per_group - 1:  # the group's last amax item publishes its scale
                amax = tl.atomic_add(amax_bits_G + g, 0, sem="acquire").to(tl.float32, bitcast=True)
                s = global_scale_from_amax(amax, is_finite(amax))
                if not FAKE:
                    tl.store(global_scale_G + g, s)
                tl.atomic_xchg(scale_word_G + g, ~s.to(tl.int32, bitcast=True), sem="release")
        ticket = next_ticket


@dataclass(frozen=True, slots=True)
class ExpertConfig:
    """``tile`` elements per chunk (``BLOCK_R x BLOCK_K``), ``item_elements`` per work item (a
    whole number of row blocks), ``programs_per_sm`` resident programs of ``num_warps``."""

    tile: int
    item_elements: int
    num_warps: int
    programs_per_sm: int
    lag: int | None = None  # groups of amax items dealt ahead (None: enough that none waits)


CONFIGS = {
    # Offline compile for sm_90 (Triton 3.6): 128 registers per thread at K = 2048, 141 at 768,
    # so 3-4 programs of 4 warps per SM; items of 32 KiB of BF16 keep what is read between the
    # two passes of a row well inside L2 (module docstring). Timed on an H200: BENCHMARKS.md.
    "default": ExpertConfig(tile=4096, item_elements=16384, num_warps=4, programs_per_sm=4),
    # Small enough that tests' tiny groups span several items and several row blocks per item.
    "tiny": ExpertConfig(tile=64, item_elements=128, num_warps=4, programs_per_sm=1),
}

# Groups up to this size can come here; a larger one cannot stay in L2 between its two passes,
# and `nearest` reads it twice from HBM with its amax pass in a launch of its own. 0: `nearest`
# sends nothing here, because on an H200 this kernel is slower than those two launches at both
# expert shapes of Qwen3-30B-A3B (BENCHMARKS.md, "Refit: per-expert quantize in one launch").
MAX_GROUP_BYTES = 0


def fits(x_RK: torch.Tensor, rows_per_group: int) -> bool:
    """Whether groups of ``rows_per_group`` rows of x_RK are quantized here."""
    group_bytes = rows_per_group * x_RK.shape[1] * x_RK.element_size()
    return rows_per_group > 1 and group_bytes <= MAX_GROUP_BYTES


def block_k_for(k: int) -> int:
    """The widest power-of-two chunk (16 to 1024) that pads rows of k by at most 1/8: 768-wide
    rows (W2) walk three 256-wide chunks instead of one 1024-wide chunk a quarter masked."""
    block_k = 1024
    while block_k > 16 and -(-k // block_k) * block_k * 8 > 9 * k:
        block_k //= 2
    return block_k


def launch(
    x_RK: torch.Tensor,
    rows_per_group: int,
    global_scale: torch.Tensor,
    out_RK: torch.Tensor,
    codes_words: torch.Tensor,
    block_scale: torch.Tensor,
    *,
    fake: bool,
    config: ExpertConfig | None = None,
) -> None:
    """Quantize contiguous ``x_RK [R, K]`` (R > 0) in groups of ``rows_per_group`` rows into the
    buffers of `launch.outputs` and ``global_scale`` (FP32, one per group, contiguous; not
    written with ``fake``). The caller (`nearest.launch`) has checked x."""
    num_rows, k = x_RK.shape
    if rows_per_group < 1 or num_rows % rows_per_group:
        raise ValueError(f"rows_per_group={rows_per_group} does not divide R={num_rows}")
    config = config or CONFIGS["default"]
    num_groups = num_rows // rows_per_group
    block_k = min(block_k_for(k), max(16, config.tile))
    block_r = max(1, config.tile // block_k)
    chunks = -(-k // block_k)  # per row
    row_blocks = -(-rows_per_group // block_r)  # per group
    per_item = max(1, config.item_elements // (block_r * block_k * chunks))
    item_rows = block_r * min(per_item, row_blocks)
    items_per_group = -(-rows_per_group // item_rows)
    if interpreting() or not x_RK.is_cuda:
        num_programs = 2  # run one after another: the first does every item
    else:
        num_programs = config.programs_per_sm * multiprocessors(x_RK.device)
    num_programs = min(num_programs, 2 * num_groups * items_per_group)
    # Enough tickets between amax(g) and quant(g) that every program has finished both items it
    # held when the last amax item of g was dealt.
    lag = -(-(2 * num_programs + items_per_group) // (2 * items_per_group))
    lag = lag if config.lag is None else config.lag
    work = torch.zeros(1 + 3 * num_groups, dtype=torch.int32, device=x_RK.device)
    with device_of(x_RK):
        _expert_quantize_kernel[(num_programs,)](
            pair_view(x_RK), codes_words, block_scale, out_RK, global_scale, work, num_rows, k,
            rows_per_group, num_groups, items_per_group, item_rows, item_rows // block_r * chunks,
            lag, FAKE=fake, BLOCK_R=block_r, BLOCK_K=block_k, CHUNKS_PER_ROW=chunks,
            num_warps=config.num_warps, num_stages=1, enable_fp_fusion=False,
        )  # fmt: skip
