"""Sparse guidance: the rollout records only what the trainer could round differently.

The rollout keeps, per site, each row's maximum (from which the global scale follows bitwise
by the recipe), the block scales whose unrounded ratio lies near an E4M3 rounding boundary
(with the side they took), and the values within ``delta`` grid units of an E2M1 rounding
boundary (`boundary_distance`) with their mantissa bits. The trainer derives the rest with the
recipe from its own values and follows the records where they exist (`round_guided_sparse`,
the guided-compact choice of `fp4rl.fp4.rounding`). `SparseCodes` is the form the trainer
reads; `PackedSparse`, positions as gap-coded bytes, the form a completion carries (both
ragged records, `fp4rl.fp4.ragged`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fp4rl.fp4 import ragged
from fp4rl.fp4.format import (
    BLOCK_SIZE,
    E2M1_VALUES,
    E4M3_NAN_BYTE,
    MAGNITUDE_MASK,
    MANTISSA_BIT,
)
from fp4rl.fp4.reference import (
    SUPPORTED_DTYPES,
    block_scale_from_amax,
    block_scale_ratio,
    check_input,
    e2m1_rne,
    e4m3_rne_satfinite,
    global_scale_from_amax,
    row_amax,
    scaled_values,
    unpack_e2m1,
)
from fp4rl.fp4.rounding import e2m1_bracket, round_within_bracket
from fp4rl.fp4.tensor import NVFP4Tensor

# A value recorded within delta E2M1 grid units of a boundary m is one within delta * w / m of it
# in relative terms: 2 delta at 0.25, 0.29 delta at 1.75 and 3.5, 0.4 delta at 1.25, 2.5 and 5.
# A block scale that lands on the other E4M3 value rescales its 16 values by 6-12 %, so blocks
# get a relative window of delta / 2, wider than most values'. Measured on the demo (BF16,
# delta = 0.02): 2/7 left 0.27 % of the trainer's block scales off the rollout's, 1/2 0.12 %,
# 1 0.08 % for half again the blocks' bytes.
SCALE_DELTA_PER_GRID_UNIT = 0.5
E4M3_MAX_BYTE = E4M3_NAN_BYTE - 1  # 448: positive E4M3 bytes 0x00..0x7E are in value order


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


def e4m3_bracket(ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes ``(lo, hi)`` of the E4M3 values just below and above each non-negative FP32
    ``ratio`` (equal when it is an E4M3 value, both 448 beyond it, both NaN for NaN). One of them
    is the recipe's rounding of it (`reference.e4m3_rne_satfinite`); adjacent E4M3 values differ
    in the byte's lowest bit, as adjacent E2M1 magnitudes do in the mantissa bit."""
    nearest = e4m3_rne_satfinite(ratio)
    byte, value = nearest.view(torch.uint8), nearest.float()
    lo = torch.where(value > ratio, byte - 1, byte)
    hi = torch.where((value < ratio) & (byte < E4M3_MAX_BYTE), byte + 1, byte)
    return lo, hi


def scale_boundary_distance(ratio: torch.Tensor) -> torch.Tensor:
    """Relative distance ``|ratio - m| / m`` of each unrounded block scale
    (`reference.block_scale_ratio`) from the E4M3 rounding boundary ``m`` between the two E4M3
    values around it; infinite where there is none (an E4M3 value, beyond 448, NaN)."""
    lo, hi = e4m3_bracket(ratio)
    as_f32 = [t.view(torch.float8_e4m3fn).float() for t in (lo, hi)]
    middle = (as_f32[0] + as_f32[1]) * 0.5  # exact: two 4-bit significands a step apart
    distance = (ratio - middle).abs() / torch.where(lo != hi, middle, 1.0)
    return torch.where(lo != hi, distance, math.inf)


@dataclass(frozen=True, slots=True)
class SparseCodes:
    """Sparse guidance for one site ``[..., K]``, per-row scaled (``scaling="row"``).

    The rollout records, for each row, its maximum ``row_amax`` (a value of the site's dtype:
    2 bytes for BF16), from which the global scale follows bitwise by the recipe
    (`reference.global_scale_from_amax`); the blocks whose unrounded scale lay within
    ``scale_delta`` (relative) of an E4M3 rounding boundary, with the lowest bit of the E4M3
    byte the rollout chose; and the values it computed within ``delta`` grid units of an E2M1
    rounding boundary, with the mantissa bit of its code. The trainer derives the scales from
    its own values by the recipe, taking the rollout's side at the recorded blocks
    (`round_guided_sparse`).

    - ``counts``        ``[...]``       recorded values per row
    - ``entries``       ``[n]``         ``column << 1 | mantissa_bit`` per recorded value: rows in
      order, columns increasing, ``n == counts.sum()``
    - ``block_counts``  ``[...]``       recorded blocks per row
    - ``block_entries`` ``[m]``         ``block << 1 | scale_bit`` per recorded block, likewise
    - ``row_amax``      ``[..., 1]``    the rollout's ``max |x|`` of each row, in the site's dtype
      (`reference.row_amax`: NaN where the row is not finite)
    - ``columns``                       ``K``

    Counts and entries take the narrowest of uint8 / int16 / int32 that holds the row width and
    ``2 * width - 1`` (values: K; blocks: K / 16). This is the form the engine cuts and the
    trainer reads; completions carry `PackedSparse` (`pack`), without the row counts.
    """

    counts: torch.Tensor
    entries: torch.Tensor
    block_counts: torch.Tensor
    block_entries: torch.Tensor
    row_amax: torch.Tensor
    columns: int

    def __post_init__(self) -> None:
        lead = tuple(self.counts.shape)
        if (
            tuple(self.block_counts.shape) != lead
            or tuple(self.row_amax.shape) != (*lead, 1)
            or self.entries.dim() != 1
            or self.block_entries.dim() != 1
        ):
            raise ValueError(
                f"sparse guidance: counts {lead}, block_counts {tuple(self.block_counts.shape)}, "
                f"row_amax {tuple(self.row_amax.shape)}, entries {tuple(self.entries.shape)} and "
                f"block_entries {tuple(self.block_entries.shape)} do not describe rows "
                "(counts [...], block_counts [...], row_amax [..., 1], entries [n], block_entries "
                "[m])"
            )
        K = self.columns
        if not isinstance(K, int) or isinstance(K, bool) or K <= 0 or K % BLOCK_SIZE:
            raise ValueError(
                f"sparse guidance columns must be a positive multiple of 16, got {K!r}"
            )
        if self.row_amax.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"sparse guidance row_amax must be one of {SUPPORTED_DTYPES}, got "
                f"{self.row_amax.dtype}"
            )
        nb = K // BLOCK_SIZE
        for what, width, got in (
            ("counts and entries", K, (self.counts.dtype, self.entries.dtype)),
            ("block counts and entries", nb, (self.block_counts.dtype, self.block_entries.dtype)),
        ):
            want = (ragged.index_dtype(width), ragged.index_dtype(2 * width - 1))
            if got != want:
                raise TypeError(f"sparse guidance of rows of {K}: {what} must be {want}, got {got}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.counts.shape, self.columns))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.counts, self.entries, self.block_counts, self.block_entries, self.row_amax

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> SparseCodes:
        return SparseCodes(
            *(t.to(device, non_blocking=non_blocking) for t in self.tensors()), self.columns
        )

    def global_scale(self) -> torch.Tensor:
        """The rollout's FP32 global scales ``[..., 1]``, by the recipe from its row maxima."""
        return global_scale_from_amax(self.row_amax)

    def check(self) -> None:
        """Raise ValueError unless the counts and entries describe the record's rows: as many
        entries as the counts say, each index inside its row (reads the values: a sync)."""
        ragged.check(self.counts, self.entries, self.columns, "value")
        ragged.check(self.block_counts, self.block_entries, self.columns // BLOCK_SIZE, "block")

    def rows(self, start: int, end: int) -> SparseCodes:
        """Rows ``[start, end)`` along the first dim (each with its recorded values)."""
        counts = (self.counts[:start], self.counts[start:end])
        blocks = (self.block_counts[:start], self.block_counts[start:end])
        sums = [c.sum(dtype=torch.int64) for c in (*counts, *blocks)]
        first, num, block_first, block_num = torch.stack(sums).tolist()  # one sync
        return SparseCodes(
            counts=counts[1],
            entries=self.entries[first : first + num],
            block_counts=blocks[1],
            block_entries=self.block_entries[block_first : block_first + block_num],
            row_amax=self.row_amax[start:end],
            columns=self.columns,
        )

    def select_rows(self, index: torch.Tensor) -> SparseCodes:
        """Rows ``index`` (long ``[R]``) of the record with its leading dims flattened."""
        self.check()
        counts, entries = ragged.select(self.counts, self.entries, index)
        block_counts, block_entries = ragged.select(self.block_counts, self.block_entries, index)
        return SparseCodes(
            counts=counts,
            entries=entries,
            block_counts=block_counts,
            block_entries=block_entries,
            row_amax=self.row_amax.reshape(-1, 1)[index],
            columns=self.columns,
        )

    @staticmethod
    def cat(records: Sequence[SparseCodes]) -> SparseCodes:
        """Records of rows of one width concatenated along the first dim."""
        widths = {r.columns for r in records}
        if len(widths) != 1:
            raise ValueError(f"cannot concatenate sparse guidance of rows of {sorted(widths)}")
        members = zip(*(r.tensors() for r in records), strict=True)
        return SparseCodes(*(torch.cat(m) for m in members), widths.pop())

    def expand(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(recorded, bit)``: bool and uint8 ``[..., K]``, the bit 0 where nothing is recorded."""
        self.check()
        return ragged.expand(self.counts, self.entries, self.columns)

    def expand_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(recorded, bit)`` of the blocks, bool and uint8 ``[..., K / 16]``."""
        self.check()
        return ragged.expand(self.block_counts, self.block_entries, self.columns // BLOCK_SIZE)

    def pack(self) -> PackedSparse:
        """The wire form: the positions as gaps in a byte code, without the row counts."""
        return self.pack_rows([[(0, self.counts.shape[0])]])[0]

    def pack_rows(self, parts: Sequence[Sequence[tuple[int, int]]]) -> list[PackedSparse]:
        """For each part, its ``[start, end)`` spans of rows along the first dim, in order,
        packed as one record: every part in one pass (an engine's sequences, cut from its
        steps' records)."""
        K, lead = self.columns, self.counts.shape
        tokens = [i for spans in parts for a, b in spans for i in range(a, b)]
        per_part = [sum(b - a for a, b in spans) for spans in parts]
        token = torch.tensor(tokens, dtype=torch.long, device=self.counts.device)
        sub = math.prod(lead[1:])  # rows per index of the first dim
        rows = (token.unsqueeze(-1) * sub + torch.arange(sub, device=token.device)).flatten()
        picked = self.select_rows(rows)
        part_rows = [n * sub for n in per_part]
        values = ragged.pack_parts(picked.counts, picked.entries, K, part_rows)
        blocks = ragged.pack_parts(
            picked.block_counts, picked.block_entries, K // BLOCK_SIZE, part_rows
        )
        row_amax = self.row_amax[token].split(per_part)
        return [PackedSparse(a, v, b, K) for a, v, b in zip(row_amax, values, blocks, strict=True)]


@dataclass(frozen=True, slots=True)
class PackedSparse:
    """`SparseCodes` as a completion carries it from the rollout to the trainer.

    - ``row_amax`` ``[T, ..., 1]`` as in `SparseCodes`
    - ``values``   uint8 ``[Lv]``: for each recorded value, in row-major order, the code
      ``gap << 1 | mantissa_bit``, where ``gap`` counts the unrecorded values since the previous
      recorded one (over the rows laid end to end), written 7 bits per byte, low bits first, the
      top bit set on every byte but an entry's last
    - ``blocks``   uint8 ``[Lb]``: the recorded blocks likewise (``gap << 1 | scale_bit``)
    - ``columns``  ``K``

    A recorded position costs one byte while fewer than 64 positions separate it from the
    previous one, and no row pays for a count. `unpack` restores the `SparseCodes` bitwise.
    """

    row_amax: torch.Tensor
    values: torch.Tensor
    blocks: torch.Tensor
    columns: int

    def __post_init__(self) -> None:
        if self.values.dtype != torch.uint8 or self.blocks.dtype != torch.uint8:
            raise TypeError(
                "packed sparse guidance streams must be uint8, got "
                f"{self.values.dtype} and {self.blocks.dtype}"
            )
        if self.values.dim() != 1 or self.blocks.dim() != 1 or self.row_amax.shape[-1:] != (1,):
            raise ValueError(
                f"packed sparse guidance: values {tuple(self.values.shape)} and blocks "
                f"{tuple(self.blocks.shape)} must be 1-D and row_amax "
                f"{tuple(self.row_amax.shape)} [..., 1]"
            )

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.row_amax.shape[:-1], self.columns))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.row_amax, self.values, self.blocks

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> PackedSparse:
        return PackedSparse(
            *(t.to(device, non_blocking=non_blocking) for t in self.tensors()), self.columns
        )

    def unpack(self) -> SparseCodes:
        """The `SparseCodes` this was packed from; ValueError for a stream that does not
        describe positions inside the rows."""
        return PackedSparse.unpack_cat([self])

    @staticmethod
    def unpack_cat(records: Sequence[PackedSparse]) -> SparseCodes:
        """The records unpacked and concatenated along rows, in one pass over all their
        streams (a batch's completions: a few tensor ops, not a few per record)."""
        widths = {r.columns for r in records}
        if len(widths) != 1:
            raise ValueError(f"cannot concatenate sparse guidance of rows of {sorted(widths)}")
        K = widths.pop()
        row_amax = torch.cat([r.row_amax for r in records])
        lead = row_amax.shape[:-1]
        rows = [r.row_amax.shape[:-1].numel() for r in records]
        counts, entries = ragged.unpack_parts([r.values for r in records], rows, lead, K, "value")
        block_counts, block_entries = ragged.unpack_parts(
            [r.blocks for r in records], rows, lead, K // BLOCK_SIZE, "block"
        )
        return SparseCodes(counts, entries, block_counts, block_entries, row_amax, K)


def _check_fraction(name: str, value, top: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= top:
        raise ValueError(f"sparse guidance {name} must be in [0, {top}], got {value!r}")


def sparse(
    x: torch.Tensor, t: NVFP4Tensor, delta: float, scale_delta: float | None = None
) -> SparseCodes:
    """Sparse guidance from the rollout's values ``x [..., K]`` and their row-scaled
    quantization ``t``: the row maxima; the blocks whose unrounded scale lies within
    ``scale_delta`` (relative; ``delta * SCALE_DELTA_PER_GRID_UNIT`` by default) of an E4M3
    rounding boundary (`scale_boundary_distance`), with the lowest bit of their E4M3 byte; and
    the values within ``delta`` grid units of an E2M1 rounding boundary under ``t``'s scales
    (`boundary_distance`), with the mantissa bit of the code ``t`` gave each."""
    check_input(x)
    if t.shape != x.shape:
        raise ValueError(f"codes of shape {tuple(t.shape)} for values {tuple(x.shape)}")
    _check_fraction("delta", delta, 0.5)
    if scale_delta is None:
        scale_delta = delta * SCALE_DELTA_PER_GRID_UNIT
    _check_fraction("scale_delta", scale_delta, 1.0)
    K = x.shape[-1]
    lead = x.shape[:-1]
    if tuple(t.global_scale.shape) != (*lead, 1):
        raise ValueError(
            f"sparse guidance needs one global scale per row (scaling='row'), got "
            f"{tuple(t.global_scale.shape)} for values {tuple(x.shape)}"
        )
    # A value of x's dtype, exact; the canonical NaN for a row that is not finite, as KV pages
    # keep it (an infinite row's maximum would be inf: the same NaN global scale either way).
    amax = row_amax(x)
    derived = global_scale_from_amax(amax)
    if not torch.equal(derived.view(torch.int32), t.global_scale.view(torch.int32)):
        raise ValueError(
            "sparse guidance derives each row's global scale from its maximum, but these codes "
            "were quantized with other global scales"
        )
    x_blocks = x.unflatten(-1, (-1, BLOCK_SIZE))
    ratio = block_scale_ratio(x_blocks.float().abs().amax(-1), t.global_scale)
    near_blocks = scale_boundary_distance(ratio) <= scale_delta
    nb = K // BLOCK_SIZE
    block_counts, block_entries = ragged.from_mask(
        near_blocks.reshape(-1, nb), t.block_scale.view(torch.uint8).reshape(-1, nb)
    )
    y, live = scaled_values(x_blocks, t.block_scale, t.global_scale)
    near = ((boundary_distance(y) <= delta) & live.unsqueeze(-1)).flatten(-2)
    counts, entries = ragged.from_mask(near.reshape(-1, K), unpack_e2m1(t.codes).reshape(-1, K))
    return SparseCodes(
        counts=counts.view(lead),
        entries=entries,
        block_counts=block_counts.view(lead),
        block_entries=block_entries,
        row_amax=amax,
        columns=K,
    )


def sparse_block_scales(x: torch.Tensor, guidance: SparseCodes) -> torch.Tensor:
    """The block scales the trainer uses for ``x [..., K]``: the recipe's
    (`reference.block_scale_from_amax`) from its own block maxima and the rollout's global
    scales, except at the recorded blocks, where the member of the E4M3 bracket around its own
    unrounded scale whose lowest bit is the rollout's."""
    s = guidance.global_scale()
    block_amax = x.unflatten(-1, (-1, BLOCK_SIZE)).float().abs().amax(-1)
    ratio = block_scale_ratio(block_amax, s)
    nearest = block_scale_from_amax(block_amax, s)
    recorded, bit = guidance.expand_blocks()
    lo, hi = e4m3_bracket(ratio)
    followed = torch.where((lo & 1) == bit, lo, hi)
    byte = torch.where(recorded, followed, nearest.view(torch.uint8))
    return byte.view(torch.float8_e4m3fn)


def round_guided_sparse(x: torch.Tensor, guidance: SparseCodes) -> NVFP4Tensor:
    """Quantize ``x`` with the rollout's global scales (from its row maxima) and block scales
    derived from ``x`` (`sparse_block_scales`): at the recorded values the neighbour with the
    rollout's mantissa bit (as compact guidance), elsewhere the nearest codeword."""
    if guidance.shape != x.shape:
        raise ValueError(f"sparse guidance of shape {tuple(guidance.shape)} for x {tuple(x.shape)}")
    recorded, bit = (t.unflatten(-1, (-1, BLOCK_SIZE)) for t in guidance.expand())

    def choose(lo, hi, sign, y):
        followed = torch.where((lo & MANTISSA_BIT) == bit, lo, hi)
        return torch.where(recorded, followed, e2m1_rne(y) & MAGNITUDE_MASK)

    block_scale = sparse_block_scales(x, guidance)
    return round_within_bracket(x, block_scale, guidance.global_scale(), choose)
