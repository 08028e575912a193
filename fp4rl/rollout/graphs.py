"""CUDA graphs of the engine's decode steps, one per batch bucket.

A decode step runs the same kernels in the same order at every step of a given batch size, and
on the GPU its forward never waits for the device (`tests/rollout/test_engine_gpu.py` holds it
to that), so it can be captured once and replayed: one launch from the host instead of a few
hundred, which is what keeps small decode batches from being bound by Python.

What a graph reads lives in one int64 device buffer of ``[max_batch, 4 + N]`` rows, columns
``token, position, slot, context length, block table (N columns)``, staged from pinned host
memory by one copy per step (the host rewrites the pinned rows once the previous step's copy
has landed); the graph casts the table and lengths to the kernel's int32 itself. A token
sampled by the step before and not read back yet is staged as its `placeholder`, and the graph
takes its value from a device buffer that the run fills with that step's samples, one
device-to-device copy queued before the replay.
A step of ``B`` decodes replays the graph of the smallest bucket ``b >= B``; rows ``B..b`` are
padding (`pad_rows`): each a copy of the real row with the shortest context but for its slot,
which lies in the cache's scratch block (one block past the block manager's pool), so they
write no sequence's pages. A padding row computes what its source row computes, bit for bit
(every kernel of the forward treats rows alike), so at every MoE layer it routes to its source's
experts and the expert GEMMs read no weights for it; padding of its own (token 0 at position 0)
would route to up to ``top_k`` experts the real rows may not touch. Their outputs are dropped.

What a graph writes lives in the graph's own memory and is overwritten by the next replay: the
logits, and, when the engine captures them, the step's routing and guidance records packed by
the graph's last kernel into one uint8 buffer of ``[b, row_bytes]`` (`StepCapture.pack`: each
token's records in one row, by a `fp4rl.rollout.rows.RowLayout` made when the graph is captured).
`run` hands out the logits for this step only and queues one copy of the buffer's rows
``0..B`` to pinned host memory behind the replay, on the same stream, so the next replay cannot
overwrite them first: the host's whole share of the capture is that copy.

Graphs hold the addresses of the weights and the KV pages they were captured with: a refit
copies weights in place (`fp4rl.refit`), and the pages lie at device addresses reserved for the
engine's life, whose memory `Engine.release_kv` gives back and `acquire_kv` maps again
(`fp4rl.rollout.device_memory`), so the graphs outlive both; with ``engine.keep_graphs`` off, or
where the driver cannot reserve addresses, the engine drops its graphs with its pages. Here,
decode-only steps; steps that prefill have graphs of their own (`fp4rl.rollout.prefill_graphs`,
in the same memory pool) up to a number of tokens, and the longer ones run eagerly, as does
every step where a layer's attention would gather its context
(`fp4rl.ops.paged_decode_kernel_runs`) or the engine records sparse guidance (its record's size
depends on the values).

Graphs are captured with early dependents (`EARLY_DEPENDENTS_MAX_BATCH`,
`fp4rl.ops.early_dependents`), but for the K/V store before the decode attention of 8 or more
decodes: their kernels start sooner, on the same bits.

Numerics: a graphed step computes what an eager decode step of ``b`` rows with the same table
width computes, bit for bit (the same kernels on the same shapes). Against an eager step of
``B`` rows only the paged kernel's choice of context stretches can differ (it depends on the
batch and the table width), which reorders FP32 sums.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from fp4rl import ops
from fp4rl.rollout import device_memory
from fp4rl.rollout.attention import AttentionMetadata, PagedAttention, Segment
from fp4rl.rollout.block_manager import BlockTable
from fp4rl.rollout.capture import PackedRows, StepCapture
from fp4rl.rollout.kv_cache import KVCache
from fp4rl.rollout.rows import HostRows
from fp4rl.rollout.sequence import resolve_placeholders

# Batch sizes a graph is captured for: 1, 2, 4 and 8, then multiples of 8 up to 64, then of 32
# (padding rows copy a real row: `pad_rows`).
MAX_GRAPH_BATCH = 512
BUCKETS = (1, 2, 4, 8, *range(16, 65, 8), *range(96, MAX_GRAPH_BATCH + 1, 32))
TOKEN, POSITION, SLOT, CONTEXT, TABLE = 0, 1, 2, 3, 4  # columns of the input rows


# Graphs of at most this many decodes (every graph; a knob for `benchmarks/decode.py`'s A/B)
# launch their kernels with early dependents (`fp4rl.ops.early_dependents`): a step is a chain
# of kernels whose links the early start shortens. From 8 decodes the K/V store before each
# decode attention is the exception (`fp4rl.rollout.attention.STORE_AT_EXIT_MIN_DECODES`, with
# the measurements).
EARLY_DEPENDENTS_MAX_BATCH = MAX_GRAPH_BATCH

# Eager calls of a step's forward before its capture (kernels compile, workspaces are sized
# outside the graph); a knob for `benchmarks/generate.py`'s A/B. One, not two: a 48-layer
# rollout's 19 captures took 3.1 s instead of 7.2 (NVFP4) and 3.7 instead of 6.0 (BF16) on one
# H200 (BENCHMARKS.md, "Graph captures"), the graph tests passing at either count.
CAPTURE_WARMUPS = 1
# Eager calls before capturing a shape the engine captured before (its graph dropped with its
# KV pages by `Engine.release_kv`, ``engine.keep_graphs`` off): its kernels are compiled and its
# workspaces exist already.
CAPTURE_WARMUPS_SEEN = 0


@dataclass(slots=True)
class CaptureTally:
    """Graphs an engine captured over its life, the wall seconds their captures took, warm-up
    calls included (`Engine.generate` reports each call's share), those warm-up calls, and the
    shapes captured (`capture_graph`'s keys)."""

    graphs: int = 0
    seconds: float = 0.0
    warmups: int = 0
    shapes: set = field(default_factory=set)


def bucket_for(batch: int) -> int | None:
    """The smallest bucket that holds ``batch`` decodes, or None past the largest."""
    return next((b for b in BUCKETS if b >= batch), None)


def graphs_unsupported(layout, config) -> str | None:
    """Why an engine of this `ModelLayout` and `EngineConfig` cannot graph its decode steps, or
    None when it can."""
    if not config.cuda_graphs:
        return "engine.cuda_graphs is false"
    device, spec = torch.device(layout.device), layout.kv
    if device.type != "cuda":
        return f"the model is on {device}"
    if config.guidance == "sparse":
        return "sparse guidance records a value-dependent number of entries"
    if spec.dtype != torch.bfloat16:
        # Expert GEMMs in other dtypes run one matmul per expert, split on counts read on the
        # host (`fp4rl.ops.grouped_mm`).
        return f"the model computes in {spec.dtype}; decode graphs need torch.bfloat16"
    q = torch.empty(0, spec.head_dim, dtype=spec.dtype, device=device)  # the queries' kind
    for layer, fmt in enumerate(spec.layer_formats):
        if not ops.paged_decode_kernel_runs(q, fmt == "nvfp4"):
            return f"layers.{layer} ({fmt} pages) gathers its context instead of the paged kernel"
    return None


def graphs_dropped(layout, config) -> str | None:
    """Why `Engine.release_kv` drops an engine's graphs with its KV pages, or None when the
    pages can lie at reserved addresses (`fp4rl.rollout.device_memory`) and the graphs stay."""
    if not config.keep_graphs:
        return "engine.keep_graphs is false"
    return device_memory.unsupported(torch.device(layout.device))


def fill_rows(
    rows: np.ndarray, segments: list[Segment], tokens: list[int], block_size: int
) -> None:
    """Write one decode step's input rows ``0..len(segments)`` into ``rows`` (int64 ``[b, TABLE +
    width]``, padding already in place): token, position, slot and context length, then the
    block table (a `BlockTable`'s int64 copy where it has one)."""
    heads = []
    for i, (seg, token) in enumerate(zip(segments, tokens, strict=True)):
        if seg.num_new != 1:
            raise ValueError(f"a graphed step decodes one token per segment; got {seg}")
        table = seg.block_table
        rows[i, TABLE : TABLE + len(table)] = (
            table.array() if isinstance(table, BlockTable) else table
        )
        heads.append((token, seg.start,
                      table[seg.start // block_size] * block_size + seg.start % block_size,
                      seg.start + 1))  # fmt: skip
    if heads:
        rows[: len(heads), :TABLE] = heads


def pad_rows(rows: np.ndarray, num_real: int, scratch_slot: int) -> None:
    """Turn rows ``num_real..`` of a step's input rows (``num_real`` filled by `fill_rows`) into
    padding: copies of the real row with the shortest context (the least attention work), their
    K and V written to ``scratch_slot``, which no sequence reads."""
    if num_real == len(rows):
        return
    if num_real < 1:
        raise ValueError(f"a graphed step decodes at least one row; got num_real={num_real}")
    source = int(np.argmin(rows[:num_real, CONTEXT]))
    rows[num_real:] = rows[source]
    rows[num_real:, SLOT] = scratch_slot


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits_bV: torch.Tensor
    records: PackedRows | None  # uint8 [b, row_bytes], what the replay packed


class DecodeGraphs:
    """The decode-step graphs of one engine over one `KVCache`; captured on first use."""

    def __init__(
        self,
        model,
        cache: KVCache,
        *,
        device: torch.device,
        max_batch: int,
        max_model_len: int,
        tally: CaptureTally,
    ) -> None:
        self.model, self.cache, self.tally = model, cache, tally
        self.max_sampled = max_batch  # a step samples at most one token per running sequence
        self.max_batch = bucket_for(min(max_batch, MAX_GRAPH_BATCH))
        self.width = math.ceil(max_model_len / cache.block_size)  # block-table columns
        self.scratch_block = cache.num_blocks - 1
        self.device = torch.device(device)
        self.graphs: dict[tuple[int, bool], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()  # every graph's memory (one replays at a time)
        self.inputs = self.staging = None  # created inside the first generate (inference mode)

    def handles(self, num_decodes: int) -> bool:
        return num_decodes <= self.max_batch

    def run(
        self,
        segments: list[Segment],
        tokens: list[int],
        capture: StepCapture | None,
        sampled_S: torch.Tensor | None = None,
        into: HostRows | None = None,
    ) -> tuple[torch.Tensor, StepCapture | None]:
        """Logits ``[B, V]`` of one decode step (one token per segment), valid until the next
        call, and the step's records in a fresh `StepCapture` like ``capture``: rows ``0..B`` of
        the buffer the replay packed, their one copy to pinned host memory (into ``into``'s
        rows, if given) queued behind the replay (`PackedRows.to_host`). Placeholder tokens name
        rows of ``sampled_S``, the previous step's samples on the device."""
        B = len(segments)
        b = bucket_for(B)
        graph = self._graph(b, capture)
        self._stage(segments, tokens, b)
        if sampled_S is not None:
            self.sampled[: sampled_S.shape[0]].copy_(sampled_S, non_blocking=True)
        graph.graph.replay()
        if capture is None or graph.records is None:
            return graph.logits_bV[:B], capture
        # Rows are tokens, so rows 0..B are a prefix: the padding rows never leave the GPU.
        return graph.logits_bV[:B], capture.holding(graph.records.to_host(B, into))

    def _padding_rows(self) -> np.ndarray:
        """An input row that touches only the scratch block (token 0 at position 0, context 1):
        what the graphs are captured over, and the table columns past a sequence's blocks."""
        row = np.full(TABLE + self.width, self.scratch_block, dtype=np.int64)
        row[[TOKEN, POSITION, CONTEXT]] = (0, 0, 1)
        row[SLOT] = self.scratch_block * self.cache.block_size
        return row

    def _stage(self, segments: list[Segment], tokens: list[int], b: int) -> None:
        # The pinned rows are read by the previous step's copy when the stream reaches it: wait
        # for that copy before rewriting them. The engine's steps read their sampled tokens back
        # first, so there it has long landed; a caller replaying steps back to back (a
        # benchmark) would otherwise hand later steps torn rows.
        self.staged.synchronize()
        rows = self.staging.numpy()
        rows[:b] = self._padding
        fill_rows(rows, segments, tokens, self.cache.block_size)
        pad_rows(rows[:b], len(segments), self._padding[SLOT])
        self.inputs[:b].copy_(self.staging[:b], non_blocking=True)
        self.staged.record(torch.cuda.current_stream(self.device))

    def _forward(
        self, b: int, capture: StepCapture | None
    ) -> tuple[torch.Tensor, PackedRows | None]:
        """The logits of ``b`` rows and the records packed in one buffer (None if none)."""
        x = self.inputs[:b]
        meta = AttentionMetadata(
            positions_T=x[:, POSITION],
            slots_T=x[:, SLOT],
            decode_rows_B=self.rows[:b],
            decode_slots_BC=self.rows[:b, None][:, :0],  # the gather path's; never read here
            decode_context_B=x[:, CONTEXT].to(torch.int32),
            decode_table_BN=x[:, TABLE:].to(torch.int32),
            prefills=(),
        )
        attn = PagedAttention(self.cache, meta)
        tokens = resolve_placeholders(x[:, TOKEN], self.sampled)
        h = self.model.hidden_states(tokens, attn, capture=capture)
        logits = self.model.logits(h, dtype=None)  # the lm_head's dtype, as the eager step's
        return logits, None if capture is None else capture.pack()

    def _graph(self, b: int, capture: StepCapture | None) -> _Graph:
        key = (b, capture is not None)
        if key in self.graphs:
            return self.graphs[key]
        if self.inputs is None:
            width = TABLE + self.width
            self.inputs = torch.zeros(self.max_batch, width, dtype=torch.int64, device=self.device)
            self.staging = torch.zeros(self.max_batch, width, dtype=torch.int64, pin_memory=True)
            self.staged = torch.cuda.Event()  # the last copy of the staging rows
            self.rows = torch.arange(self.max_batch, device=self.device)
            self.sampled = torch.zeros(self.max_sampled, dtype=torch.int64, device=self.device)
            self._padding = self._padding_rows()
        # Captured over padding rows: only the scratch block is written.
        self.inputs.copy_(torch.from_numpy(np.tile(self._padding, (self.max_batch, 1))))
        graph, (logits, records) = capture_graph(
            lambda: self._forward(b, capture_like(capture)),
            self.device,
            self.pool,
            early=b <= EARLY_DEPENDENTS_MAX_BATCH,
            tally=self.tally,
            shape=("decode", *key),
        )
        self.graphs[key] = _Graph(graph, logits, records)
        return self.graphs[key]


def capture_graph(
    forward, device: torch.device, pool, *, early: bool, tally: CaptureTally, shape: tuple
):
    """A CUDA graph of ``forward()`` in ``pool``, and what the captured call returned:
    `CAPTURE_WARMUPS` calls on a side stream first (kernels compile and workspaces are sized
    outside the graph), or `CAPTURE_WARMUPS_SEEN` where ``tally`` holds ``shape`` (a key that
    names the step's shape) from an earlier capture, its kernels launched with early dependents
    if ``early`` (`fp4rl.ops.early_dependents`). The capture's wall time, from the device's
    last queued work to the graph's instantiation, goes into ``tally``."""
    torch.cuda.synchronize(device)  # the steps queued before are not the capture's time
    start = time.perf_counter()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    warmups = CAPTURE_WARMUPS_SEEN if shape in tally.shapes else CAPTURE_WARMUPS
    with ops.early_dependents(device, early):
        with torch.cuda.stream(side):
            for _ in range(warmups):
                forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
    torch.cuda.synchronize(device)
    tally.graphs += 1
    tally.seconds += time.perf_counter() - start
    tally.warmups += warmups
    tally.shapes.add(shape)
    return graph, out


def capture_like(capture: StepCapture | None) -> StepCapture | None:
    """A fresh `StepCapture` that keeps what ``capture`` keeps (a graph's own)."""
    if capture is None:
        return None
    return StepCapture(routing=capture.keep_routing, guidance=capture.guidance, keep=capture.keep)
