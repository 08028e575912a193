"""Block allocation: refcounted sharing of complete prompt blocks, frees, exhaustion."""

import copy as copying
import pickle

import numpy as np
import pytest

from fp4rl.rollout.block_manager import BlockManager, BlockTable


def test_allocate_grow_free_roundtrip():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = bm.allocate(bm.blocks_for(5))  # 5 tokens -> 2 blocks
    assert len(table) == 2 and bm.num_free_blocks == 6
    bm.grow(table, 8)  # still fits in 2 blocks
    assert len(table) == 2
    bm.grow(table, 9)
    assert len(table) == 3 and bm.num_free_blocks == 5
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 8
    assert all(bm.refcount(b) == 0 for b in range(8))


def test_fork_shares_complete_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=16, block_size=4)
    leader = bm.allocate(bm.blocks_for(10))  # blocks 0,1 full; block 2 holds 2 tokens
    forks = [bm.fork(leader, 10) for _ in range(3)]
    for table, copy in forks:
        assert table[:2] == leader[:2]
        assert table[2] != leader[2]
        assert copy == (leader[2], table[2])
    assert [bm.refcount(b) for b in leader] == [4, 4, 1]
    assert bm.num_free_blocks == 16 - 3 - 3
    # Freeing the leader keeps the shared blocks alive for the forks.
    bm.free(leader)
    assert bm.refcount(forks[0][0][0]) == 3
    for table, _ in forks:
        bm.free(table)
    assert bm.num_free_blocks == 16


def test_fork_at_a_block_boundary_copies_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    leader = bm.allocate(2)
    table, copy = bm.fork(leader, 8)
    assert table == leader and copy is None and bm.fork_cost(8) == 0
    assert bm.num_free_blocks == 2


def test_exhaustion_raises_and_double_free_is_caught():
    bm = BlockManager(num_blocks=2, block_size=4)
    table = bm.allocate(2)
    with pytest.raises(RuntimeError, match="exhausted: 1 blocks asked, 0 free"):
        bm.allocate(1)
    alias = list(table)
    bm.free(table)
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(alias)


def test_block_tables_keep_their_int64_copy_through_growth_forks_and_frees():
    bm = BlockManager(num_blocks=64, block_size=4)
    table = bm.allocate(3)
    assert isinstance(table, BlockTable) and table.array().dtype == np.int64
    for tokens in range(13, 200, 7):  # past the copy's first capacity (16 blocks), twice
        bm.grow(table, tokens)
        assert table.array().tolist() == list(table), tokens
    forked, _ = bm.fork(table, 30)
    assert isinstance(forked, BlockTable) and forked.array().tolist() == list(forked)
    bm.free(table)
    assert table == [] and table.array().tolist() == []
    table.extend(bm.allocate(2))
    assert table.array().tolist() == list(table) and len(table) == 2


def test_block_tables_copy_and_pickle_with_their_array():
    table = BlockTable(range(40))
    for twin in (copying.copy(table), copying.deepcopy(table), pickle.loads(pickle.dumps(table))):
        assert isinstance(twin, BlockTable) and twin == table
        twin.append(99)
        assert twin.array().tolist() == [*range(40), 99] and len(table) == 40


@pytest.mark.parametrize(
    "rewrite",
    [
        lambda t: t.__setitem__(0, 5),
        lambda t: t.__delitem__(0),
        lambda t: t.insert(0, 5),
        lambda t: t.pop(),
        lambda t: t.remove(t[0]),
        lambda t: t.sort(),
        lambda t: t.reverse(),
        lambda t: t.__iadd__([5]),
    ],
)
def test_block_tables_refuse_rewrites_their_copy_would_miss(rewrite):
    table = BlockTable([3, 1, 2])
    with pytest.raises(TypeError, match="only grows"):
        rewrite(table)
    assert table == [3, 1, 2] and table.array().tolist() == [3, 1, 2]
