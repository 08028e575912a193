"""What the rollout records for the trainer: top-k routing and the FP4 sites' codes (guidance).

`StepCapture` is the ``capture`` argument of one forward (the model's FP4 sites record
"expert_input", "expert_hidden", and "k" and "v" of NVFP4-KV layers; its routers record the
top-k ids). Every record has one row per step token, and every row is quantized on its own
(per-row global scales), so a sequence's records are rows cut from the steps' records.

A step's token-major records (routing, full and compact guidance) leave it as one uint8 buffer
of a row per token (`PackedRows`, laid out by a cached `fp4rl.rollout.rows.RowLayout`): one
concatenation (inside the graph, for a graphed decode step) and one copy to pinned host memory,
whatever the number of records, into the engine's host rows (`fp4rl.rollout.rows.HostRows`),
after the previous step's. A generate call's `CaptureLog` keeps each step's rows and each
sequence's `SequenceCapture` the row ranges that are its own; `CaptureLog.assemble` makes them
records over all ``T = len(prompt) + len(completion) - 1`` fed tokens at the end of the call:
per sequence, the numbers of its rows, over which its site records stay where they lie until
read (`fp4rl.records.RowRecords`), and one gather of its routing.
Sparse records have no fixed bytes per token, so they keep their own path (copied together per
step, cut and packed at the end).

Guidance modes: "full" keeps each `NVFP4Tensor`; "compact" keeps `fp4rl.ops.compact(t)`
(mantissa bits and scales) for the latter ``fraction`` of the FP4 layers only and drops the rest
(the trainer rounds those to nearest); in both the engine's kernels that quantize a site on the
way make its record in the same launch (`fp4rl.model.sites.Fp4Site.on_the_way`); "sparse" keeps
`fp4rl.fp4.sparse(x, t, delta)` in every FP4 layer: the row maxima, and a position and a bit
for each block scale near an E4M3 rounding boundary and each value the site computed within
``delta`` grid units of an E2M1 one (so it asks the sites for their values too), packed per
sequence (`fp4rl.records.record_gather_packed`).

Legend: T tokens, k experts per token, L_moe MoE layers.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fp4rl import ops
from fp4rl.fp4 import CompactCodes, NVFP4Tensor, SparseCodes, sparse
from fp4rl.fp4.sparse_guidance import PackedSparse
from fp4rl.records import (
    RowPlan,
    RowRecords,
    SiteKey,
    SiteRecord,
    record_cat,
    record_gather_packed,
    record_rows,
)
from fp4rl.rollout.rows import HostRows, RowLayout, to_host_together

_NO_ROWS = RowPlan((), (), (), 0, 0)  # a call that packed no site records


def kept_layers(mode: str | None, fp4_layers: tuple[int, ...], fraction: float) -> frozenset[int]:
    """Layers whose site records a guidance mode keeps."""
    if mode is None:
        return frozenset()
    ordered = sorted(fp4_layers)
    if mode in ("full", "sparse"):
        return frozenset(ordered)
    num_kept = math.ceil(fraction * len(ordered))
    return frozenset(ordered[len(ordered) - num_kept :])


@dataclass(frozen=True, slots=True)
class PackedRows:
    """A step's token-major records (routing and full or compact guidance) as one uint8 buffer
    ``[tokens, layout.row_bytes]`` (`fp4rl.rollout.rows.RowLayout`): keys are MoE layers (int) for
    routing, `SiteKey`s for site records. ``first``: the number of the first row in the
    `HostRows` that hold them, if they lie there."""

    layout: RowLayout
    rows: torch.Tensor
    first: int | None = None

    def to_host(self, num_rows: int | None = None, into: HostRows | None = None) -> PackedRows:
        """Rows ``0..num_rows`` (all by default) in host memory: from a GPU, one copy to pinned
        memory (after the rows already in ``into``, if given; else memory of their own), only
        queued on the current stream (read it after a synchronize); from the CPU, the rows as
        they are."""
        rows = self.rows if num_rows is None else self.rows[:num_rows]
        if rows.device.type == "cpu":
            return PackedRows(self.layout, rows)
        if into is not None:
            return PackedRows(self.layout, *into.copy_in(rows))
        host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        return PackedRows(self.layout, host)


class StepCapture:
    """The `fp4rl.model.sites.Capture` of one forward; keeps only what the engine asked for.

    Live, it holds the records as the forward made them; `pack` lays its token-major ones out
    in one buffer and `to_host` (or `holding`, for rows a decode graph packed) makes the form a
    `CaptureLog` keeps: that buffer in host memory, plus any sparse records (their sizes depend
    on the values, so they keep a copy of their own). ``routing`` and ``sites`` read either form
    (views of the buffer, made when asked)."""

    def __init__(
        self,
        *,
        routing: bool,
        guidance: str | None,
        keep: set[SiteKey] | frozenset[SiteKey],
        sparse_delta: float | None = None,  # used by guidance='sparse'
    ) -> None:
        if guidance == "sparse" and sparse_delta is None:
            raise ValueError("guidance='sparse' needs sparse_delta (grid units)")
        self.keep_routing, self.guidance, self.sparse_delta = routing, guidance, sparse_delta
        self.keeps_values = guidance == "sparse"
        self.record_form = "compact" if guidance == "compact" else "full"
        # Records the trainer would not follow (a site outside the precision plan's guided
        # sites, a layer compact mode drops) are not kept at all.
        self.keep = frozenset(keep)
        self._routing: dict[int, torch.Tensor] = {}
        self._sites: dict[SiteKey, SiteRecord] = {}
        self.packed: PackedRows | None = None

    def records(self, layer: int, site: str) -> bool:
        return self.guidance is not None and (layer, site) in self.keep

    def record(
        self, layer: int, site: str, t: NVFP4Tensor | CompactCodes, x: torch.Tensor | None = None
    ) -> None:
        """Keep a site's record: ``t`` its `NVFP4Tensor`, or in compact mode its `CompactCodes`
        as a kernel made them on the way (`record_form`)."""
        if not self.records(layer, site):
            return
        if isinstance(t, CompactCodes) and self.guidance != "compact":
            raise ValueError(
                f"layers.{layer} site '{site}': got compact codes, but {self.guidance!r} "
                "guidance keeps the full NVFP4 record"
            )
        # Compact or sparsify the whole step at once: one pass instead of one per sequence.
        if self.guidance == "compact":
            self._sites[(layer, site)] = t if isinstance(t, CompactCodes) else ops.compact(t)
        elif self.guidance == "sparse":
            if x is None:
                raise ValueError(
                    f"sparse guidance needs the values of layers.{layer} site '{site}', and the "
                    "site recorded only its codes"
                )
            self._sites[(layer, site)] = sparse(x, t, self.sparse_delta)
        else:
            self._sites[(layer, site)] = t

    def record_routing(self, layer: int, topk_ids_Tk: torch.Tensor) -> None:
        """Keep a layer's ids as the router gave them (int64): `pack` makes all layers' int32
        at once."""
        if self.keep_routing:
            self._routing[layer] = topk_ids_Tk

    @property
    def routing(self) -> dict[int, torch.Tensor]:
        """MoE layer -> int32 top-k ids ``[T, k]`` (a fresh dict: record with `record_routing`)."""
        packed = {} if self.packed is None else self.packed.layout.unpack(self.packed.rows)
        live = {k: v.to(torch.int32) for k, v in self._routing.items()}
        return live | {k: v for k, v in packed.items() if isinstance(k, int)}

    @property
    def sites(self) -> dict[SiteKey, SiteRecord]:
        """Site -> record with leading dim T (a fresh dict: record with `record`)."""
        packed = {} if self.packed is None else self.packed.layout.unpack(self.packed.rows)
        return {k: v for k, v in packed.items() if not isinstance(k, int)} | self._sites

    def loose(self) -> dict[SiteKey, SiteRecord]:
        """The records that do not pack into rows: sparse ones."""
        return {k: r for k, r in self._sites.items() if isinstance(r, SparseCodes | PackedSparse)}

    def pack(self) -> PackedRows | None:
        """The live token-major records in one buffer on their device (None if there are none):
        routing by layer, then sites by key, so that every step of a call lays out alike. Its
        layout is made once per kind of step (`RowLayout.of`); the bytes cost one concatenation.
        A decode graph ends with this, so its replay writes the buffer."""
        keys = sorted(self._routing)
        items = []
        if keys:  # every layer's ids made int32 by one stack and one cast, not a cast a layer
            items = list(torch.stack([self._routing[k] for k in keys], 1).to(torch.int32).unbind(1))
        loose = self.loose()
        sites = sorted(k for k in self._sites if k not in loose)
        keys += sites
        items += [self._sites[k] for k in sites]
        if not items:
            return None
        layout = RowLayout.of(keys, items)
        return PackedRows(layout, layout.pack(items))

    def holding(self, packed: PackedRows | None, loose=None) -> StepCapture:
        """A `StepCapture` like this one that holds ``packed`` (and ``loose`` sparse records)."""
        out = StepCapture(routing=self.keep_routing, guidance=self.guidance, keep=self.keep,
                          sparse_delta=self.sparse_delta)  # fmt: skip
        out.packed, out._sites = packed, dict(loose or {})
        return out

    def to_host(self, rows: int | None = None, into: HostRows | None = None) -> StepCapture:
        """A `StepCapture` like this one holding the first ``rows`` rows (all by default) of
        each record in host memory: the token-major ones packed (`pack`) and moved by one copy
        (`PackedRows.to_host`, into ``into`` if given), sparse ones together by another
        (`to_host_together`). The copies are only queued on the current stream, behind the
        forward that wrote the records and before anything that would overwrite them (a graph's
        next replay): the host reads them once the stream has been synchronized
        (`CaptureLog.assemble` does). Records thus never pile up on the GPU during a long
        rollout."""
        packed = self.packed if self.packed is not None else self.pack()
        loose = self.loose()
        if rows is not None:
            loose = {k: record_rows(r, 0, rows) for k, r in loose.items()}
        loose = dict(zip(loose, to_host_together(list(loose.values())), strict=True))
        return self.holding(None if packed is None else packed.to_host(rows, into), loose)


@dataclass(slots=True)
class SequenceCapture:
    """Where one sequence's rows lie in its generate call's `CaptureLog`: ``(step, start,
    end)`` row ranges of the steps' records, in token order."""

    spans: list[tuple[int, int, int]] = field(default_factory=list)

    def clear(self) -> None:
        self.spans.clear()


class CaptureLog:
    """Every captured step of one generate call, its records kept whole (packed rows in host
    memory); each sequence keeps only where its rows are (`SequenceCapture`). At the end of the
    call `assemble` finds each sequence's rows in the steps' rows by a few array operations
    over all spans; the rows lie joined in ``host_rows`` when every step was copied there
    (`StepCapture.to_host` ``into=log.host_rows``; else they are joined first). The sites'
    records stay there, read when used (`fp4rl.records.RowRecords`); the routing is gathered
    per sequence. ``host_rows``: the engine's (a fresh one by default), which hands the call's
    rows over to its records; the log starts writing it from the beginning."""

    def __init__(self, host_rows: HostRows | None = None) -> None:
        self.steps: list[StepCapture] = []
        self.num_rows: list[int] = []
        self.host_rows = HostRows() if host_rows is None else host_rows
        self.host_rows.begin()

    def add(self, capture: StepCapture, num_rows: int, spans) -> None:
        """One step's records of ``num_rows`` rows (a live capture is packed where it lies);
        ``spans`` holds ``(sequence capture, start, end)`` for each sequence fed this step (a
        prompt's rows go to each of its samples). Every step of a call must record the same
        things (same layout): a RuntimeError says which differ."""
        if capture.packed is None:
            capture = capture.holding(capture.pack(), capture.loose())
        self._check_like_the_first(capture, num_rows)
        step = len(self.steps)
        self.steps.append(capture)
        self.num_rows.append(num_rows)
        for seq, start, end in spans:
            seq.spans.append((step, start, end))

    def _check_like_the_first(self, capture: StepCapture, num_rows: int) -> None:
        packed = capture.packed
        if packed is not None and packed.rows.shape[0] != num_rows:
            raise ValueError(f"a step of {num_rows} rows holds {packed.rows.shape[0]} rows")
        if not self.steps:
            return
        first = self.steps[0]
        layouts = [None if c.packed is None else c.packed.layout for c in (first, capture)]
        if layouts[0] != layouts[1] or first.loose().keys() != capture.loose().keys():
            names = [None if x is None else x.keys for x in layouts]
            raise RuntimeError(
                f"a captured step records {names[1]} ({sorted(capture.loose())} sparse), the "
                f"first {names[0]} ({sorted(first.loose())} sparse): every step of a call "
                "must record the same records (a capture bug)"
            )

    def assemble(
        self, seqs: list[SequenceCapture], moe_layers: tuple[int, ...], top_k: int
    ) -> list[tuple[torch.Tensor | None, RowRecords]]:
        """Per sequence: the routing record, int32 ``[L_moe, T, k]`` in the order of
        ``moe_layers`` (-1 for a layer nothing recorded; None when routing was not kept), and
        the guidance records, rows ``T`` in token order: full and compact ones where they lie
        in the call's rows (`fp4rl.records.RowRecords`, read when first used), sparse ones
        packed. Empties the log; the rows become the records' (`HostRows.take`)."""
        if torch.cuda.is_available():  # the host copies of `StepCapture.to_host` must have landed
            torch.cuda.synchronize()
        steps, num_rows = self.steps, self.num_rows
        self.steps, self.num_rows = [], []
        offsets = np.zeros(len(num_rows) + 1, dtype=np.int64)
        np.cumsum(num_rows, out=offsets[1:])
        nothing = torch.empty(0, 0, dtype=torch.uint8), torch.empty(0, dtype=torch.long)
        sites = [RowRecords(*nothing, _NO_ROWS) for _ in seqs]
        routing = [None] * len(seqs)
        if not steps:
            return list(zip(routing, sites, strict=True))
        if steps[0].packed is not None:
            layout = steps[0].packed.layout
            firsts = [c.packed.first for c in steps]
            if None not in firsts:  # copied into the host rows one after another: no join
                rows, starts = self.host_rows.take(), np.array(firsts, dtype=np.int64)
            else:
                rows = [c.packed.rows for c in steps]
                rows, starts = (rows[0] if len(rows) == 1 else torch.cat(rows)), offsets
            for c in steps:  # the steps' buffers go back before the records are gathered
                c.packed = None
            index = [i.to(rows.device) for i in _row_index(seqs, starts)]
            sites = layout.gather(rows, index, [k for k in layout.keys if not isinstance(k, int)])
            if steps[0].keep_routing:
                routing = _gather_routing(layout, rows, index, moe_layers, top_k)
        elif steps[0].keep_routing:
            lengths = [sum(b - a for _, a, b in seq.spans) for seq in seqs]
            routing = [torch.full((len(moe_layers), n, top_k), -1, dtype=torch.int32)
                       for n in lengths]  # fmt: skip
        loose = [{} for _ in seqs]
        for key in steps[0].loose():  # sparse: cut and packed in one pass over all sequences
            spans = [[(offsets[s] + a, offsets[s] + b) for s, a, b in seq.spans] for seq in seqs]
            whole = record_cat([c.loose()[key] for c in steps])
            for mine, record in zip(loose, record_gather_packed(whole, spans), strict=True):
                mine[key] = record
        if steps[0].loose():
            sites = [s.with_others(mine) for s, mine in zip(sites, loose, strict=True)]
        return list(zip(routing, sites, strict=True))


def _row_index(seqs: list[SequenceCapture], starts: np.ndarray) -> list[torch.Tensor]:
    """Each sequence's rows of the steps' joined rows (step ``s``'s from row ``starts[s]`` on),
    as a long tensor: its spans expanded by array operations over all spans at once."""
    counts = np.array([len(seq.spans) for seq in seqs], dtype=np.int64)
    spans = np.fromiter(
        itertools.chain.from_iterable(itertools.chain.from_iterable(s.spans for s in seqs)),
        dtype=np.int64,
        count=3 * int(counts.sum()),
    ).reshape(-1, 3)
    begins, lengths = starts[spans[:, 0]] + spans[:, 1], spans[:, 2] - spans[:, 1]
    ends = np.cumsum(lengths)
    # Row j of the concatenated spans lies at its span's start + (j - the span's first j).
    index = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(
        begins - ends + lengths, lengths
    )
    zero = np.zeros(1, dtype=np.int64)
    sizes = np.diff(np.concatenate([zero, np.concatenate([zero, ends])[np.cumsum(counts)]]))
    return list(torch.from_numpy(index).split(sizes.tolist()))


def _gather_routing(layout: RowLayout, rows, index, moe_layers, top_k) -> list[torch.Tensor]:
    """Per sequence, int32 ``[L_moe, T, k]``, -1 for a layer nothing recorded. The routing
    items lie first in each row (`StepCapture.pack`), one 16-aligned piece of k ids per layer,
    so every sequence's ids of all layers come out of one gather of that leading stretch of
    bytes, into one block for the call, token-major; each sequence's record is a view of its
    rows there, layer-major (not contiguous: a copy per sequence, to make it so, cost the host
    5-50 ms at the end of a 48-layer call of 64 sequences of 192 tokens, most of it the first
    touch of 128 fresh allocations). The block lives while any of them does."""
    layers = [key for key in layout.keys if isinstance(key, int)]
    num = len(layers)
    k = layout.members[0][0][2][0] if num else top_k
    # Bytes up to the first site record (or the row's end), the same for each layer's piece.
    end = layout.members[num][0][0] if num < len(layout.keys) else layout.row_bytes
    if any(layout.members[i] != ((i * end // num, torch.int32, (k,)),) for i in range(num)):
        raise ValueError(f"routing of layers {layers} is not int32 [T, {k}] in every layer")
    if not index:
        return []
    lengths = [len(idx) for idx in index]
    # Recorded layers that are MoE layers: where each goes in the record, where it comes from.
    wanted = {layer: i for i, layer in enumerate(moe_layers)}
    src = [i for i, layer in enumerate(layers) if layer in wanted]
    dst = [wanted[layers[i]] for i in src]
    ids_TLk = None
    if src:
        joined = index[0] if len(index) == 1 else torch.cat(index)
        ids = rows[:, :end].index_select(0, joined).view(torch.int32).view(len(joined), num, -1)
        ids_TLk = ids[:, :, :k]
    if not src or src != list(range(num)) or dst != list(range(len(moe_layers))):
        full = torch.full((sum(lengths), len(moe_layers), k), -1, dtype=torch.int32,
                          device=rows.device)  # fmt: skip
        if src:
            full[:, dst] = ids_TLk[:, src]
        ids_TLk = full
    return [mine.permute(1, 0, 2) for mine in ids_TLk.split(lengths)]
