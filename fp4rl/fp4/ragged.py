"""Ragged bit records and their byte code, the machinery under sparse guidance
(`fp4rl.fp4.sparse_guidance`).

A ragged record: ``counts [R]`` entries per row and ``entries [n]`` = ``index << 1 | bit``,
rows in order and indices increasing within a row, indices below ``width``. Its wire form
(`pack_parts`, `unpack_parts`) writes each entry as ``gap << 1 | bit``, ``gap`` the unrecorded
positions since the previous entry over the rows laid end to end, 7 bits a byte (`encode_varint`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

VARINT_MAX_BYTES = 5  # positions (index << 1 | bit) below 2**35 in the wire form


def index_dtype(limit: int) -> torch.dtype:
    """The narrowest integer dtype holding 0..limit."""
    for dtype, top in ((torch.uint8, 255), (torch.int16, 2**15 - 1), (torch.int32, 2**31 - 1)):
        if limit <= top:
            return dtype
    raise ValueError(f"sparse guidance needs rows of fewer than 2**30 values, got {limit}")


def from_mask(near_RW: torch.Tensor, bit_RW: torch.Tensor):
    """The record of ``[R, W]`` rows holding, where ``near_RW`` is set, the low bit of
    ``bit_RW``: ``(counts [R], entries)`` in the narrowest dtypes."""
    width = near_RW.shape[-1]
    row, index = near_RW.nonzero(as_tuple=True)  # row-major: rows in order, indices increasing
    bits = bit_RW[row, index].long() & 1
    counts = near_RW.sum(-1).to(index_dtype(width))
    return counts, (index << 1 | bits).to(index_dtype(2 * width - 1))


def check(counts: torch.Tensor, entries: torch.Tensor, width: int, what: str) -> None:
    """ValueError unless the counts add up to the entries and every index lies in the row."""
    total = int(counts.sum(dtype=torch.int64))
    if total != entries.shape[0]:
        raise ValueError(
            f"sparse guidance {what} counts sum to {total} but it holds {entries.shape[0]} entries"
        )
    index = entries.long() >> 1
    if total and not bool(((index >= 0) & (index < width)).all()):
        raise ValueError(f"sparse guidance has a {what} index outside [0, {width})")


def select(counts: torch.Tensor, entries: torch.Tensor, index: torch.Tensor):
    """The record of rows ``index`` (of the rows flattened), in that order."""
    counts_R = counts.flatten().long()
    starts = counts_R.cumsum(0) - counts_R
    picked = counts_R[index]
    num = int(picked.sum())
    row = torch.repeat_interleave(torch.arange(len(index), device=index.device), picked)
    offset = torch.arange(num, device=index.device) - (picked.cumsum(0) - picked)[row]
    return counts.flatten()[index], entries[starts[index][row] + offset]


def expand(counts: torch.Tensor, entries: torch.Tensor, width: int):
    """``(recorded, bit)``: bool and uint8 ``[*counts.shape, width]``, bit 0 where unrecorded."""
    counts_R = counts.flatten().long()
    entries = entries.long()
    row = torch.repeat_interleave(torch.arange(len(counts_R), device=counts.device), counts_R)
    recorded = torch.zeros(len(counts_R), width, dtype=torch.bool, device=counts.device)
    bit = torch.zeros(len(counts_R), width, dtype=torch.uint8, device=counts.device)
    recorded[row, entries >> 1] = True
    bit[row, entries >> 1] = (entries & 1).to(torch.uint8)
    return recorded.view(*counts.shape, width), bit.view(*counts.shape, width)


def encode_varint(codes: torch.Tensor) -> torch.Tensor:
    """Non-negative int64 codes ``[n]`` -> uint8 ``[L]``: 7 bits per byte, low bits first, the
    top bit set on every byte of a code but its last."""
    return encode_varint_lengths(codes)[0]


def encode_varint_lengths(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream and each code's length in bytes."""
    if codes.numel() == 0:
        empty = torch.zeros(0, dtype=torch.uint8, device=codes.device)
        return empty, torch.zeros(0, dtype=torch.long, device=codes.device)
    codes = codes.long()
    j = torch.arange(VARINT_MAX_BYTES, device=codes.device)
    length = 1 + (codes.unsqueeze(-1) >= (1 << (7 * j[1:]))).sum(-1)
    top = int(codes.max())  # one sync (an engine step syncs for the positions anyway)
    if int(codes.min()) < 0 or top >= 1 << (7 * VARINT_MAX_BYTES):
        raise ValueError(f"sparse guidance positions must lie in [0, 2**35), got up to {top}")
    groups = (codes.unsqueeze(-1) >> (7 * j)) & 0x7F
    more = j < (length.unsqueeze(-1) - 1)
    stream = (groups | (more.long() << 7))[j < length.unsqueeze(-1)].to(torch.uint8)
    return stream, length


def decode_varint(stream: torch.Tensor) -> torch.Tensor:
    """Inverse of `encode_varint`; ValueError for a stream cut inside a code or a code longer
    than ``VARINT_MAX_BYTES``."""
    if stream.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=stream.device)
    last = (stream & 0x80) == 0
    if not bool(last[-1]):
        raise ValueError("packed sparse guidance ends inside a position")
    entry = last.long().cumsum(0) - last.long()
    ends = last.nonzero().squeeze(-1)
    starts = torch.cat((ends.new_zeros(1), ends[:-1] + 1))
    place = torch.arange(len(stream), device=stream.device) - starts[entry]
    if int(place.max()) >= VARINT_MAX_BYTES:
        raise ValueError(f"packed sparse guidance has a position longer than {VARINT_MAX_BYTES} B")
    parts = (stream & 0x7F).long() << (7 * place)
    return torch.zeros(len(ends), dtype=torch.long, device=stream.device).index_add_(
        0, entry, parts
    )


def pack_parts(
    counts: torch.Tensor, entries: torch.Tensor, width: int, part_rows: Sequence[int]
) -> list[torch.Tensor]:
    """Byte streams of consecutive parts of ``part_rows[i]`` rows of a ragged record, each
    part's gaps counted from its own first row."""
    device = counts.device
    counts_R = counts.flatten().long()
    row = torch.repeat_interleave(torch.arange(len(counts_R), device=device), counts_R)
    sizes = torch.tensor(part_rows, dtype=torch.long, device=device)
    part_of_row = torch.repeat_interleave(torch.arange(len(part_rows), device=device), sizes)
    part = part_of_row[row]
    entries = entries.long()
    flat = (row - (sizes.cumsum(0) - sizes)[part]) * width + (entries >> 1)
    previous = torch.cat((flat.new_full((1,), -1), flat[:-1]))
    starts = torch.cat((part.new_ones(1, dtype=torch.bool), part[1:] != part[:-1]))[: len(flat)]
    gap = flat - torch.where(starts, -1, previous) - 1
    stream, length = encode_varint_lengths(gap << 1 | (entries & 1))
    per_part = torch.zeros(len(part_rows), dtype=torch.long, device=device)
    per_part.index_add_(0, part, length)
    return list(stream.split(per_part.tolist()))


def unpack_parts(
    streams: Sequence[torch.Tensor], rows: Sequence[int], lead: torch.Size, width: int, what: str
):
    """Counts ``lead`` and entries of records' packed positions, concatenated; each record's
    stream restarts its gaps and covers ``rows[i]`` rows of ``width``."""
    device = streams[0].device
    lengths = torch.tensor([s.numel() for s in streams], device=device)
    stream = torch.cat(list(streams))
    ends = lengths.cumsum(0)[lengths > 0] - 1
    if bool(((stream[ends] & 0x80) != 0).any()):
        raise ValueError("packed sparse guidance ends inside a position")
    codes = decode_varint(stream)
    terminal = (stream & 0x80) == 0
    index = torch.arange(len(streams), device=device)
    per_record = torch.bincount(
        torch.repeat_interleave(index, lengths)[terminal], minlength=len(streams)
    )
    record = torch.repeat_interleave(index, per_record)
    step = (codes >> 1) + 1
    total = step.cumsum(0)
    first = (per_record.cumsum(0) - per_record).clamp(max=max(len(codes) - 1, 0))
    before = (total - step)[first] if len(codes) else total  # before each record's first entry
    local = total - before[record] - 1
    rows_R = torch.tensor(rows, device=device)
    past = local >= rows_R[record] * width
    if bool(past.any()):
        bad = int(record[past][0])
        raise ValueError(
            f"packed sparse guidance has {what} positions past its {rows[bad]} rows of {width}"
        )
    flat = local + (rows_R.cumsum(0) - rows_R)[record] * width
    num_rows = math.prod(lead)
    counts = torch.bincount(flat // width, minlength=num_rows).to(index_dtype(width)).view(lead)
    entries = ((flat % width) << 1 | (codes & 1)).to(index_dtype(2 * width - 1))
    return counts, entries
