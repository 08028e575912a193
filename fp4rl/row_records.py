"""A completion's guidance where the rollout left it: rows of its generate call's bytes.

A generate call lands every step's records as rows of bytes, one per token, one after another
(`fp4rl.rollout.rows`). Cutting each sequence's records out of them at the end of the call, one
gather per sequence and one view per record member, cost the engine more host time than the
records' own copies: at 48 layers with compact guidance, 64 sequences of 191 tokens hold 18,432
records. So a completion's guidance is `RowRecords`: the call's rows (handed over by the engine,
never written again), the numbers of the sequence's rows in them, and the `RowPlan` that says
where each record's members lie in a row. A record is made when first read (one gather of the
sequence's rows into memory of its own, the members views of it), and `fp4rl.records.collate`
gathers a whole batch's rows at once, straight out of the call's, instead of reading them record
by record.

Legend: T the sequence's fed tokens, W the bytes of a row's stretch the plan covers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class RowPlan:
    """Where each item (a tensor or a record, under its key) lies in a row: ``start`` and
    ``width`` are the byte range of the rows that holds them all (``width`` a multiple of 16),
    ``members[i]`` one ``(dtype, per-row shape, byte offset within that range)`` per tensor of
    item ``i``, ``kinds[i]`` torch.Tensor or the record's class (built from its members in
    order). Offsets are multiples of their dtype's size and ``width`` of every dtype's size, so
    each member is one strided view of a gathered block."""

    keys: tuple
    kinds: tuple[type, ...]
    members: tuple[tuple[tuple[torch.dtype, tuple[int, ...], int], ...], ...]
    start: int
    width: int
    # key -> its item's number: a sequence's records are looked up by key often (the engine
    # marks each guided site of each completion), and a tuple is searched one key at a time
    number: dict = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "number", {key: i for i, key in enumerate(self.keys)})

    def stretch(self, rows: torch.Tensor) -> torch.Tensor:
        """The plan's columns of uint8 ``rows`` ``[n, row_bytes]``."""
        return rows[:, self.start : self.start + self.width]

    def item(self, block: torch.Tensor, i: int, copy: bool = False):
        """Item ``i`` as views of uint8 ``block`` ``[n, >= width]``, whose row ``t`` holds
        token ``t``'s stretch from its first byte on (its bytes contiguous within a row, rows
        16-aligned): each member one `as_strided` of the block viewed as its dtype (a slice
        and two views per member cost about three times the host time, which a call's
        thousands of records add up). ``copy``: each member a contiguous copy of its own."""
        n = block.shape[0]
        members = []
        for dtype, shape, offset in self.members[i]:
            typed = block.view(dtype)
            inner = tuple(math.prod(shape[j + 1 :]) for j in range(len(shape)))
            member = typed.as_strided(
                (n, *shape),
                (typed.stride(0), *inner),
                typed.storage_offset() + offset // dtype.itemsize,
            )
            members.append(member.clone(memory_format=torch.contiguous_format) if copy else member)
        kind = self.kinds[i]
        return members[0] if kind is torch.Tensor else kind(*members)

    def row_nbytes(self) -> int:
        """Bytes of the items' members per row (what `nbytes` of the records would sum)."""
        return sum(math.prod(s) * dt.itemsize for item in self.members for dt, s, _ in item)


class RowRecords(Mapping):
    """Key -> record (or None) for one sequence: the plan's items over rows ``index`` of
    ``rows``, made when first read, then kept; ``others`` holds the items that are not rows
    (sparse records, and None for sites left to nearest rounding).

    ``rows`` are a generate call's, shared by its completions; nothing writes them after the
    call. The first read gathers the sequence's rows into a block of its own (`block`), so a
    record read from here shares memory with the other records of its sequence only. Pickling
    (and `torch.save`) carries the records themselves, as a plain dict of tensors each of its
    own, not the call's rows."""

    __slots__ = ("rows", "index", "plan", "others", "_block", "_made")

    def __init__(
        self,
        rows: torch.Tensor,
        index: torch.Tensor,
        plan: RowPlan,
        others: Mapping | None = None,
    ) -> None:
        self.rows, self.index, self.plan = rows, index, plan
        self.others = dict(others or {})
        self._block: torch.Tensor | None = None
        self._made: dict = {}

    @property
    def num_rows(self) -> int:
        return int(self.index.shape[0])

    def block(self) -> torch.Tensor:
        """uint8 ``[T, width]``: the sequence's rows of the plan's stretch, gathered once."""
        if self._block is None:
            self._block = self.plan.stretch(self.rows).index_select(0, self.index)
        return self._block

    def __getitem__(self, key):
        if key in self.others:
            return self.others[key]
        if key in self._made:
            return self._made[key]
        self._made[key] = item = self.plan.item(self.block(), self.plan.number[key])
        return item

    def __iter__(self) -> Iterator:
        yield from self.plan.keys
        yield from self.others

    def __len__(self) -> int:
        return len(self.plan.keys) + len(self.others)

    def __contains__(self, key) -> bool:
        return key in self.others or key in self.plan.number

    def with_others(self, others: Mapping) -> RowRecords:
        """The same rows with ``others`` added (over any other of the same key). Raises
        ValueError naming a key the rows hold: a record lies in one place only."""
        held = [key for key in others if key in self.plan.number]
        if held:
            raise ValueError(f"the rows already hold the records of {held}")
        return RowRecords(self.rows, self.index, self.plan, {**self.others, **others})

    def row_nbytes(self) -> int:
        """Bytes of the rows' records (members only, as `fp4rl.records.record_nbytes` sums)."""
        return self.num_rows * self.plan.row_nbytes()

    def __reduce__(self):  # each member a tensor of its own, as torch.save needs
        block = self.block()
        rows = {key: self.plan.item(block, i, copy=True) for i, key in enumerate(self.plan.keys)}
        return dict, ({**rows, **self.others},)

    def __repr__(self) -> str:
        return f"RowRecords({self.num_rows} rows, keys={list(self)})"

    @staticmethod
    def gather(parts: Sequence[RowRecords]) -> dict:
        """Key -> item over the rows of all ``parts`` in order (they must share one plan,
        `plan_of`), each member a contiguous tensor of its own: per member, one gather of its
        column straight out of each run of parts that share a call's rows (one pass over the
        bytes, as concatenating records read one by one makes, without reading them)."""
        plan = parts[0].plan
        runs, i = [], 0
        while i < len(parts):
            j = i + 1
            while j < len(parts) and parts[j].rows is parts[i].rows:
                j += 1
            run = parts[i:j]
            runs.append((run[0].rows, torch.cat([p.index for p in run])))
            i = j
        n = sum(int(index.shape[0]) for _, index in runs)
        out = {}
        for key, kind, members in zip(plan.keys, plan.kinds, plan.members, strict=True):
            tensors = []
            for dtype, shape, offset in members:
                nbytes = math.prod(shape) * dtype.itemsize
                column = torch.empty(n, nbytes, dtype=torch.uint8, device=runs[0][0].device)
                at = plan.start + offset
                done = 0
                for rows, index in runs:
                    size = int(index.shape[0])
                    piece = column[done : done + size]
                    torch.index_select(rows[:, at : at + nbytes], 0, index, out=piece)
                    done += size
                tensors.append(column.view(dtype).view(n, *shape))
            out[key] = tensors[0] if kind is torch.Tensor else kind(*tensors)
        return out


def plan_of(guidance: Sequence[Mapping | None]) -> RowPlan | None:
    """The plan all of ``guidance`` hold their rows by, if each is `RowRecords` of one plan."""
    if not guidance or not all(isinstance(g, RowRecords) for g in guidance):
        return None
    plan = guidance[0].plan
    return plan if all(g.plan == plan for g in guidance) else None
