"""NVFP4Tensor: packed E2M1 codes with their E4M3 block scales and FP32 global scales.

This module owns the container and its layout invariants; the arithmetic that fills it lives in
`fp4rl.fp4.reference` (the specification) and `fp4rl.kernels` (its bit-exact GPU twins).

Shapes, for a logical tensor ``[..., K]`` quantized with a global scale shared over its trailing
``group_ndim`` dimensions:

- ``codes``         uint8             ``[..., K // 2]``   two E2M1 codes per byte, even element low
- ``block_scale``   float8_e4m3fn     ``[..., K // 16]``  one scale per 16 values along K
- ``global_scale``  float32           ``shape[:-group_ndim] + (1,) * group_ndim``

`NVFP4Rows` holds per-row quantized rows with each row's amax in place of its global scale: the
paged KV cache's layout (its codes' sign bits placed for the decoding kernels).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fp4rl.fp4.format import BLOCK_SIZE

# The dtypes quantization takes, and so those a row's amax is kept in (`NVFP4Rows`).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_codes(codes: torch.Tensor, block_scale: torch.Tensor) -> None:
    """The dtypes and shapes of packed codes ``[..., K / 2]`` and their scales ``[..., K / 16]``."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if block_scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"block_scale must be float8_e4m3fn, got {block_scale.dtype}")
    lead, half_k = codes.shape[:-1], codes.shape[-1]
    if block_scale.shape != (*lead, half_k * 2 // BLOCK_SIZE) or half_k % 8:
        raise ValueError(
            f"codes {tuple(codes.shape)} and block_scale {tuple(block_scale.shape)} do not "
            "describe [..., K] with K % 16 == 0"
        )


FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def float8_safe_reduce(record):
    """``__reduce__`` for a dataclass of tensors (`NVFP4Tensor`, `NVFP4Rows`,
    `fp4rl.fp4.rounding.CompactCodes`): torch's tensors of float8 pickle, but do not unpickle
    (torch 2.13: "UntypedStorage has no attribute dtype"), so those go as their bytes (a uint8
    view, no copy) and come back as float8 views of them. `torch.save` takes the same path."""
    values = tuple(getattr(record, f.name) for f in dataclasses.fields(record))
    float8 = tuple(isinstance(v, torch.Tensor) and v.dtype in FLOAT8_DTYPES for v in values)
    pairs = zip(values, float8, strict=True)
    sent = tuple((v.view(torch.uint8), v.dtype) if eight else v for v, eight in pairs)
    return _unpickle, (type(record), sent, float8)


def _unpickle(cls, sent: tuple, float8: tuple):
    values = (v[0].view(v[1]) if eight else v for v, eight in zip(sent, float8, strict=True))
    return cls(*values)


class _PackedCodes:
    """What both containers read off their packed codes."""

    __slots__ = ()

    __reduce__ = float8_safe_reduce

    @property
    def shape(self) -> torch.Size:
        """The logical (unpacked) shape ``[..., K]``."""
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    @property
    def device(self) -> torch.device:
        return self.codes.device


@dataclass(frozen=True, slots=True)
class NVFP4Tensor(_PackedCodes):
    codes: torch.Tensor  # uint8 [..., K/2]
    block_scale: torch.Tensor  # float8_e4m3fn [..., K/16]
    global_scale: torch.Tensor  # float32, broadcastable to [..., 1]

    def __post_init__(self) -> None:
        _check_codes(self.codes, self.block_scale)
        if self.global_scale.dtype != torch.float32:
            raise TypeError(f"global_scale must be float32, got {self.global_scale.dtype}")
        lead = self.codes.shape[:-1]
        if self.global_scale.dim() != self.codes.dim():
            raise ValueError(
                f"global_scale {tuple(self.global_scale.shape)} must have one entry per dim of "
                f"codes {tuple(self.codes.shape)}"
            )
        # Same rank, so broadcasting means each dim is 1 or equal (torch.broadcast_shapes says
        # the same in tens of microseconds, a cost every quantize call would pay).
        target = (*lead, 1)
        if any(g not in (1, t) for g, t in zip(self.global_scale.shape, target, strict=True)):
            raise ValueError(
                f"global_scale {tuple(self.global_scale.shape)} does not broadcast to {target}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes held: 4 bits per value, 8 bits per 16-value block, 32 bits per global scale."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.block_scale, self.global_scale

    def map(self, fn) -> NVFP4Tensor:
        """Apply ``fn`` to each member tensor (indexing along leading dims, ``.to(device)``)."""
        return NVFP4Tensor(
            codes=fn(self.codes),
            block_scale=fn(self.block_scale),
            global_scale=fn(self.global_scale),
        )

    def equal(self, other: NVFP4Tensor) -> bool:
        """Bitwise equality of codes, block scales and global scales (NaN patterns included)."""
        return (
            torch.equal(self.codes, other.codes)
            and torch.equal(self.block_scale.view(torch.uint8), other.block_scale.view(torch.uint8))
            and torch.equal(
                self.global_scale.view(torch.int32), other.global_scale.view(torch.int32)
            )
        )


@dataclass(frozen=True, slots=True)
class NVFP4Rows(_PackedCodes):
    """Rows quantized with one global scale each (``scaling="row"``), as a paged KV cache holds
    them: codes (their sign bits moved, below) and block scales as in `NVFP4Tensor`, and in
    place of each row's FP32 global scale the row's amax ``max |x|`` in x's dtype (NaN where the
    row is not finite).

    The recipe's global scale is a function of that amax (`reference.global_scale_from_amax`),
    and the amax of a BF16 row is a BF16 value, so a BF16 row keeps 2 bytes of scale instead of
    4 and loses nothing: `reference.rows_tensor` gives back the `NVFP4Tensor`, bit for bit.

    - ``codes``        uint8                     ``[..., K // 2]``, each 4-byte word's sign bits
      moved for the decoding kernels (`reference.PAGE_SIGNS`; `rows_tensor` moves them back)
    - ``block_scale``  float8_e4m3fn             ``[..., K // 16]``
    - ``amax``         bfloat16/float16/float32  ``[..., 1]``
    """

    codes: torch.Tensor
    block_scale: torch.Tensor
    amax: torch.Tensor

    def __post_init__(self) -> None:
        _check_codes(self.codes, self.block_scale)
        if self.amax.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"amax must be one of {SUPPORTED_DTYPES}, got {self.amax.dtype}")
        if self.amax.shape != (*self.codes.shape[:-1], 1):
            raise ValueError(
                f"amax {tuple(self.amax.shape)} must hold one value per row of codes "
                f"{tuple(self.codes.shape)}: {(*self.codes.shape[:-1], 1)}"
            )

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.block_scale, self.amax

    def map(self, fn) -> NVFP4Rows:
        """Apply ``fn`` to each member tensor (indexing along leading dims, ``.to(device)``)."""
        return NVFP4Rows(codes=fn(self.codes), block_scale=fn(self.block_scale), amax=fn(self.amax))
