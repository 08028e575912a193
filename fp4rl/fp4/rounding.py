"""Rollout-guided rounding (TRACE): quantize with the rollout's scales, round toward its codes.

Rollout and trainer compute slightly different high-precision values for the same site. All
guided modes take the rollout's block and global scales, scale the local value ``x`` by them
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
- **guided-sparse** (`round_guided_sparse`, from `SparseCodes`): the rollout records only the
  values it computed within ``delta`` grid units of a rounding boundary (`boundary_distance`),
  each with its mantissa bit. There the trainer takes the compact choice; everywhere else it
  rounds to nearest under the rollout's scales. A trainer value that crosses a boundary the
  rollout was farther than ``delta`` from stays a disagreement.

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

from fp4rl.fp4.format import BLOCK_SIZE, E2M1_VALUES, MAGNITUDE_MASK, MANTISSA_BIT, SIGN_BIT
from fp4rl.fp4.reference import check_input, e2m1_rne, pack_e2m1, scaled_values, unpack_e2m1
from fp4rl.fp4.tensor import NVFP4Tensor


@dataclass(frozen=True, slots=True)
class CompactCodes:
    """Compact guidance for one site: the rollout's mantissa bits and its scales.

    ``mantissa_bits`` uint8 ``[..., K/8]`` (element 8j+b in bit b), ``block_scale`` and
    ``global_scale`` as in `NVFP4Tensor`.
    """

    mantissa_bits: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

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


def _guided(
    x: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, choose
) -> NVFP4Tensor:
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

    return _guided(x, rollout.block_scale, rollout.global_scale, choose)


def round_guided_compact(x: torch.Tensor, guidance: CompactCodes) -> NVFP4Tensor:
    """Quantize ``x`` with the rollout's scales, taking the neighbour with its mantissa bit."""
    if guidance.shape != x.shape:
        raise ValueError(
            f"compact guidance of shape {tuple(guidance.shape)} for x {tuple(x.shape)}"
        )
    bit = unpack_bits(guidance.mantissa_bits).unflatten(-1, (-1, BLOCK_SIZE))

    def choose(lo, hi, sign, y) -> torch.Tensor:
        return torch.where((lo & MANTISSA_BIT) == bit, lo, hi)

    return _guided(x, guidance.block_scale, guidance.global_scale, choose)


# ---- sparse guidance ----------------------------------------------------------------------


def boundary_distance(y: torch.Tensor) -> torch.Tensor:
    """Distance of each scaled value ``y`` from the nearest rounding boundary, in grid units.

    Between two adjacent codewords ``v_lo < |y| < v_hi`` the only rounding boundary is their
    midpoint, and the grid unit there is ``v_hi - v_lo`` (0.5 below 2, 1 from 2 to 4, 2 from 4
    to 6): the distance is ``| |y| - (v_lo + v_hi) / 2 | / (v_hi - v_lo)``, in [0, 0.5), 0 on a
    boundary. On a codeword it is 0.5; at and beyond 6 it is ``(|y| - 5) / 2``. Near a boundary
    both operations are exact in FP32 (a difference of close numbers, a division by a power of
    two), so every device computes the same distance there.
    """
    lo, hi = e2m1_bracket(y)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=y.device)
    v_lo, v_hi = table[lo.long()], table[hi.long()]
    a, width = y.abs(), v_hi - v_lo
    between = (a - (v_lo + v_hi) * 0.5).abs() / torch.where(width > 0, width, 1.0)
    on_codeword = torch.where(lo < 7, 0.5, (a - 5.0) * 0.5)
    return torch.where(width > 0, between, on_codeword)


def _index_dtype(limit: int) -> torch.dtype:
    """The narrowest integer dtype holding 0..limit."""
    for dtype, top in ((torch.uint8, 255), (torch.int16, 2**15 - 1), (torch.int32, 2**31 - 1)):
        if limit <= top:
            return dtype
    raise ValueError(f"sparse guidance needs rows of fewer than 2**30 values, got {limit}")


@dataclass(frozen=True, slots=True)
class SparseCodes:
    """Sparse guidance for one site ``[..., K]``: the values the rollout computed within
    ``delta`` grid units of a rounding boundary (`boundary_distance`), one bit each, plus the
    rollout's scales.

    - ``counts``       ``[...]``           how many values of each row (of K) are recorded
    - ``entries``      ``[n]``             ``column << 1 | mantissa_bit`` of each recorded value:
      rows in order, columns increasing within a row, ``n == counts.sum()``
    - ``block_scale``, ``global_scale``    as in `NVFP4Tensor`

    ``counts`` and ``entries`` take the narrowest integer type holding ``K`` and ``2K - 1``
    (uint8 up to K = 128, then int16, then int32). The mantissa bit of the rollout's code names
    the side of the boundary it took: the two codewords around a boundary always differ in it.
    """

    counts: torch.Tensor
    entries: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor

    def __post_init__(self) -> None:
        lead = tuple(self.block_scale.shape[:-1])
        if tuple(self.counts.shape) != lead or self.entries.dim() != 1:
            raise ValueError(
                f"sparse guidance: counts {tuple(self.counts.shape)} and entries "
                f"{tuple(self.entries.shape)} do not match block_scale "
                f"{tuple(self.block_scale.shape)} (counts [...], entries [n])"
            )
        if self.global_scale.dim() != self.block_scale.dim():
            raise ValueError(
                f"sparse guidance: global_scale {tuple(self.global_scale.shape)} must have one "
                f"entry per dim of block_scale {tuple(self.block_scale.shape)}"
            )
        dtypes = (self.block_scale.dtype, self.global_scale.dtype)
        if dtypes != (torch.float8_e4m3fn, torch.float32):
            raise TypeError(f"sparse guidance scales must be float8_e4m3fn, float32; got {dtypes}")
        K = self.shape[-1]
        want = (_index_dtype(K), _index_dtype(2 * K - 1))
        if (self.counts.dtype, self.entries.dtype) != want:
            raise TypeError(
                f"sparse guidance of rows of {K}: counts and entries must be {want}, got "
                f"{(self.counts.dtype, self.entries.dtype)}"
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.block_scale.shape[:-1], self.block_scale.shape[-1] * BLOCK_SIZE))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.counts, self.entries, self.block_scale, self.global_scale

    def check(self) -> None:
        """Raise ValueError unless the counts and entries describe the record's rows: as many
        entries as the counts say, each column inside the row (reads the values: one sync)."""
        total = int(self.counts.sum(dtype=torch.int64))
        if total != self.entries.shape[0]:
            raise ValueError(
                f"sparse guidance counts sum to {total} but it holds {self.entries.shape[0]} "
                "entries"
            )
        K = self.shape[-1]
        column = self.entries.long() >> 1
        if total and not bool(((column >= 0) & (column < K)).all()):
            raise ValueError(f"sparse guidance has a column outside [0, {K})")

    def rows(self, start: int, end: int) -> SparseCodes:
        """Rows ``[start, end)`` along the first dim (each with its recorded values)."""
        per_row = self.counts[start:end]
        before = self.counts[:start].sum(dtype=torch.int64)
        first, num = torch.stack((before, per_row.sum(dtype=torch.int64))).tolist()  # one sync
        return SparseCodes(
            counts=per_row,
            entries=self.entries[first : first + num],
            block_scale=self.block_scale[start:end],
            global_scale=self.global_scale[start:end],
        )

    def select_rows(self, index: torch.Tensor) -> SparseCodes:
        """Rows ``index`` (long ``[R]``) of the record with its leading dims flattened."""
        self.check()
        counts = self.counts.flatten().long()
        starts = counts.cumsum(0) - counts
        picked = counts[index]
        num = int(picked.sum())
        row = torch.repeat_interleave(torch.arange(len(index), device=index.device), picked)
        offset = torch.arange(num, device=index.device) - (picked.cumsum(0) - picked)[row]
        return SparseCodes(
            counts=self.counts.flatten()[index],
            entries=self.entries[starts[index][row] + offset],
            block_scale=self.block_scale.reshape(-1, self.block_scale.shape[-1])[index],
            global_scale=self.global_scale.reshape(-1, self.global_scale.shape[-1])[index],
        )

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(recorded, bit)``: bool and uint8 ``[..., K]``, the bit 0 where nothing is recorded."""
        self.check()
        K = self.shape[-1]
        counts = self.counts.flatten().long()
        entries = self.entries.long()
        column = entries >> 1
        row = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
        recorded = torch.zeros(len(counts), K, dtype=torch.bool, device=counts.device)
        bit = torch.zeros(len(counts), K, dtype=torch.uint8, device=counts.device)
        recorded[row, column] = True
        bit[row, column] = (entries & 1).to(torch.uint8)
        return recorded.view(self.shape), bit.view(self.shape)


def sparse(x: torch.Tensor, t: NVFP4Tensor, delta: float) -> SparseCodes:
    """Sparse guidance from the rollout's values ``x [..., K]`` and their quantization ``t``:
    the values within ``delta`` grid units of a rounding boundary under ``t``'s scales
    (`boundary_distance`), with the mantissa bit of the code ``t`` gave each."""
    check_input(x)
    if t.shape != x.shape:
        raise ValueError(f"codes of shape {tuple(t.shape)} for values {tuple(x.shape)}")
    if not isinstance(delta, int | float) or isinstance(delta, bool) or not 0 <= delta <= 0.5:
        raise ValueError(f"sparse guidance delta must be in [0, 0.5] grid units, got {delta!r}")
    y, live = scaled_values(x.unflatten(-1, (-1, BLOCK_SIZE)), t.block_scale, t.global_scale)
    near = ((boundary_distance(y) <= delta) & live.unsqueeze(-1)).flatten(-2)
    K = x.shape[-1]
    near_RK = near.reshape(-1, K)
    row, column = near_RK.nonzero(as_tuple=True)  # row-major: rows in order, columns increasing
    bit = (unpack_e2m1(t.codes).reshape(-1, K)[row, column] & MANTISSA_BIT).long()
    return SparseCodes(
        counts=near.sum(-1).to(_index_dtype(K)),
        entries=(column << 1 | bit).to(_index_dtype(2 * K - 1)),
        block_scale=t.block_scale,
        global_scale=t.global_scale,
    )


def round_guided_sparse(x: torch.Tensor, guidance: SparseCodes) -> NVFP4Tensor:
    """Quantize ``x`` with the rollout's scales: at the recorded values the neighbour with the
    rollout's mantissa bit (as compact guidance), elsewhere the nearest codeword."""
    if guidance.shape != x.shape:
        raise ValueError(f"sparse guidance of shape {tuple(guidance.shape)} for x {tuple(x.shape)}")
    recorded, bit = (t.unflatten(-1, (-1, BLOCK_SIZE)) for t in guidance.expand())

    def choose(lo, hi, sign, y):
        followed = torch.where((lo & MANTISSA_BIT) == bit, lo, hi)
        return torch.where(recorded, followed, e2m1_rne(y) & MAGNITUDE_MASK)

    return _guided(x, guidance.block_scale, guidance.global_scale, choose)
