"""A step's token-major records as rows of bytes, one per token (`RowLayout`): how the engine
moves a step's routing and full or compact guidance off the GPU as one buffer into the host
memory it keeps for a call's rows (`HostRows`), and cuts each sequence's records out of the rows
of a call (`fp4rl.rollout.capture`). The records themselves, and what crosses to the trainer,
are `fp4rl.records`'.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fp4rl.fp4 import CompactCodes, NVFP4Tensor
from fp4rl.records import RowPlan, RowRecords, SiteRecord, record_like, record_members

ALIGN_BYTES = 16  # every piece of a buffer of rows starts at a multiple of any element size

# The token-major record kinds `RowLayout` lays out: every member has one row per token.
_ROW_KINDS = (torch.Tensor, NVFP4Tensor, CompactCodes)


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Where each member of some token-major items (tensors and records, each under a key) lies
    in one row of bytes: ``members[i]`` holds ``(offset, dtype, shape)`` per member of item
    ``i``, its bytes of one token at ``offset`` (16-aligned) of a ``row_bytes`` row, ``shape``
    the member's shape without its leading token dim. A step's items pack into one uint8 buffer
    of ``[tokens, row_bytes]`` (`pack`), so that any prefix of its rows is the records of those
    tokens and one copy moves them; the layout does not depend on the number of tokens, only
    on the keys, kinds, dtypes and per-token shapes, and is made once for each (`of`)."""

    keys: tuple
    kinds: tuple[type, ...]  # torch.Tensor or the record's class, per item
    members: tuple[tuple[tuple[int, torch.dtype, tuple[int, ...]], ...], ...]
    row_bytes: int

    @staticmethod
    def of(keys: Sequence, items: Sequence[torch.Tensor | SiteRecord]) -> RowLayout:
        """The layout of ``items`` (the same for any number of tokens): computed on its first
        use, then cached. Raises ValueError naming the key of an item that is not token-major."""
        signature = []
        for key, item in zip(keys, items, strict=True):
            if not isinstance(item, _ROW_KINDS):
                raise ValueError(f"{key!r}: a {type(item).__name__} has no fixed bytes per token")
            kind = torch.Tensor if isinstance(item, torch.Tensor) else type(item)
            signature.append((key, kind, tuple((m.dtype, m.shape[1:]) for m in _tensors(item))))
        return _row_layout(tuple(signature))

    def pack(self, items: Sequence[torch.Tensor | SiteRecord]) -> torch.Tensor:
        """uint8 ``[tokens, row_bytes]`` on the items' device: their bytes, token by token, by
        one concatenation (the bytes that align each member are junk, and never read). Raises
        ValueError naming the key of an item that does not fit the layout."""
        if len(items) != len(self.keys) or not items:
            raise ValueError(f"{len(items)} items for a layout of keys {self.keys}")
        flat = [
            (key, m) for key, item in zip(self.keys, items, strict=True) for m in _tensors(item)
        ]
        rows = flat[0][1].shape[0]
        pad = torch.empty(rows, ALIGN_BYTES, dtype=torch.uint8, device=flat[0][1].device)
        pieces, end = [], 0
        for (key, m), (offset, dtype, shape) in zip(flat, _flat(self.members), strict=True):
            if (m.shape[0], m.shape[1:], m.dtype) != (rows, shape, dtype):
                raise ValueError(
                    f"{key!r}: a member of {m.dtype} {tuple(m.shape)} in a layout of {dtype} "
                    f"{(rows, *shape)}"
                )
            if offset > end:
                pieces.append(pad[:, : offset - end])
            piece = m.reshape(rows, math.prod(shape)).view(torch.uint8)
            pieces.append(piece)
            end = offset + piece.shape[1]
        if self.row_bytes > end:
            pieces.append(pad[:, : self.row_bytes - end])
        return torch.cat(pieces, dim=1)

    def column(self, rows: torch.Tensor, item: int, member: int) -> torch.Tensor:
        """The bytes of one member in packed ``rows``: a uint8 ``[tokens, nbytes]`` view."""
        offset, dtype, shape = self.members[item][member]
        return rows[:, offset : offset + math.prod(shape) * dtype.itemsize]

    def plan(self, keys=None) -> RowPlan:
        """Where the items of ``keys`` (all by default; in layout order) lie: the 16-aligned
        stretch of a row that holds them all, and each member's offset in it. Made once per
        layout and keys."""
        return _row_plan(self, None if keys is None else frozenset(keys))

    def gather(self, rows: torch.Tensor, indices: Sequence[torch.Tensor], keys=None) -> list:
        """For each index tensor, its rows of packed ``rows`` as `fp4rl.records.RowRecords`
        of ``keys`` (all by default): nothing is copied until a record is read, which gathers
        that index's stretch of the rows into memory of its own (one gather, the members views
        of it). ``rows`` must not be written while the results live."""
        plan = self.plan(keys)
        return [RowRecords(rows, index, plan) for index in indices]

    def unpack(self, rows: torch.Tensor) -> dict:
        """Key -> item as views of packed ``rows`` (no copy)."""
        plan = self.plan()
        return {key: plan.item(rows, i) for i, key in enumerate(plan.keys)}


def _tensors(item: torch.Tensor | SiteRecord) -> tuple[torch.Tensor, ...]:
    return (item,) if isinstance(item, torch.Tensor) else record_members(item)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def _flat(members):
    return [m for item in members for m in item]


@functools.lru_cache(maxsize=256)
def _row_plan(layout: RowLayout, keys: frozenset | None) -> RowPlan:
    chosen = [i for i, key in enumerate(layout.keys) if keys is None or key in keys]
    if not chosen:
        return RowPlan((), (), (), 0, 0)
    start = layout.members[chosen[0]][0][0]
    # To a 16-byte end (within the row, as its members are): any member's dtype then views a
    # gathered block's rows.
    last = max(
        offset + math.prod(shape) * dt.itemsize
        for i in chosen
        for offset, dt, shape in layout.members[i]
    )
    return RowPlan(
        tuple(layout.keys[i] for i in chosen),
        tuple(layout.kinds[i] for i in chosen),
        tuple(
            tuple((dt, shape, offset - start) for offset, dt, shape in layout.members[i])
            for i in chosen
        ),
        start,
        _aligned(last - start),
    )


@functools.lru_cache(maxsize=256)
def _row_layout(signature: tuple) -> RowLayout:
    keys, kinds, members, offset = [], [], [], 0
    for key, kind, specs in signature:
        placed = []
        for dtype, shape in specs:
            placed.append((offset, dtype, tuple(shape)))
            offset += _aligned(math.prod(shape) * dtype.itemsize)
        keys.append(key)
        kinds.append(kind)
        members.append(tuple(placed))
    return RowLayout(tuple(keys), tuple(kinds), tuple(members), offset)


class HostRows:
    """Host memory that the packed rows of one generate call are copied into, step after step.

    Each step's rows land after the previous step's (`copy_in`), so at the end of the call its
    rows already lie joined, and `take` hands them over to the call's completions, whose
    records read them where they lie (`fp4rl.records.RowRecords`). Copying each step into
    memory of its own and joining the steps at the end cost a fresh pinned allocation per step
    and one more pass over every byte on the host, in fresh pages: at 16 prompts x 4 samples of
    64 tokens on a 4-layer model with compact guidance (one H200), `CaptureLog.assemble` took
    25 ms of host time a call that way and 13 ms this way (while it still cut each sequence's
    records out of the rows).

    The memory is pinned when the rows come from a GPU (their copies are only queued), and is
    chunks of flat bytes, so any row width fits: when a call outgrows its chunks another one is
    added (at least as large as all before it), and the next call starts with one chunk as
    large as all of them. A step never straddles two chunks; the rows it skips at a chunk's
    end are never read. Rows are numbered from the first chunk's first row on, across chunks
    (`copy_in` returns the number of a step's first row)."""

    MIN_CHUNK_BYTES = 64 << 20

    def __init__(self) -> None:
        self._chunks: list[torch.Tensor] = []  # flat uint8
        self._next_bytes = 0  # the size of the next call's first chunk
        self.begin()

    def begin(self) -> None:
        """Start a call: its rows are written from the first chunk's start on."""
        self._row_bytes, self._chunk, self._used = 0, 0, 0
        self._base = 0  # the number of the current chunk's first row

    def copy_in(self, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Copy uint8 ``rows`` ``[n, row_bytes]`` after the call's rows so far: the host view
        they land in and the number of their first row. From a GPU the copy is only queued on the
        current stream (read it after a synchronize). Every step of a call has one row width."""
        n, width = rows.shape
        if self._row_bytes == 0:
            self._row_bytes = width
        elif width != self._row_bytes:
            raise ValueError(f"rows of {width} bytes in a call of {self._row_bytes}-byte rows")
        # On to the first chunk from the current one that fits them, or a new one.
        while self._chunk < len(self._chunks) and self._used + n > self._rows_in(self._chunk):
            self._base += self._rows_in(self._chunk)
            self._chunk, self._used = self._chunk + 1, 0
        if self._chunk == len(self._chunks):
            size = max(
                n * width,
                self.MIN_CHUNK_BYTES,
                self._next_bytes,
                sum(c.numel() for c in self._chunks),
            )
            self._chunks.append(torch.empty(size, dtype=torch.uint8, pin_memory=rows.is_cuda))
        host = self._view(self._chunk)[self._used : self._used + n]
        host.copy_(rows, non_blocking=True)
        first = self._base + self._used
        self._used += n
        return host, first

    def take(self) -> torch.Tensor:
        """Every row of the call so far, ``[rows, row_bytes]`` in row-number order, handed
        over: the caller's from now on (a call's completions read their records out of them),
        so the next call starts in fresh memory, one chunk as large as this call's chunks
        together (from a GPU, torch's pinned-memory cache hands back a chunk of that size once
        the records that held it are gone). A view when the call fitted one chunk, else one
        concatenation. Read it once the copies have landed."""
        if self._row_bytes == 0:
            return torch.empty(0, 0, dtype=torch.uint8)
        last = self._view(self._chunk)[: self._used]
        rows = last
        if self._chunk > 0:
            rows = torch.cat([*(self._view(i) for i in range(self._chunk)), last])
        self._next_bytes = sum(c.numel() for c in self._chunks)
        self._chunks = []
        self.begin()
        return rows

    def release(self) -> None:
        """Hand the memory back (the next call allocates afresh)."""
        self._chunks, self._next_bytes = [], 0
        self.begin()

    def _rows_in(self, chunk: int) -> int:
        return self._chunks[chunk].numel() // self._row_bytes if chunk < len(self._chunks) else 0

    def _view(self, chunk: int) -> torch.Tensor:
        """Chunk ``chunk`` as ``[rows, row_bytes]`` (its few trailing bytes left out)."""
        width = self._row_bytes
        return self._chunks[chunk][: self._rows_in(chunk) * width].view(-1, width)


def to_host_together(items: Sequence[torch.Tensor | SiteRecord]) -> list[torch.Tensor | SiteRecord]:
    """``items`` (tensors and records, all on one device) copied to the CPU through one byte
    buffer: their bytes concatenated on the device (one concatenation, each piece padded to 16
    bytes), one copy to pinned memory queued on the current stream, and each tensor handed back
    as a view of that buffer. A step's records thus cost two operations instead of one per
    tensor. The copy is only queued: read the results after the stream has been synchronized.
    (From the CPU the buffer is a plain one and the copy immediate.)"""
    parts = [[t] if isinstance(t, torch.Tensor) else list(record_members(t)) for t in items]
    flat = [t for tensors in parts for t in tensors]
    if not flat:
        return list(items)
    device = flat[0].device
    pad = torch.empty(ALIGN_BYTES, dtype=torch.uint8, device=device)  # never read
    pieces, offsets, offset = [], [], 0
    for t in flat:
        data = t.contiguous().reshape(-1).view(torch.uint8)
        pieces.append(data)
        offsets.append(offset)
        offset += data.numel()
        if offset % ALIGN_BYTES:
            pieces.append(pad[: ALIGN_BYTES - offset % ALIGN_BYTES])
            offset += ALIGN_BYTES - offset % ALIGN_BYTES
    host = torch.empty(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.copy_(torch.cat(pieces), non_blocking=True)
    views = iter(
        host[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for t, start in zip(flat, offsets, strict=True)
    )
    out = []
    for item, tensors in zip(items, parts, strict=True):
        mine = [next(views) for _ in tensors]
        out.append(mine[0] if isinstance(item, torch.Tensor) else record_like(item, mine))
    return out
