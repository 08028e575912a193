"""What the rollout records for the trainer: top-k routing and the FP4 sites' codes (guidance).

`StepCapture` is the ``capture`` argument of one forward (the model's FP4 sites record
"expert_input", "expert_hidden", and "k" and "v" of NVFP4-KV layers; its routers record the
top-k ids). Every record has one row per step token, and every row is quantized on its own
(per-row global scales), so a sequence's records are rows cut from the steps' records. A
generate call's `CaptureLog` keeps each step's records whole and each sequence's
`SequenceCapture` the row ranges that are its own; `CaptureLog.assemble` gathers them into
records over all ``T = len(prompt) + len(completion) - 1`` fed tokens at the end of the call.

Guidance modes: "full" keeps each `NVFP4Tensor`; "compact" keeps `fp4rl.fp4.compact(t)`
(mantissa bits and scales) for the latter ``fraction`` of the FP4 layers only and drops the
rest (the trainer rounds those to nearest); "sparse" keeps `fp4rl.fp4.sparse(x, t, delta)` in
every FP4 layer: the row maxima, and a position and a bit for each block scale near an E4M3
rounding boundary and each value the site computed within ``delta`` grid units of an E2M1 one
(so it asks the sites for their values too), packed per sequence
(`fp4rl.records.record_gather_packed`).

Legend: T tokens, k experts per token, L_moe MoE layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fp4rl.fp4 import NVFP4Tensor, compact, sparse
from fp4rl.records import (
    SiteKey,
    SiteRecord,
    record_cat,
    record_gather_packed,
    record_rows,
    to_host_together,
)


def kept_layers(mode: str | None, fp4_layers: tuple[int, ...], fraction: float) -> frozenset[int]:
    """Layers whose site records a guidance mode keeps."""
    if mode is None:
        return frozenset()
    ordered = sorted(fp4_layers)
    if mode in ("full", "sparse"):
        return frozenset(ordered)
    num_kept = math.ceil(fraction * len(ordered))
    return frozenset(ordered[len(ordered) - num_kept :])


class StepCapture:
    """The `fp4rl.model.sites.Capture` of one forward; keeps only what the engine asked for."""

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
        # Records the trainer would not follow (a site outside the precision plan's guided
        # sites, a layer compact mode drops) are not kept at all.
        self.keep = frozenset(keep)
        self.routing: dict[int, torch.Tensor] = {}
        self.sites: dict[SiteKey, SiteRecord] = {}

    def record(self, layer: int, site: str, t: NVFP4Tensor, x: torch.Tensor | None = None) -> None:
        if self.guidance is None or (layer, site) not in self.keep:
            return
        # Compact or sparsify the whole step at once: one pass instead of one per sequence.
        if self.guidance == "compact":
            self.sites[(layer, site)] = compact(t)
        elif self.guidance == "sparse":
            if x is None:
                raise ValueError(
                    f"sparse guidance needs the values of layers.{layer} site '{site}', and the "
                    "site recorded only its codes"
                )
            self.sites[(layer, site)] = sparse(x, t, self.sparse_delta)
        else:
            self.sites[(layer, site)] = t

    def record_routing(self, layer: int, topk_ids_Tk: torch.Tensor) -> None:
        if self.keep_routing:
            self.routing[layer] = topk_ids_Tk.to(torch.int32)

    def to_host(self, rows: int | None = None) -> StepCapture:
        """A `StepCapture` like this one holding the first ``rows`` rows (all by default) of
        each record, copied to pinned host memory together (`fp4rl.records.to_host_together`:
        one concatenation and one copy for the whole step). The copy is only queued on the
        current stream, behind the forward that wrote the records and before anything that
        would overwrite them (a graph's next replay): the host reads them once the stream has
        been synchronized (`CaptureLog.assemble` does). Records thus never pile up on the GPU
        during a long rollout."""
        out = StepCapture(routing=self.keep_routing, guidance=self.guidance, keep=self.keep,
                          sparse_delta=self.sparse_delta)  # fmt: skip
        routing = [ids[:rows] for ids in self.routing.values()]
        sites = [r if rows is None else record_rows(r, 0, rows) for r in self.sites.values()]
        moved = to_host_together([*routing, *sites])
        out.routing = dict(zip(self.routing, moved[: len(routing)], strict=True))
        out.sites = dict(zip(self.sites, moved[len(routing) :], strict=True))
        return out


@dataclass(slots=True)
class SequenceCapture:
    """Where one sequence's rows lie in its generate call's `CaptureLog`: ``(step, start,
    end)`` row ranges of the steps' records, in token order."""

    spans: list[tuple[int, int, int]] = field(default_factory=list)

    def clear(self) -> None:
        self.spans.clear()


class CaptureLog:
    """Every captured step of one generate call, its records kept whole; each sequence keeps
    only where its rows are (`SequenceCapture`). At the end of the call `assemble` concatenates
    each record over the steps once and gathers each sequence's rows from it: a few tensor ops
    per record and sequence, where cutting every step's records per sequence cost a few per
    record, sequence and step."""

    def __init__(self) -> None:
        self.steps: list[StepCapture] = []
        self.num_rows: list[int] = []

    def add(self, capture: StepCapture, num_rows: int, spans) -> None:
        """One step's records of ``num_rows`` rows; ``spans`` holds ``(sequence capture, start,
        end)`` for each sequence fed this step (a prompt's rows go to each of its samples)."""
        step = len(self.steps)
        self.steps.append(capture)
        self.num_rows.append(num_rows)
        for seq, start, end in spans:
            seq.spans.append((step, start, end))

    def assemble(
        self, seqs: list[SequenceCapture], moe_layers: tuple[int, ...], top_k: int
    ) -> list[tuple[torch.Tensor | None, dict[SiteKey, SiteRecord]]]:
        """Per sequence: the routing record, int32 ``[L_moe, T, k]`` in the order of
        ``moe_layers`` (-1 for a layer nothing recorded; None when routing was not kept), and
        the guidance records, rows ``T`` in token order (sparse ones packed). Empties the log."""
        if torch.cuda.is_available():  # the host copies of `StepCapture.to_host` must have landed
            torch.cuda.synchronize()
        steps, offsets = self.steps, [0]
        for n in self.num_rows:
            offsets.append(offsets[-1] + n)
        rows = [[(offsets[s] + a, offsets[s] + b) for s, a, b in seq.spans] for seq in seqs]
        keep_routing = bool(steps) and steps[0].keep_routing
        routing_LRk = None
        if keep_routing:
            layers = [
                _cat_steps(steps, lambda c, layer=layer: c.routing.get(layer))
                for layer in moe_layers
            ]
            total, device = offsets[-1], next((t.device for t in layers if t is not None), "cpu")
            missing = torch.full((total, top_k), -1, dtype=torch.int32, device=device)
            routing_LRk = torch.stack([t if t is not None else missing for t in layers])
        keys = list(steps[0].sites) if steps else []
        sites = {key: _cat_steps(steps, lambda c, key=key: c.sites.get(key)) for key in keys}
        self.steps, self.num_rows = [], []
        per_seq = {key: record_gather_packed(r, rows) for key, r in sites.items()}
        out = []
        for seq, spans in enumerate(rows):
            routing = None
            if routing_LRk is not None:
                index = torch.tensor([i for a, b in spans for i in range(a, b)], dtype=torch.long)
                routing = routing_LRk[:, index.to(routing_LRk.device, non_blocking=True)]
            out.append((routing, {key: records[seq] for key, records in per_seq.items()}))
        return out


def _cat_steps(steps: list[StepCapture], get):
    """One record over all steps (None when no step has it; an error when only some do)."""
    parts = [get(c) for c in steps]
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise RuntimeError("a record is missing from some captured steps (a capture bug)")
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return record_cat(parts)
