"""Paged KV storage, one page pool per decoder layer, in BF16 (model dtype) or NVFP4.

Legend: N blocks, B block size (token slots per block), K kv heads, D head dim, T tokens
written this step, C context tokens gathered. A *slot* is ``block * B + offset``.

- "bf16" pages hold K and V as the model gave them: ``[N, B, K, D]`` in the model dtype.
- "nvfp4" pages hold what the layer's K (after RoPE) and V `Fp4Site`s produce,
  ``quantize(x_TKD, scaling="row")``: one FP32 global scale per token-head and 1x16 E4M3 block
  scales along D, i.e. an `NVFP4Tensor` whose members are ``codes [N, B, K, D/2]``,
  ``block_scale [N, B, K, D/16]`` and ``global_scale [N, B, K, 1]`` (4.5 bits per value plus 4
  bytes per token-head). Reading dequantizes in the query dtype, which is exactly the
  trainer's fake quantization ``dequantize(quantize(x, scaling="row"), x.dtype)``:
  quantization is per row, so gathering rows before dequantizing changes no bit.

The format is chosen per layer (the precision plan keeps boundary layers in BF16). This module
owns the bytes; who reads which slots is `fp4rl.rollout.attention`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4rl.fp4 import BLOCK_SIZE, NVFP4Tensor
from fp4rl.fp4.reference import put_rows
from fp4rl.model.attention import KVEntry
from fp4rl.model.precision import KV_FORMATS
from fp4rl.ops import dequantize
from fp4rl.rollout.config import EngineConfig


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
        K, D = self.num_kv_heads, self.head_dim
        per_format = {
            "bf16": K * D * self.dtype.itemsize,
            "nvfp4": K * (D // 2 + D // BLOCK_SIZE + 4),  # codes + e4m3 scales + fp32 scale
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
    def __init__(self, num_blocks, block_size, K, D, dtype, device) -> None:
        self.k_NBKD = torch.zeros(num_blocks, block_size, K, D, dtype=dtype, device=device)
        self.v_NBKD = torch.zeros_like(self.k_NBKD)

    def write(self, slots_T, k_TKD, v_TKD) -> None:
        self.k_NBKD.flatten(0, 1)[slots_T] = k_TKD.to(self.k_NBKD.dtype)
        self.v_NBKD.flatten(0, 1)[slots_T] = v_TKD.to(self.v_NBKD.dtype)

    def read(self, slots_C, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.k_NBKD.flatten(0, 1)[slots_C].to(dtype),
            self.v_NBKD.flatten(0, 1)[slots_C].to(dtype),
        )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k_NBKD, self.v_NBKD


def _empty_nvfp4(num_blocks, block_size, K, D, device) -> NVFP4Tensor:
    lead = (num_blocks, block_size, K)
    return NVFP4Tensor(
        codes=torch.zeros(*lead, D // 2, dtype=torch.uint8, device=device),
        block_scale=torch.zeros(*lead, D // BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=device),
        global_scale=torch.zeros(*lead, 1, dtype=torch.float32, device=device),
    )


class _Nvfp4Pages:
    def __init__(self, num_blocks, block_size, K, D, dtype, device) -> None:
        self.k = _empty_nvfp4(num_blocks, block_size, K, D, device)
        self.v = _empty_nvfp4(num_blocks, block_size, K, D, device)

    def write(self, slots_T, k: NVFP4Tensor, v: NVFP4Tensor) -> None:
        put_rows(self.k, slots_T, k)
        put_rows(self.v, slots_T, v)

    def read(self, slots_C, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        def rows(m: torch.Tensor) -> torch.Tensor:
            return m.flatten(0, 1)[slots_C]

        return dequantize(self.k.map(rows), dtype), dequantize(self.v.map(rows), dtype)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.k.tensors(), *self.v.tensors())


class KVCache:
    """All layers' pages, each in its layer's format from the precision plan."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, block_size: int, device: torch.device | str
    ) -> None:
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        pages = {"bf16": _Bf16Pages, "nvfp4": _Nvfp4Pages}
        self.layers = [
            pages[fmt](num_blocks, block_size, spec.num_kv_heads, spec.head_dim, spec.dtype, device)
            for fmt in spec.layer_formats
        ]

    def write(self, layer: int, slots_T: torch.Tensor, k: KVEntry, v: KVEntry) -> None:
        """Store this step's K/V entries of ``layer`` at ``slots_T``: tensors ``[T, K, D]``
        for a "bf16" layer, the K/V sites' `NVFP4Tensor`s for an "nvfp4" one."""
        formats = {"nvfp4" if isinstance(x, NVFP4Tensor) else "bf16" for x in (k, v)}
        given = formats.pop() if len(formats) == 1 else "mixed"
        self._check_format(layer, given, f"{type(k).__name__}/{type(v).__name__}")
        self.layers[layer].write(slots_T, k, v)

    def nvfp4_pages(self, layer: int) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        """``layer``'s K and V pages, for a model whose NVFP4 K/V sites quantize straight into
        them (`fp4rl.model.attention.Nvfp4KV.store`)."""
        self._check_format(layer, "nvfp4", "NVFP4 rows")
        p = self.layers[layer]
        return p.k, p.v

    def _check_format(self, layer: int, given: str, entries: str) -> None:
        fmt = self.spec.layer_formats[layer]
        if given != fmt:
            raise TypeError(
                f"layers.{layer}: the cache holds {fmt} KV but was given {entries} entries; the "
                "cache and the model must come from one precision plan"
            )

    def pages(self, layer: int) -> tuple[KVEntry, KVEntry]:
        """``layer``'s K and V pages as stored: ``[N, B, K, D]`` tensors or `NVFP4Tensor`s."""
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
