"""The input rows a graphed decode step stages (`graphs.fill_rows`, `graphs.pad_rows`): the same
rows from a `BlockTable`'s int64 copy as from its Python ints, the columns each row holds, and
padding rows as copies of the shortest real row that write only the scratch slot."""

import numpy as np
import pytest

from fp4rl.rollout.attention import Segment
from fp4rl.rollout.block_manager import BlockManager
from fp4rl.rollout.graphs import CONTEXT, POSITION, SLOT, TABLE, TOKEN, fill_rows, pad_rows


def test_rows_from_block_tables_equal_rows_from_lists():
    bm = BlockManager(num_blocks=512, block_size=16)
    tables = [bm.allocate(bm.blocks_for(n)) for n in (1, 16, 17, 300, 2048)]
    segments = [Segment(t, n - 1, 1) for t, n in zip(tables, (1, 16, 17, 300, 2048), strict=True)]
    tokens = [11, 12, 13, 14, 15]
    width = TABLE + max(len(t) for t in tables)
    padding = np.full(width, -7, dtype=np.int64)
    from_tables, from_lists = np.tile(padding, (6, 1)), np.tile(padding, (6, 1))
    fill_rows(from_tables, segments, tokens, 16)
    lists = [Segment(list(s.block_table), s.start, 1) for s in segments]
    fill_rows(from_lists, lists, tokens, 16)
    assert np.array_equal(from_tables, from_lists)
    for row, seg, token in zip(from_tables[:5], segments, tokens, strict=True):
        table = seg.block_table
        assert row[TOKEN] == token and row[POSITION] == seg.start
        assert row[SLOT] == table[seg.start // 16] * 16 + seg.start % 16
        assert row[CONTEXT] == seg.start + 1
        assert row[TABLE : TABLE + len(table)].tolist() == list(table)
        assert (row[TABLE + len(table) :] == -7).all()
    assert (from_tables[5] == padding).all()


def test_a_row_feeding_more_than_one_token_is_refused():
    rows = np.zeros((1, TABLE + 1), dtype=np.int64)
    with pytest.raises(ValueError, match="one token per segment"):
        fill_rows(rows, [Segment([0], 0, 2)], [1], 16)


def test_padding_rows_copy_the_shortest_real_row_but_write_the_scratch_slot():
    bm = BlockManager(num_blocks=64, block_size=16)
    lengths = (40, 7, 300)
    tables = [bm.allocate(bm.blocks_for(n)) for n in lengths]
    segments = [Segment(t, n - 1, 1) for t, n in zip(tables, lengths, strict=True)]
    width = TABLE + max(len(t) for t in tables)
    padding = np.full(width, 63, dtype=np.int64)
    rows = np.tile(padding, (8, 1))
    fill_rows(rows, segments, [11, 12, 13], 16)
    real = rows[:3].copy()
    pad_rows(rows, 3, 63 * 16)
    assert np.array_equal(rows[:3], real), "the real rows changed"
    for row in rows[3:]:
        assert row[SLOT] == 63 * 16
        others = np.arange(width) != SLOT
        assert np.array_equal(row[others], real[1][others]), "not a copy of the shortest row"
    full = rows.copy()
    pad_rows(full, 8, 0)  # no padding: nothing to do
    assert np.array_equal(full, rows)
    with pytest.raises(ValueError, match="num_real=0"):
        pad_rows(rows, 0, 0)
