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
"""

from __future__ import annotations

from collections import deque


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

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(
                f"KV cache exhausted: {num_blocks} blocks asked, {len(self._free)} free of "
                f"{self.num_blocks}"
            )
        blocks = [self._free.popleft() for _ in range(num_blocks)]
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

    def fork(self, table: list[int], num_tokens: int) -> tuple[list[int], tuple[int, int] | None]:
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
            return list(shared), None
        (own,) = self.allocate(1)
        return [*shared, own], (table[num_full], own)

    def free(self, table: list[int]) -> None:
        """Drop one reference to each block of ``table`` (then clear it)."""
        for b in table:
            if self._refcount[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than it was allocated")
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)
        table.clear()
