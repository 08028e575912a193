"""Rollout-guided rounding (TRACE): quantize with the rollout's scales, round toward its codes.

Rollout and trainer compute slightly different high-precision values for the same site. Guided
modes take the rollout's block and global scales (sparse guidance derives them), scale ``x`` by them
exactly as `reference.quantize` would (``y = x * (1 / (f32(sf) * s))``), and then choose between
the two E2M1 codewords that bracket ``y`` on the signed grid:

- ``lo`` / ``hi``: the magnitudes just below and just above ``|y|`` (equal when ``|y|`` is a
  codeword, both 6 when ``|y| >= 6``); the result always takes the sign of ``y``.
- **guided-full** (`round_guided_full`, from the rollout's codes): the bracket member nearest
  the rollout's codeword. As the two are adjacent, that is the rollout's codeword clamped into
  ``[lo, hi]``; a rollout codeword of the opposite sign clamps to ``lo``. Hence the result is
  never farther from the rollout's codeword than round-to-nearest, and equals it whenever the
  rollout's codeword is one of the two neighbours.
- **guided-compact** (`round_guided_compact`, from the rollout's mantissa bits): the bracket
  member whose mantissa bit equals the rollout's. Adjacent magnitudes always differ in that
  bit, so one bit names the rollout's neighbour whenever the rollout's codeword is one of the
  two.
- **guided-sparse** (`fp4rl.fp4.sparse_guidance`): the rollout records only the values it
  computed near a rounding boundary, each with its mantissa bit, and the trainer takes the
  compact choice there and rounds to nearest elsewhere, under scales it derives by the recipe.

Zero crossing: when ``|y| < 0.5`` the bracket is ``{0, 0.5}`` with the sign of ``y``. If the
rollout chose a non-zero codeword of the *other* sign, guided-full returns (signed) zero, the
nearer member; guided-compact cannot see the sign and returns ±0.5 if the rollout's mantissa bit
is 1, which is one step farther from the rollout than nearest would be. Compact guidance is
therefore only guaranteed to help when the two sides are adjacent (the common case).

A block whose local values are not all finite gets a NaN block scale and zero codes, like a
poisoned group in `reference.quantize`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp4rl.fp4.format import (
    BLOCK_SIZE,
    E2M1_VALUES,
    MAGNITUDE_MASK,
    MANTISSA_BIT,
    SIGN_BIT,
)
from fp4rl.fp4.reference import (
    check_input,
    pack_e2m1,
    scaled_values,
    unpack_e2m1,
)
from fp4rl.fp4.tensor import NVFP4Tensor, float8_safe_reduce


@dataclass(frozen=True, slots=True)
class CompactCodes:
    """Compact guidance for one site: the rollout's mantissa bits and its scales.

    ``mantissa_bits`` uint8 ``[..., K/8]`` (element 8j+b in bit b), ``block_scale`` and
    ``global_scale`` as in `NVFP4Tensor`.
    """

    mantissa_bits: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    __reduce__ = float8_safe_reduce  # its float8 block scales through pickle

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.mantissa_bits.shape[:-1], self.mantissa_bits.shape[-1] * 8))

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.mantissa_bits, self.block_scale, self.global_scale)
        )


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` 0/1 uint8 -> ``[..., K/8]``, element 8j+b in bit b."""
    weights = 1 << torch.arange(8, device=bits.device, dtype=torch.uint8)
    return (bits.unflatten(-1, (-1, 8)) * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def compact(t: NVFP4Tensor) -> CompactCodes:
    """Keep only the mantissa bit of each code, plus the scales."""
    bits = unpack_e2m1(t.codes) & MANTISSA_BIT
    return CompactCodes(
        mantissa_bits=pack_bits(bits), block_scale=t.block_scale, global_scale=t.global_scale
    )


def e2m1_bracket(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude indices ``(lo, hi)`` of the codewords just below and above ``|y|`` (uint8)."""
    a = y.abs()
    lo = (
        (a >= 0.5).to(torch.uint8)
        + (a >= 1.0)
        + (a >= 1.5)
        + (a >= 2.0)
        + (a >= 3.0)
        + (a >= 4.0)
        + (a >= 6.0)
    )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=y.device)
    hi = lo + ((a > table[lo.long()]) & (lo < 7)).to(torch.uint8)
    return lo, hi


def round_within_bracket(
    x: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, choose
) -> NVFP4Tensor:
    """``x`` quantized under the given scales, each value's code picked from its bracket by
    ``choose(lo, hi, sign, y)`` (the magnitude codes around the scaled value ``y``): the
    machinery every guided mode shares."""
    check_input(x)
    x_blocks = x.unflatten(-1, (-1, BLOCK_SIZE))
    if block_scale.shape != x_blocks.shape[:-1]:
        raise ValueError(
            f"guidance block_scale {tuple(block_scale.shape)} does not match x "
            f"{tuple(x.shape)} (expected {tuple(x_blocks.shape[:-1])})"
        )
    bad = ~torch.isfinite(x_blocks).all(-1)
    block_scale = torch.where(bad, torch.full_like(block_scale, math.nan), block_scale)
    y, live = scaled_values(x_blocks, block_scale, global_scale)
    lo, hi = e2m1_bracket(y)
    sign = torch.signbit(y).to(torch.uint8) << 3
    codes = choose(lo, hi, sign, y) | sign
    codes = torch.where(live.unsqueeze(-1), codes, torch.zeros_like(codes))
    return NVFP4Tensor(
        codes=pack_e2m1(codes.flatten(-2)), block_scale=block_scale, global_scale=global_scale
    )


def round_guided_full(x: torch.Tensor, rollout: NVFP4Tensor) -> NVFP4Tensor:
    """Quantize ``x`` with the rollout's scales, rounding toward the rollout's codes."""
    if rollout.shape != x.shape:
        raise ValueError(f"rollout codes of shape {tuple(rollout.shape)} for x {tuple(x.shape)}")
    target = unpack_e2m1(rollout.codes).unflatten(-1, (-1, BLOCK_SIZE))

    def choose(lo, hi, sign, y) -> torch.Tensor:
        # A rollout codeword across zero is nearest the bracket's lower magnitude.
        same_side = (target & SIGN_BIT) == sign
        want = torch.where(same_side, target & MAGNITUDE_MASK, torch.zeros_like(target))
        return torch.minimum(torch.maximum(want, lo), hi)

    return round_within_bracket(x, rollout.block_scale, rollout.global_scale, choose)


def round_guided_compact(x: torch.Tensor, guidance: CompactCodes) -> NVFP4Tensor:
    """Quantize ``x`` with the rollout's scales, taking the neighbour with its mantissa bit."""
    if guidance.shape != x.shape:
        raise ValueError(
            f"compact guidance of shape {tuple(guidance.shape)} for x {tuple(x.shape)}"
        )
    bit = unpack_bits(guidance.mantissa_bits).unflatten(-1, (-1, BLOCK_SIZE))

    def choose(lo, hi, sign, y) -> torch.Tensor:
        return torch.where((lo & MANTISSA_BIT) == bit, lo, hi)

    return round_within_bracket(x, guidance.block_scale, guidance.global_scale, choose)
