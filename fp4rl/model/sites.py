"""One FP4 quantization site: quantize rows, follow the rollout's guidance, record, pass through.

Every FP4 activation in fp4rl (routed-expert input, expert intermediate, K and V entries) goes
through `Fp4Site`, in the trainer and in the rollout alike, so the two sides share one
quantization path. Rows are quantized independently (one FP32 global scale per row), which makes
a site's record sliceable by token: the rollout splits it per sequence, the trainer concatenates.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from fp4rl.fp4 import CompactCodes, NVFP4Tensor, SparseCodes
from fp4rl.ops import dequantize, fake_quantize, quantize_site
from fp4rl.records import GuidanceMap, SiteKey


class Capture(Protocol):
    """Receives what the rollout computed, for the trainer to align with later.

    ``record`` gets the site's `NVFP4Tensor` and, when ``keeps_values``, also the values it
    quantized (same layout): sparse guidance needs to know how close each was to a boundary.
    Where it does not, a kernel that rounds a site to nearest on its way (the KV store, the
    experts' SwiGLU, the norm before the experts) may make the record itself, in
    ``record_form``: "full" (the `NVFP4Tensor`) or "compact" (its `CompactCodes`, which
    ``record`` then gets as they are)."""

    keeps_values: bool
    record_form: str

    def records(self, layer: int, site: str) -> bool:
        """Whether `record` keeps anything of this site (else a site may skip making it)."""
        ...

    def record(
        self, layer: int, site: str, t: NVFP4Tensor | CompactCodes, x: torch.Tensor | None = None
    ) -> None: ...

    def record_routing(self, layer: int, topk_ids_Tk: torch.Tensor) -> None:
        """Keep a MoE layer's top-k expert ids ``[T, k]`` (any integer dtype: kept as int32)."""
        ...


class SiteRecords:
    """A `Capture` that keeps, per forward, the record of every site and each layer's routing:
    what a trainer compares with the rollout's records (mismatch metrics, tests)."""

    keeps_values = False
    record_form = "full"

    def __init__(self) -> None:
        self.sites: dict[SiteKey, NVFP4Tensor] = {}
        self.routing: dict[int, torch.Tensor] = {}

    def records(self, layer: int, site: str) -> bool:
        return True

    def record(self, layer: int, site: str, t: NVFP4Tensor, x=None) -> None:
        self.sites[(layer, site)] = t

    def record_routing(self, layer: int, topk_ids_Tk: torch.Tensor) -> None:
        self.routing[layer] = topk_ids_Tk.to(torch.int32)


class _StraightThrough(torch.autograd.Function):
    """Forward returns the quantized value; backward hands the gradient to the original."""

    @staticmethod
    def forward(ctx, x, x_quantized):
        return x_quantized

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def straight_through(x: torch.Tensor, x_quantized: torch.Tensor) -> torch.Tensor:
    if not x.requires_grad:
        return x_quantized
    return _StraightThrough.apply(x, x_quantized)


@dataclass(frozen=True, slots=True)
class Fp4Site:
    layer: int
    name: str
    guided: bool  # the precision policy lets this site follow the rollout's codes

    def __call__(
        self,
        x: torch.Tensor,
        guidance: GuidanceMap | None = None,
        capture: Capture | None = None,
        *,
        row_order: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Quantize-dequantize ``x [..., K]`` per row.

        Callers that compute rows in another order (the experts, sorted by expert) pass
        ``x [R, K]`` and ``row_order``, a long tensor shaped like the site's canonical leading
        dims (``[T, top_k]``) holding, for each canonical row, its row in ``x``. Guidance arrives
        and captures leave in the canonical layout.
        """
        g = self._guidance(guidance, x, row_order)
        if g is not None and row_order is not None:
            with self._named():
                g = _rows(g, torch.argsort(row_order.flatten()))
        if capture is None or self.follows_nothing(guidance, capture):
            # Values only (the trainer; a rollout whose capture keeps nothing of this site): one
            # fused kernel on the GPU, the bits of quantize then dequantize.
            with self._named():
                return fake_quantize(x, scaling="row", guidance=g)
        t = self._quantize(x, g, capture, row_order)
        return straight_through(x, dequantize(t, x.dtype))

    def quantize(
        self, x: torch.Tensor, guidance: GuidanceMap | None = None, capture: Capture | None = None
    ) -> NVFP4Tensor:
        """The site's `NVFP4Tensor` of ``x [..., K]`` (rows in canonical order): what a cache
        stores. Its dequantized value is bitwise what ``self(x, guidance, capture)`` returns."""
        return self._quantize(x, self._guidance(guidance, x, None), capture, None)

    def follows(self, guidance: GuidanceMap | None) -> bool:
        """Whether this site rounds toward a record of ``guidance`` (else to nearest)."""
        return guidance is not None and self.guided

    def follows_nothing(self, guidance: GuidanceMap | None, capture: Capture | None) -> bool:
        """Whether this site rounds to nearest and nobody keeps its record: then a kernel may
        quantize it on the way (the KV store, the experts' SwiGLU) without making its
        `NVFP4Tensor`."""
        return self.on_the_way(guidance, capture) == ""

    def on_the_way(self, guidance: GuidanceMap | None, capture: Capture | None) -> str | None:
        """Whether a kernel that rounds this site's values to nearest on its way (the KV
        store, the experts' SwiGLU, the norm before the experts) may stand in for the site, and
        which record it must then make: "" where nobody keeps one, else the capture's
        ``record_form`` (hand the record to `keep`); None where the site must run itself (it
        follows guidance, or its capture keeps the values too)."""
        if self.follows(guidance):
            return None
        if capture is None or not capture.records(self.layer, self.name):
            return ""
        return None if capture.keeps_values else capture.record_form

    def keep(self, capture: Capture, record: NVFP4Tensor | CompactCodes) -> None:
        """Hand ``capture`` the record a kernel made on the way (`on_the_way`), rows in the
        site's canonical layout."""
        capture.record(self.layer, self.name, record)

    def _quantize(self, x, g, capture, row_order) -> NVFP4Tensor:
        x = x.detach()
        with self._named():
            t = quantize_site(x, scaling="row", guidance=g)
        if capture is not None:
            record, values = t, x if capture.keeps_values else None
            if row_order is not None:
                lead, index = row_order.shape, row_order.flatten()
                record = _rows(t, index).map(lambda m: m.view(*lead, m.shape[-1]))
                if values is not None:
                    values = values[index].view(*lead, x.shape[-1])
            capture.record(self.layer, self.name, record, values)
        return t

    def _guidance(self, guidance: GuidanceMap | None, x: torch.Tensor, row_order):
        """This site's record, checked against the values it will round (canonical layout)."""
        if not self.follows(guidance):
            return None
        try:
            g = guidance[(self.layer, self.name)]
        except KeyError:
            raise ValueError(
                f"guidance was given but has no entry for {self._where()}; refusing to fall back "
                "to nearest rounding silently"
            ) from None
        lead = x.shape[:-1] if row_order is None else row_order.shape
        if g is not None and tuple(g.shape) != (*lead, x.shape[-1]):
            raise ValueError(
                f"guidance for {self._where()} has shape {tuple(g.shape)}, but the site rounds "
                f"values of shape {(*lead, x.shape[-1])}"
            )
        return g

    def _where(self) -> str:
        return f"layers.{self.layer} site '{self.name}'"

    @contextmanager
    def _named(self):
        """Errors of the rounding itself (a malformed record) name the site."""
        try:
            yield
        except ValueError as err:
            raise ValueError(f"{self._where()}: {err}") from err


def _rows(t, index: torch.Tensor):
    """Select rows of a site record laid out ``[R, ...]`` after flattening its leading dims."""
    if isinstance(t, SparseCodes):
        return t.select_rows(index)
    if isinstance(t, NVFP4Tensor):
        return NVFP4Tensor(
            codes=_flat_rows(t.codes, index),
            block_scale=_flat_rows(t.block_scale, index),
            global_scale=_flat_rows(t.global_scale, index),
        )
    return CompactCodes(
        mantissa_bits=_flat_rows(t.mantissa_bits, index),
        block_scale=_flat_rows(t.block_scale, index),
        global_scale=_flat_rows(t.global_scale, index),
    )


def _flat_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])[index]
