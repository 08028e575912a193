"""What the rollout records for the trainer: top-k routing and the FP4 sites' codes (guidance).

`StepCapture` is the ``capture`` argument of one forward (the model's FP4 sites record
"expert_input", "expert_hidden", and "k" and "v" of NVFP4-KV layers; its routers record the
top-k ids). Every record has one row per step token, and every row is quantized on its own
(per-row global scales), so `StepCapture.split` can cut a step's records into per-sequence
pieces by row range. A `SequenceCapture` collects a sequence's pieces in token order; its
`guidance` and `routing` concatenate them over all ``T = len(prompt) + len(completion) - 1``
fed tokens.

Guidance modes: "full" keeps each `NVFP4Tensor`; "compact" keeps `fp4rl.fp4.compact(t)`
(mantissa bits and scales) for the latter ``fraction`` of the FP4 layers only and drops the
rest (the trainer rounds those to nearest); "sparse" keeps `fp4rl.fp4.sparse(x, t, delta)` in
every FP4 layer: the scales, and a position and a bit for each value the site computed within
``delta`` grid units of a rounding boundary (so it asks the sites for their values too).

Legend: T tokens, k experts per token, L_moe MoE layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fp4rl.fp4 import NVFP4Tensor, compact, sparse
from fp4rl.records import SiteKey, SiteRecord, record_cat, record_rows


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
class Piece:
    """One sequence's rows of one step: routing ids ``[n, k]`` per MoE layer, site records."""

    num_rows: int
    routing: dict[int, torch.Tensor]
    sites: dict[SiteKey, SiteRecord]


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

    def split(self, row_ranges: list[tuple[int, int]]) -> list[Piece]:
        """Per-sequence pieces for the given ``[start, end)`` token-row ranges."""
        return [
            Piece(
                num_rows=b - a,
                routing={layer: ids[a:b] for layer, ids in self.routing.items()},
                sites={key: record_rows(r, a, b) for key, r in self.sites.items()},
            )
            for a, b in row_ranges
        ]


@dataclass(slots=True)
class SequenceCapture:
    pieces: list[Piece] = field(default_factory=list)

    def clear(self) -> None:
        self.pieces.clear()

    def routing(self, moe_layers: tuple[int, ...], top_k: int) -> torch.Tensor:
        """int32 ``[L_moe, T, k]`` in the order of ``moe_layers``; -1 where nothing was recorded."""
        T = sum(p.num_rows for p in self.pieces)
        device = next((ids.device for p in self.pieces for ids in p.routing.values()), "cpu")
        out = torch.full((len(moe_layers), T, top_k), -1, dtype=torch.int32, device=device)
        row = 0
        for piece in self.pieces:
            for i, layer in enumerate(moe_layers):
                if layer in piece.routing:
                    out[i, row : row + piece.num_rows] = piece.routing[layer]
            row += piece.num_rows
        return out

    def guidance(self) -> dict[SiteKey, SiteRecord]:
        keys = self.pieces[0].sites.keys() if self.pieces else ()
        return {key: record_cat([p.sites[key] for p in self.pieces]) for key in keys}
