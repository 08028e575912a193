"""Paged KV storage, one page pool per decoder layer, in BF16 (model dtype) or NVFP4.

Legend: N blocks, B block size (token slots per block), K kv heads, D head dim, T tokens
written this step, C context tokens gathered. A *slot* is ``block * B + offset``.

- "bf16" pages hold K and V as the model gave them: ``[N, B, K, D]`` in the model dtype.
- "nvfp4" pages hold what the layer's K (after RoPE) and V `Fp4Site`s produce rounding to
  nearest, ``quantize(x_TKD, scaling="row")``: 1x16 E4M3 block scales along D and one global
  scale per token-head, kept as the `NVFP4Rows` ``codes [N, B, K, D/2]``, ``block_scale [N, B,
  K, D/16]`` and ``amax [N, B, K, 1]`` (the codes' sign bits where the decoding kernels flip
  them: `reference.page_codes`): each token-head's amax in the model dtype, of which its
  FP32 global scale is a function (`reference.global_scale_from_amax`), 2 bytes instead of 4 in
  BF16. A token-head costs 4.5 bits per value plus 2 bytes. Reading dequantizes in the query
  dtype, which is exactly the trainer's fake quantization ``dequantize(quantize(x,
  scaling="row"), x.dtype)``: quantization is per row, so gathering rows before dequantizing
  changes no bit.

The format is chosen per layer (the precision plan keeps boundary layers in BF16). This module
owns the bytes; who reads which slots is `fp4rl.rollout.attention`'s business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp4rl import ops
from fp4rl.fp4 import BLOCK_SIZE
from fp4rl.fp4.reference import rows_tensor
from fp4rl.fp4.tensor import NVFP4Rows
from fp4rl.model.precision import KV_FORMATS
from fp4rl.rollout.config import EngineConfig
from fp4rl.rollout.device_memory import ReservedMemory


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    layer_formats: tuple[str, ...]  # "bf16" | "nvfp4" per decoder layer
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's compute dtype, which "bf16" pages store

    def __post_init__(self) -> None:
        for layer, fmt in enumerate(self.layer_formats):
            if fmt not in KV_FORMATS:
                raise ValueError(f"layers.{layer}: KV format must be in {KV_FORMATS}, got {fmt!r}")
            if fmt == "nvfp4" and self.head_dim % BLOCK_SIZE:
                raise ValueError(
                    f"layers.{layer}: nvfp4 KV needs head_dim % 16 == 0, got {self.head_dim}"
                )

    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        K, D, itemsize = self.num_kv_heads, self.head_dim, self.dtype.itemsize
        per_format = {
            "bf16": K * D * itemsize,
            "nvfp4": K * (D // 2 + D // BLOCK_SIZE + itemsize),  # codes, e4m3 scales, amax
        }
        return 2 * sum(per_format[fmt] for fmt in self.layer_formats)


def num_blocks_for_budget(config: EngineConfig, spec: KVCacheSpec) -> int:
    """How many blocks ``config.kv_memory_bytes`` buys; at least one max-length sequence."""
    bytes_per_block = spec.bytes_per_token() * config.block_size
    num_blocks = config.kv_memory_bytes // bytes_per_block
    needed = -(-config.max_model_len // config.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"engine.kv_memory_bytes={config.kv_memory_bytes} buys {num_blocks} KV blocks of "
            f"{bytes_per_block} bytes; one sequence of max_model_len={config.max_model_len} "
            f"needs {needed} ({needed * bytes_per_block} bytes)"
        )
    return num_blocks


class _Bf16Pages:
    def __init__(self, num_blocks, block_size, K, D, dtype, zeros) -> None:
        self.k_NBKD = zeros((num_blocks, block_size, K, D), dtype)
        self.v_NBKD = zeros((num_blocks, block_size, K, D), dtype)

    def write(self, slots_T, k_TKD, v_TKD, record=None) -> tuple[None, None]:
        if record is not None:
            raise ValueError(f"BF16 pages quantize nothing to make a {record!r} record of")
        self.k_NBKD.flatten(0, 1)[slots_T] = k_TKD.to(self.k_NBKD.dtype)
        self.v_NBKD.flatten(0, 1)[slots_T] = v_TKD.to(self.v_NBKD.dtype)
        return None, None

    def read(self, slots_C, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.k_NBKD.flatten(0, 1)[slots_C].to(dtype),
            self.v_NBKD.flatten(0, 1)[slots_C].to(dtype),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k_NBKD, self.v_NBKD


def _empty_rows(num_blocks, block_size, K, D, dtype, zeros) -> NVFP4Rows:
    lead = (num_blocks, block_size, K)
    rows = num_blocks * block_size * K
    # A spare amax after an odd count: kernels read 2-byte amaxes as whole 4-byte words.
    amax = zeros((rows + rows % 2,), dtype)[:rows]
    return NVFP4Rows(
        codes=zeros((*lead, D // 2), torch.uint8),
        block_scale=zeros((*lead, D // BLOCK_SIZE), torch.float8_e4m3fn),
        amax=amax.view(*lead, 1),
    )


class _Nvfp4Pages:
    def __init__(self, num_blocks, block_size, K, D, dtype, zeros) -> None:
        self.k = _empty_rows(num_blocks, block_size, K, D, dtype, zeros)
        self.v = _empty_rows(num_blocks, block_size, K, D, dtype, zeros)

    def write(self, slots_T, k_TKD, v_TKD, record=None):
        return ops.quantize_into_pair(k_TKD, self.k, v_TKD, self.v, slots_T, record)

    def read(self, slots_C, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        def rows(m: torch.Tensor) -> torch.Tensor:
            return m.flatten(0, 1)[slots_C]

        return (
            ops.dequantize(rows_tensor(self.k.map(rows)), dtype),
            ops.dequantize(rows_tensor(self.v.map(rows)), dtype),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.k.tensors(), *self.v.tensors())


_ALIGN = 256  # bytes: each page tensor in reserved memory starts on this boundary


class KVCache:
    """All layers' pages, each in its layer's format from the precision plan, zeroed. With
    ``reserved``, every page tensor lies in one `ReservedMemory` (``memory``), whose physical
    memory `unmap` gives back and `map` takes again, zeroed, at the same addresses."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        *,
        reserved: bool = False,
    ) -> None:
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.memory: ReservedMemory | None = None
        if not reserved:

            def zeros(shape, dtype) -> torch.Tensor:
                return torch.zeros(shape, dtype=dtype, device=device)

            self.layers = self._pages(zeros)
            return
        offsets = []  # where each tensor goes, from a first pass that allocates nothing

        def place(shape, dtype) -> torch.Tensor:
            start = offsets[-1][1] if offsets else 0
            start = -(-start // _ALIGN) * _ALIGN
            offsets.append((start, start + math.prod(shape) * dtype.itemsize))
            return torch.empty(shape, dtype=dtype, device="meta")

        self._pages(place)
        self.memory = ReservedMemory(offsets[-1][1], device)
        spans = iter(offsets)

        def carve(shape, dtype) -> torch.Tensor:
            start, end = next(spans)
            return self.memory.view(start, end - start).view(dtype).view(shape)

        self.layers = self._pages(carve)

    def _pages(self, zeros) -> list:
        spec, pages = self.spec, {"bf16": _Bf16Pages, "nvfp4": _Nvfp4Pages}
        shape = (self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        return [pages[fmt](*shape, spec.dtype, zeros) for fmt in spec.layer_formats]

    def write(
        self,
        layer: int,
        slots_T: torch.Tensor,
        k_TKD: torch.Tensor,
        v_TKD: torch.Tensor,
        *,
        record: str | None = None,
    ) -> tuple[ops.SiteRecord | None, ops.SiteRecord | None]:
        """Store this step's K/V values ``[T, K, D]`` of ``layer`` at ``slots_T`` in the layer's
        format: as they are in a "bf16" layer; in an "nvfp4" one quantized per token-head
        straight into the pages (`ops.quantize_into_pair`: one launch on the GPU), bitwise what
        the layer's K/V sites give rounding to nearest. Returns K's and V's site records in form
        ``record`` ("full" or "compact", an "nvfp4" layer only) from the same write, or ``(None,
        None)``."""
        for name, x in (("k_TKD", k_TKD), ("v_TKD", v_TKD)):
            if not isinstance(x, torch.Tensor) or x.dtype != self.spec.dtype:
                what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
                raise TypeError(
                    f"layers.{layer}: the cache stores K/V values in {self.spec.dtype}; "
                    f"{name} is {what}"
                )
        try:
            return self.layers[layer].write(slots_T, k_TKD, v_TKD, record)
        except ValueError as err:
            raise ValueError(f"layers.{layer} K/V: {err}") from err

    def pages(self, layer: int) -> tuple[torch.Tensor | NVFP4Rows, torch.Tensor | NVFP4Rows]:
        """``layer``'s K and V pages as stored: ``[N, B, K, D]`` tensors or `NVFP4Rows`."""
        p = self.layers[layer]
        return (p.k, p.v) if isinstance(p, _Nvfp4Pages) else (p.k_NBKD, p.v_NBKD)

    def read(
        self, layer: int, slots_C: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[C, K, D]`` in ``dtype`` at the given slots (dequantized for nvfp4)."""
        return self.layers[layer].read(slots_C, dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (a forked sample's partial block)."""
        if not pairs:
            return
        src, dst = (torch.tensor(ids, dtype=torch.long) for ids in zip(*pairs, strict=True))
        for pages in self.layers:
            for t in pages.tensors():
                t[dst.to(t.device)] = t[src.to(t.device)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.layers for t in p.tensors())
