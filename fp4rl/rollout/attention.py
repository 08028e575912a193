"""The rollout's attention backend: store this step's K/V in the paged cache, attend over it.

The model sees a flat token stream; a step holds *segments*, one per sequence being extended:
the new tokens of a sequence at positions ``start .. start + num_new - 1`` (a whole prompt, or
one decode token). `PagedAttention.attend` writes the step's K/V into each sequence's blocks,
then lets each token attend causally to its own sequence's cached context, itself included.

Scores, softmax and the probability-value product run in FP32 (softmax scale ``1/sqrt(D)``),
the output is cast to the query dtype. On the GPU, decode segments (one token each) go to one
Triton kernel that reads BF16 or NVFP4 pages where they lie through the block tables
(`fp4rl.kernels.paged_attention`, via `fp4rl.ops`), and a step's prefill segments to another
(`fp4rl.kernels.paged_prefill`, flash-style tiles of query tokens). Elsewhere the context is
gathered and attended in plain PyTorch (`attend_fp32`, the kernels' spec): decodes batched over
a padded context, prefills one at a time so a long prompt never pads the batch.

Legend: T step tokens, S segments, N blocks per table, C context tokens, Hq/K query/kv heads,
G = Hq/K, D head dim.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from fp4rl import ops
from fp4rl.model.attention import NewKV, attend_fp32
from fp4rl.rollout.kv_cache import KVCache
from fp4rl.rollout.sampler import to_device

# Placed while the K/V store still ran (early dependents), the NVFP4 decode attention's
# programs took 98 -> 139 us a call at 64 decodes (4k context). With the store at exit and every
# other kernel early, the 48-layer NVFP4 step took 6.04, 7.92, 11.37, 15.28 and 24.19 ms at 8,
# 16, 32, 64 and 256 decodes (`python benchmarks/decode.py`, one H200, GPU time), against 6.12,
# 8.11 and 11.48 with the store early too, and 15.50 and 24.20 with no kernel early (17.13 and
# 28.14 with every kernel early). Below 8 the store stays early: one decode took 3.06 ms with it
# at exit, 3.03 early (BENCHMARKS.md).
STORE_AT_EXIT_MIN_DECODES = 8


@dataclass(frozen=True, slots=True)
class Segment:
    block_table: list[int]  # the sequence's blocks, covering start + num_new positions
    start: int  # positions already in the cache
    num_new: int  # tokens this step feeds


def _slots(table_SN: torch.Tensor, positions_SC: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position, per row of block tables."""
    blocks = table_SN.gather(1, positions_SC // block_size)
    return blocks * block_size + positions_SC % block_size


def _on_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host int64 ``tensors`` on ``device`` in one copy (`to_device`: to a GPU through pinned
    memory, queued; from pageable memory each copy would wait for every step queued before)."""
    flat = to_device(torch.cat([t.reshape(-1) for t in tensors]), device)
    parts = flat.split([t.numel() for t in tensors])
    return [part.view(t.shape) for part, t in zip(parts, tensors, strict=True)]


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Index tensors of one step, built once and shared by every layer."""

    positions_T: torch.Tensor  # long: position of each token in its own sequence
    slots_T: torch.Tensor  # long: cache slot each token's K/V is written to
    # Decode segments, batched: their token rows (increasing, so a step of decodes alone has
    # rows 0..T-1), padded context slots, and int32 context lengths (the kernel's type).
    decode_rows_B: torch.Tensor
    decode_slots_BC: torch.Tensor
    decode_context_B: torch.Tensor
    decode_table_BN: torch.Tensor  # int32 block tables of the decode segments (0-padded)
    # Prefill segments, one at a time: (first row, number of rows, context slots [C]).
    prefills: tuple[tuple[int, int, torch.Tensor], ...]
    # The same segments for the GPU's prefill kernel: (first row, start, number of rows) and
    # block tables, host lists (`ops.paged_prefill_plan` makes them device tensors once).
    prefill_segments: tuple[tuple[int, int, int], ...] = ()
    prefill_tables: tuple[list[int], ...] = ()

    @staticmethod
    def build(
        segments: list[Segment], block_size: int, device: torch.device | str
    ) -> AttentionMetadata:
        if not segments:
            raise ValueError("a step needs at least one segment")
        max_blocks = max(len(s.block_table) for s in segments)
        for s in segments:
            if -(-(s.start + s.num_new) // block_size) > len(s.block_table) or s.num_new < 1:
                raise ValueError(f"{s} does not fit its block table of block size {block_size}")
        table_SN = torch.tensor(
            [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in segments],
            dtype=torch.long,
        )
        positions_T = torch.cat([torch.arange(s.start, s.start + s.num_new) for s in segments])
        seg_T = torch.repeat_interleave(torch.tensor([s.num_new for s in segments]))
        slots_T = _slots(table_SN[seg_T], positions_T[:, None], block_size)[:, 0]

        first_row = [0]
        for s in segments:
            first_row.append(first_row[-1] + s.num_new)
        decodes = [i for i, s in enumerate(segments) if s.num_new == 1]
        context = torch.tensor([s.start + s.num_new for s in segments], dtype=torch.long)
        max_ctx = int(context[decodes].max()) if decodes else 0
        decode_slots = _slots(
            table_SN[decodes], torch.arange(max_ctx).expand(len(decodes), max_ctx), block_size
        )
        prefills = tuple(
            (
                first_row[i],
                s.num_new,
                _slots(table_SN[i : i + 1], torch.arange(s.start + s.num_new)[None], block_size)[0],
            )
            for i, s in enumerate(segments)
            if s.num_new > 1
        )
        positions_T, slots_T, rows_B, decode_slots, context_B, table_BN, *contexts = _on_device(
            [
                positions_T,
                slots_T,
                torch.tensor([first_row[i] for i in decodes], dtype=torch.long),
                decode_slots,
                context[decodes],
                table_SN[decodes],
                *(c for _, _, c in prefills),
            ],
            torch.device(device),
        )
        return AttentionMetadata(
            positions_T=positions_T,
            slots_T=slots_T,
            decode_rows_B=rows_B,
            decode_slots_BC=decode_slots,
            decode_context_B=context_B.to(torch.int32),
            decode_table_BN=table_BN.to(torch.int32),
            prefills=tuple((r, n, c) for (r, n, _), c in zip(prefills, contexts, strict=True)),
            prefill_segments=tuple(
                (first_row[i], s.start, s.num_new) for i, s in enumerate(segments) if s.num_new > 1
            ),
            prefill_tables=tuple(s.block_table for s in segments if s.num_new > 1),
        )


class PagedAttention:
    """`fp4rl.model.attention.AttentionBackend` over a `KVCache` for one step.

    Stores what the layer's KV sites produce (`NewKV.store`: the tensors of a BF16 layer; an
    NVFP4 one's rows quantized straight into the pages, each site's `NVFP4Tensor` recorded
    beside them when the forward's capture keeps it), then attends over the cache.

    ``prefill_plan``: the prefill kernel's plan over a prefill graph's inputs
    (`fp4rl.rollout.prefill_graphs`), given instead of ``meta``'s segments; the rows no segment
    covers are the graph's padding, and their attention output is 0. Such a step's decode rows
    (``meta.decode_rows_B``, the decode kernel's) may name a row more than once, as copies of one
    decode that compute its bits.
    """

    def __init__(self, cache: KVCache, meta: AttentionMetadata, prefill_plan=None) -> None:
        self.cache, self.meta = cache, meta
        self.positions = meta.positions_T
        self.padded = prefill_plan is not None
        # Built by the first layer that prefills on the GPU, unless given.
        self._prefill_plan = prefill_plan

    def attend(self, layer: int, q_THD: torch.Tensor, kv: NewKV) -> torch.Tensor:
        m = self.meta
        # From STORE_AT_EXIT_MIN_DECODES decodes, the kernels that store K/V let the decode
        # attention after them start only as they exit, even in a graph captured with early
        # dependents (`fp4rl.rollout.graphs`).
        at_exit = m.decode_rows_B.shape[0] >= STORE_AT_EXIT_MIN_DECODES
        with ops.early_dependents(q_THD.device, False) if at_exit else contextlib.nullcontext():
            kv.store(self.cache, layer, m.slots_T)
        if m.decode_rows_B.shape[0] == q_THD.shape[0] and not self.padded:
            # Decodes alone (a graphed step): their rows are all rows, in order, so the
            # queries and outputs need no gather and no scatter.
            return self._decode(layer, q_THD)
        q_THD = q_THD.contiguous()  # the prefill kernel reads it, and writes o_THD, in place
        o_THD = torch.zeros_like(q_THD) if self.padded else torch.empty_like(q_THD)
        if m.decode_rows_B.numel():
            o_THD[m.decode_rows_B] = self._decode(layer, q_THD[m.decode_rows_B])
        if m.prefills or self.padded:
            self._prefill(layer, q_THD, o_THD)
        return o_THD

    def _prefill(self, layer: int, q_THD: torch.Tensor, o_THD: torch.Tensor) -> None:
        """The prefill rows of ``o_THD``: on the GPU one kernel over every prefill segment,
        reading the pages where they lie (`fp4rl.ops`); elsewhere each segment's context is
        gathered and attended in plain PyTorch, the kernel's spec."""
        m = self.meta
        if self._prefill_plan is None:
            group = q_THD.shape[1] // self.cache.spec.num_kv_heads
            self._prefill_plan = ops.paged_prefill_plan(
                q_THD, m.prefill_segments, m.prefill_tables, group
            )
        k, v = self.cache.pages(layer)
        if ops.paged_prefill_attention(q_THD, k, v, self._prefill_plan, o_THD) is not None:
            return
        if self.padded:  # a graph's segments are on the device only
            raise RuntimeError(f"layers.{layer}: the prefill kernel does not run for these pages")
        step_kv = None  # the K/V of this step's rows, read once (reading is per row)
        for row, num, slots_C in m.prefills:
            if slots_C.numel() == num:  # prefilled from position 0: its context is its rows
                step_kv = step_kv or self.cache.read(layer, m.slots_T, q_THD.dtype)
                k_CKD, v_CKD = (t[row : row + num] for t in step_kv)
            else:
                k_CKD, v_CKD = self.cache.read(layer, slots_C, q_THD.dtype)
            o = attend_fp32(
                q_THD[None, row : row + num],
                k_CKD[None],
                v_CKD[None],
                m.positions_T[None, row : row + num],
                torch.tensor([slots_C.numel()], device=q_THD.device),
            )
            o_THD[row : row + num] = o[0].to(q_THD.dtype)

    def _decode(self, layer: int, q_BHD: torch.Tensor) -> torch.Tensor:
        """Attention ``[B, Hq, D]`` of the decode rows' queries over their cached contexts: on
        the GPU one kernel reads the pages where they lie (`fp4rl.ops`), elsewhere the
        context is gathered and attended in plain PyTorch, the kernel's spec."""
        m = self.meta
        fused = ops.paged_decode_attention(
            q_BHD, *self.cache.pages(layer), m.decode_table_BN, m.decode_context_B
        )
        return fused if fused is not None else self._gathered_decode(layer, q_BHD)

    def _gathered_decode(self, layer: int, q_BHD: torch.Tensor) -> torch.Tensor:
        m = self.meta
        k_BCKD, v_BCKD = self.cache.read(layer, m.decode_slots_BC, q_BHD.dtype)
        positions_B1 = m.positions_T[m.decode_rows_B][:, None]
        o = attend_fp32(q_BHD[:, None], k_BCKD, v_BCKD, positions_B1, m.decode_context_B)
        return o[:, 0].to(q_BHD.dtype)
