"""CUDA graphs of the engine's steps that prefill, one per token bucket and decode bucket.

A prompt of a few hundred tokens costs the GPU a few milliseconds, but its eager step costs the
host more: each layer launches a dozen kernels and their torch glue one at a time. On one H200
the 12-layer Qwen3-30B-A3B shape's 512-token prompt kept the GPU busy 5.5 ms of a 25 ms step
(BENCHMARKS.md, "Prefill steps from CUDA graphs"). A graph replays the same kernels from one
launch.

A step that prefills (a prompt or a chunk of one, alone or beside the running sequences'
decodes) and feeds at most `MAX_PREFILL_GRAPH_TOKENS` tokens replays the graph of the smallest
bucket of ``t >= T`` tokens and, when ``B`` of its segments decode (one token each), of the
decode graphs' bucket ``d >= B`` (`fp4rl.rollout.graphs.bucket_for`): the prefill kernel
attends the prompts, the decode kernel the decodes, as in an eager step. Steps of decodes alone
replay the decode graphs.

What the graph reads lies in one int64 device buffer, staged from pinned host memory by one copy
a step (`PrefillInputs`): each token's id, position and cache slot, then the prefill
attention's plan (`fp4rl.ops.paged_prefill_plan_over`): the segments, the kernel's tiles and
the segments' block tables, and the decodes' rows, context lengths and block tables. Segment
row 0 has no tokens; the tiles a step does not need name it and do nothing. Decode slots
``B..d`` copy the decode of the shortest context, whose bits they compute and write again.
Rows ``T..t`` are padding: the step's first token at position 0, its K and V written to the
cache's scratch block (which no sequence reads), its attention output 0 (no segment covers
it). They compute like any token and are dropped.

The graph returns the final-normed hidden states of its rows (in its own memory, overwritten by
the next replay); the engine takes the rows it samples from and runs the lm_head on them
eagerly, one GEMM, where a graph would pay for a fixed number of rows. Records (routing,
guidance) are packed by the graph's last kernel and their rows ``0..T`` copied to pinned host
memory behind the replay, as a decode graph's are (`fp4rl.rollout.graphs`).

Numerics: a graphed prefill computes what an eager step of its ``t`` rows computes, bit for
bit. Against an eager step of the ``T`` real rows, every kernel of fp4rl's treats rows alike;
only the projections before and after the attention run on cuBLAS, whose choice of algorithm
may change with the row count and with it the order of a sum, and the decode kernel may cut its
contexts into other stretches for ``d`` slots over tables of ``max_model_len`` than for ``B``
over the step's own tables, as a decode graph's may (tests/rollout/test_graphs_gpu.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fp4rl import ops
from fp4rl.rollout.attention import AttentionMetadata, PagedAttention, Segment
from fp4rl.rollout.block_manager import BlockTable
from fp4rl.rollout.capture import PackedRows, StepCapture
from fp4rl.rollout.graphs import (
    MAX_GRAPH_BATCH,
    CaptureTally,
    bucket_for,
    capture_graph,
    capture_like,
)
from fp4rl.rollout.kv_cache import KVCache
from fp4rl.rollout.rows import HostRows

# Prefill steps of up to this many tokens are graphed. Larger ones run eagerly: their GPU time
# grows with the tokens while the host's does not, and a graph's memory (its activations, which
# stay reserved in the graphs' pool) grows with its bucket.
MAX_PREFILL_GRAPH_TOKENS = 2048
# Token buckets: powers of two up to 256, then multiples of 256 (a step pads at most a third).
PREFILL_BUCKETS = (16, 32, 64, 128, *range(256, MAX_PREFILL_GRAPH_TOKENS + 1, 256))


def prefill_bucket(tokens: int) -> int | None:
    """The smallest prefill bucket that holds ``tokens``, or None past the largest."""
    return next((t for t in PREFILL_BUCKETS if t >= tokens), None)


def graphable_prefill(segments: list[Segment]) -> bool:
    """Whether a step of ``segments`` (prompts or chunks of two tokens or more, decodes of one)
    fits a prefill graph: at most `MAX_PREFILL_GRAPH_TOKENS` tokens, at most `MAX_GRAPH_BATCH`
    decodes."""
    fits = sum(s.num_new for s in segments) <= MAX_PREFILL_GRAPH_TOKENS
    return fits and bool(segments) and sum(s.num_new == 1 for s in segments) <= MAX_GRAPH_BATCH


def _tables(segments: list[Segment], width: int, fill: int, block_size: int) -> np.ndarray:
    """The segments' block tables as rows of ``width`` int64 columns (a `BlockTable`'s int64
    copy where it has one), ``fill`` past each table; a segment whose table does not hold its
    tokens is refused."""
    tables = np.full((len(segments), width), fill, dtype=np.int64)
    for row, seg in zip(tables, segments, strict=True):
        blocks = seg.block_table
        blocks = blocks.array() if isinstance(blocks, BlockTable) else blocks
        if -(-(seg.start + seg.num_new) // block_size) > len(blocks):
            raise ValueError(f"{seg} does not fit its block table of block size {block_size}")
        row[: len(blocks)] = blocks
    return tables


@dataclass(frozen=True, slots=True)
class PrefillInputs:
    """Where a graph's inputs lie in the flat int64 buffer: ``tokens`` rows of id, position and
    slot (three columns of ``tokens`` values each), ``segments`` rows of (first row, start,
    num) of the prefills (row 0 empty), ``tiles`` rows of (segment, first query token),
    ``decodes`` rows of (row, context length), then one block-table row of ``width`` columns per
    decode, then one per segment row."""

    tokens: int
    segments: int
    tiles: int
    decodes: int
    width: int

    @staticmethod
    def of(tokens: int, decodes: int, max_segments: int, block_q: int, width: int) -> PrefillInputs:
        """The layout of a graph of ``tokens`` rows and ``decodes`` decode slots: a prefill feeds
        two tokens or more, and cuts into at most one partial tile of ``block_q`` tokens."""
        segments = 1 + min(max_segments, tokens // 2)
        tiles = math.ceil(tokens / block_q) + segments - 1
        return PrefillInputs(tokens, segments, tiles, decodes, width)

    @property
    def table_at(self) -> int:
        """Where the segments' block tables start (the decodes' come before)."""
        decodes_at = 3 * self.tokens + 3 * self.segments + 2 * self.tiles
        return decodes_at + self.decodes * (2 + self.width)

    @property
    def size(self) -> int:
        return self.table_at + self.segments * self.width

    def views(self, buffer: torch.Tensor | np.ndarray):
        """``(columns [3, tokens], segments [S, 3], tiles [P, 2], decodes [d, 2], decode tables
        [d, width], tables [S, width])``."""
        sizes = (3 * self.tokens, 3 * self.segments, 2 * self.tiles, 2 * self.decodes,
                 self.decodes * self.width, self.segments * self.width)  # fmt: skip
        shapes = ((3, self.tokens), (self.segments, 3), (self.tiles, 2), (self.decodes, 2),
                  (self.decodes, self.width), (self.segments, self.width))  # fmt: skip
        ends = np.cumsum(sizes).tolist()
        return tuple(
            buffer[end - size : end].reshape(shape)
            for size, end, shape in zip(sizes, ends, shapes, strict=True)
        )

    def fill(
        self,
        buffer: np.ndarray,
        segments: list[Segment],
        tokens: list[int],
        block_size: int,
        block_q: int,
        scratch_block: int,
    ) -> int:
        """Write one step's inputs into ``buffer`` (padding included); the number of its leading
        values the step needs (the table rows past its segments are not read)."""
        columns, segs, tiles, decodes, decode_table, table = self.views(buffer)
        nums = np.fromiter((s.num_new for s in segments), np.int64, len(segments))
        prefills, decoding = np.flatnonzero(nums > 1), np.flatnonzero(nums == 1)
        S, B, T = len(prefills), len(decoding), len(tokens)
        fits = self.segments > S and self.tokens >= T and self.decodes >= B
        fits = fits and (B > 0 or self.decodes == 0) and graphable_prefill(segments)
        if not fits or nums.sum() != T:
            raise ValueError(f"a prefill graph of {self.tokens} tokens and {self.decodes} decodes "
                             f"cannot take segments of {nums.tolist()} tokens")  # fmt: skip
        tables = _tables(segments, self.width, scratch_block, block_size)
        starts = np.fromiter((s.start for s in segments), np.int64, len(segments))
        first = np.cumsum(nums) - nums
        positions = np.arange(T) + np.repeat(starts - first, nums)
        table_of = tables[np.repeat(np.arange(len(segments)), nums), positions // block_size]
        columns[0, :T] = tokens
        columns[1, :T] = positions
        columns[2, :T] = table_of * block_size + positions % block_size
        columns[:, T:] = np.array([[tokens[0]], [0], [scratch_block * block_size]])

        segs[0] = 0
        segs[1 : S + 1] = np.stack([first, starts, nums], axis=1)[prefills]
        table[1 : S + 1] = tables[prefills]
        per_segment = -(-nums[prefills] // block_q)
        P = int(per_segment.sum())
        tiles[:P, 0] = np.repeat(np.arange(1, S + 1), per_segment)
        tile_0 = np.repeat(np.cumsum(per_segment) - per_segment, per_segment)  # a segment's first
        tiles[:P, 1] = (np.arange(P) - tile_0) * block_q
        tiles[P:] = 0

        if B:
            decodes[:B] = np.stack([first[decoding], starts[decoding] + 1], axis=1)
            decode_table[:B] = tables[decoding]
            shortest = int(np.argmin(decodes[:B, 1]))
            decodes[B:], decode_table[B:] = decodes[shortest], decode_table[shortest]
        return self.table_at + (S + 1) * self.width


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: PrefillInputs
    hidden_tH: torch.Tensor
    records: PackedRows | None


class PrefillGraphs:
    """The graphs of one engine's steps that prefill, over one `KVCache`, one per (token bucket,
    decode bucket) captured on first use; they share ``pool`` with the engine's decode graphs
    (one replays at a time)."""

    def __init__(self, model, cache: KVCache, *, device, max_segments: int, max_model_len: int,
                 pool, tally: CaptureTally) -> None:  # fmt: skip
        self.model, self.cache, self.pool, self.tally = model, cache, pool, tally
        self.device = torch.device(device)
        config = model.config
        self.group = config.num_attention_heads // config.num_key_value_heads
        self.block_q = ops.paged_prefill_block_q(self.group)
        self.max_segments = max_segments
        self.width = math.ceil(max_model_len / cache.block_size)
        self.scratch_block = cache.num_blocks - 1
        self.graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.inputs = self.staging = None  # created inside the first generate (inference mode)

    def layout(self, tokens: int, decodes: int) -> PrefillInputs:
        return PrefillInputs.of(tokens, decodes, self.max_segments, self.block_q, self.width)

    def run(
        self,
        segments: list[Segment],
        tokens: list[int],
        capture: StepCapture | None,
        into: HostRows | None = None,
    ) -> tuple[torch.Tensor, StepCapture | None]:
        """The final-normed hidden states ``[T, H]`` of a step's tokens (a step
        `graphable_prefill` takes), valid until the next replay, and its records as
        `DecodeGraphs.run` gives them."""
        T, B = len(tokens), sum(s.num_new == 1 for s in segments)
        graph = self._graph(prefill_bucket(T), bucket_for(B) if B else 0, capture)
        self.staged.synchronize()  # the previous step's copy has read the pinned values
        staging = self.staging.numpy()
        used = graph.inputs.fill(staging, segments, tokens, self.cache.block_size, self.block_q,
                                 self.scratch_block)  # fmt: skip
        self.inputs[:used].copy_(self.staging[:used], non_blocking=True)
        self.staged.record(torch.cuda.current_stream(self.device))
        graph.graph.replay()
        if capture is None or graph.records is None:
            return graph.hidden_tH[:T], capture
        return graph.hidden_tH[:T], capture.holding(graph.records.to_host(T, into))

    def _forward(self, inputs: PrefillInputs, capture: StepCapture | None):
        columns, segments, tiles, decodes, decode_table, table = inputs.views(self.inputs)
        as_int32 = [t.to(torch.int32) for t in (segments, table, tiles)]
        plan = ops.paged_prefill_plan_over(*as_int32, self.group)
        meta = AttentionMetadata(
            positions_T=columns[1],
            slots_T=columns[2],
            decode_rows_B=decodes[:, 0],
            decode_slots_BC=decodes[:, :0],  # the gather path's; never read here
            decode_context_B=decodes[:, 1].to(torch.int32),
            decode_table_BN=decode_table.to(torch.int32),
            prefills=(),
        )
        attn = PagedAttention(self.cache, meta, prefill_plan=plan)
        hidden = self.model.hidden_states(columns[0], attn, capture=capture)
        return hidden, None if capture is None else capture.pack()

    def _graph(self, tokens: int, decodes: int, capture: StepCapture | None) -> _Graph:
        key = (tokens, decodes, capture is not None)
        if key in self.graphs:
            return self.graphs[key]
        if self.inputs is None:
            largest = bucket_for(min(self.max_segments, MAX_GRAPH_BATCH))
            size = self.layout(MAX_PREFILL_GRAPH_TOKENS, largest).size
            self.inputs = torch.zeros(size, dtype=torch.int64, device=self.device)
            self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=True)
            self.staged = torch.cuda.Event()  # the last copy of the staging values
        inputs = self.layout(tokens, decodes)
        # Captured over padding alone: no segment (every tile names the empty one), every row's
        # K and V in the scratch block, each decode slot row 0 over the scratch block's first
        # token.
        self.staged.synchronize()
        empty = self.staging.numpy()
        empty[: inputs.size] = 0
        columns, _, _, decode_rows, decode_table, _ = inputs.views(empty)
        columns[2] = self.scratch_block * self.cache.block_size
        decode_rows[:, 1] = 1
        decode_table[:] = self.scratch_block
        self.inputs[: inputs.size].copy_(self.staging[: inputs.size])
        graph, (hidden, records) = capture_graph(
            lambda: self._forward(inputs, capture_like(capture)),
            self.device,
            self.pool,
            early=False,
            tally=self.tally,
            shape=("prefill", *key),
        )
        self.graphs[key] = _Graph(graph, inputs, hidden, records)
        return self.graphs[key]
