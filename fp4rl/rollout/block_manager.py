"""Paged KV block allocation with reference counts.

The KV cache is cut into ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns a
*block table*: the list of block ids holding its positions ``0, 1, ...`` in order (position
``p`` lives in slot ``p % block_size`` of block ``table[p // block_size]``).

Sharing: the ``n`` samples of one prompt share the prompt's *complete* blocks (refcount > 1);
each sample gets its own copy of the partial last block, so a block that is still being written
is never shared and no copy-on-write check is needed on the decode path. A block returns to the
free list when its last owner frees it.

This module only counts; it never touches KV data. The caller copies the partial block's
contents (`KVCache.copy_blocks`) for the ``(src, dst)`` pairs that `fork` returns.

A table is a `BlockTable`: a list that only grows or empties, with an int64 array of the same
blocks kept beside it, so that a graphed decode step copies each table into its input rows
instead of converting its Python ints every step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np


class BlockTable(list):
    """A sequence's block ids in position order: a list that only grows (`extend`, `append`) or
    empties (`clear`), whose blocks are also held as int64 (`array`), written once each.

    Restaging every table's Python ints took about 1 ms a step for 256 sequences of 128 blocks
    (2k tokens); the arrays are copied instead. Mutations that would rewrite blocks in place
    raise TypeError: no caller makes them, and the array would no longer match."""

    __slots__ = ("_array",)

    def __init__(self, blocks: Iterable[int] = ()) -> None:
        super().__init__()
        self._array = np.empty(16, dtype=np.int64)
        self.extend(blocks)

    def extend(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        n = len(self)
        super().extend(blocks)
        if len(self) > len(self._array):
            grown = np.empty(2 * len(self), dtype=np.int64)
            grown[:n] = self._array[:n]
            self._array = grown
        self._array[n : len(self)] = blocks

    def append(self, block: int) -> None:
        self.extend((block,))

    def array(self) -> np.ndarray:
        """The blocks as int64, a view valid until the table next changes."""
        return self._array[: len(self)]

    def __reduce__(self):  # copies and pickles rebuild the array through __init__
        return (BlockTable, (list(self),))

    def _rewrites(self, *args, **kwargs):
        raise TypeError("a BlockTable only grows (extend, append) or empties (clear)")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _rewrites
    insert = pop = remove = sort = reverse = _rewrites


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self._refcount = [0] * num_blocks
        # FIFO reuse: a deterministic allocation order makes runs (and failures) reproducible.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def allocate(self, num_blocks: int) -> BlockTable:
        if num_blocks > len(self._free):
            raise RuntimeError(
                f"KV cache exhausted: {num_blocks} blocks asked, {len(self._free)} free of "
                f"{self.num_blocks}"
            )
        blocks = BlockTable(self._free.popleft() for _ in range(num_blocks))
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend ``table`` in place so it holds ``num_tokens`` positions."""
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > 0:
            table.extend(self.allocate(missing))

    def fork_cost(self, num_tokens: int) -> int:
        """Free blocks one `fork` of a ``num_tokens`` sequence takes (its partial last block)."""
        return 1 if num_tokens % self.block_size else 0

    def fork(self, table: list[int], num_tokens: int) -> tuple[BlockTable, tuple[int, int] | None]:
        """A new table sharing ``table``'s complete blocks for a ``num_tokens`` prefix.

        Returns the new table and, when the prefix ends inside a block, the ``(src, dst)``
        block pair whose KV the caller must copy.
        """
        num_full = num_tokens // self.block_size
        if self.blocks_for(num_tokens) > len(table):
            raise ValueError(f"table of {len(table)} blocks cannot hold {num_tokens} tokens")
        shared = table[:num_full]
        for b in shared:
            self._refcount[b] += 1
        if num_tokens % self.block_size == 0:
            return BlockTable(shared), None
        (own,) = self.allocate(1)
        return BlockTable([*shared, own]), (table[num_full], own)

    def free(self, table: list[int]) -> None:
        """Drop one reference to each block of ``table`` (then clear it)."""
        for b in table:
            if self._refcount[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than it was allocated")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)
        table.clear()
