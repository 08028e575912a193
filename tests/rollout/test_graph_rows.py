"""The input rows a graphed decode step stages (`graphs.fill_rows`, `graphs.pad_rows`): the same
rows from a `BlockTable`'s int64 copy as from its Python ints, the columns each row holds, and
padding rows as copies of the shortest real row that write only the scratch slot. And the
inputs a graphed prefill step stages (`prefill_graphs.PrefillInputs`): the positions and slots
the eager step's metadata computes, the prefill kernel's tiles, padding that writes only the
scratch block."""

import numpy as np
import pytest

from fp4rl.rollout.attention import AttentionMetadata, Segment
from fp4rl.rollout.block_manager import BlockManager
from fp4rl.rollout.graphs import (
    CONTEXT,
    MAX_GRAPH_BATCH,
    POSITION,
    SLOT,
    TABLE,
    TOKEN,
    fill_rows,
    pad_rows,
)
from fp4rl.rollout.prefill_graphs import (
    MAX_PREFILL_GRAPH_TOKENS,
    PREFILL_BUCKETS,
    PrefillInputs,
    graphable_prefill,
    prefill_bucket,
)


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


def prefill_step(lengths, starts, bm):
    """Segments feeding ``lengths`` tokens after ``starts`` cached, in fresh block tables."""
    tables = [bm.allocate(bm.blocks_for(s + n)) for s, n in zip(starts, lengths, strict=True)]
    return [Segment(t, s, n) for t, s, n in zip(tables, starts, lengths, strict=True)]


def test_prefill_inputs_hold_the_eager_steps_positions_slots_tiles_and_decodes():
    """Three prompts (or chunks) and three decodes beside them, in one step: the eager step's
    metadata, and a fourth decode slot that copies the decode of the shortest context."""
    bm = BlockManager(num_blocks=128, block_size=16)
    segments = prefill_step((20, 1, 2, 37, 1, 1), (0, 44, 30, 16, 7, 99), bm)
    tokens = list(range(100, 162))
    inputs = PrefillInputs.of(prefill_bucket(62), 4, max_segments=8, block_q=8, width=7)
    assert (inputs.tokens, inputs.segments, inputs.decodes) == (64, 9, 4)  # row 0 empty
    assert inputs.tiles == 8 + 8  # 64 tokens of 8 a tile, one partial tile per segment
    buffer = np.full(inputs.size + 5, -7, dtype=np.int64)
    used = inputs.fill(buffer, segments, tokens, 16, 8, scratch_block=127)
    assert used == inputs.table_at + 4 * 7 and (buffer[inputs.size :] == -7).all()
    columns, segs, tiles, decodes, decode_table, table = inputs.views(buffer)
    meta = AttentionMetadata.build(segments, 16, "cpu")
    assert columns[0, :62].tolist() == tokens
    assert columns[1, :62].tolist() == meta.positions_T.tolist()
    assert columns[2, :62].tolist() == meta.slots_T.tolist()
    # Padding: the first token at position 0, K and V to the scratch block.
    assert (columns[:, 62:] == np.array([[100], [0], [127 * 16]])).all()
    assert segs[0].tolist() == [0, 0, 0]
    assert [tuple(row) for row in segs[1:4].tolist()] == list(meta.prefill_segments)
    assert segs[1:4].tolist() == [[0, 0, 20], [21, 30, 2], [23, 16, 37]]
    for row, blocks in zip(table[1:4], meta.prefill_tables, strict=True):
        assert row[: len(blocks)].tolist() == list(blocks) and set(row[len(blocks) :]) <= {127}
    want = [(1 + i, q0) for i, n in enumerate((20, 2, 37)) for q0 in range(0, n, 8)]
    assert [tuple(t) for t in tiles[: len(want)].tolist()] == want
    assert (tiles[len(want) :] == 0).all(), "spare tiles name the empty segment"
    # The decodes: the eager step's rows, contexts and tables; the spare slot copies row 60's.
    assert decodes[:3, 0].tolist() == meta.decode_rows_B.tolist() == [20, 60, 61]
    assert decodes[:3, 1].tolist() == meta.decode_context_B.tolist() == [45, 8, 100]
    for row, seg in zip(decode_table[:3], (segments[1], segments[4], segments[5]), strict=True):
        blocks = list(seg.block_table)
        assert row[: len(blocks)].tolist() == blocks and set(row[len(blocks) :]) <= {127}
    assert decodes[3].tolist() == [60, 8] and np.array_equal(decode_table[3], decode_table[1])


def test_prefill_inputs_from_lists_equal_inputs_from_block_tables():
    bm = BlockManager(num_blocks=64, block_size=16)
    segments = prefill_step((5, 40, 1), (3, 0, 20), bm)
    lists = [Segment(list(s.block_table), s.start, s.num_new) for s in segments]
    inputs = PrefillInputs.of(64, 1, max_segments=4, block_q=4, width=8)
    a, b = (np.zeros(inputs.size, dtype=np.int64) for _ in range(2))
    inputs.fill(a, segments, list(range(46)), 16, 4, scratch_block=63)
    inputs.fill(b, lists, list(range(46)), 16, 4, scratch_block=63)
    assert np.array_equal(a, b)


def test_which_steps_a_prefill_graph_takes():
    bm = BlockManager(num_blocks=1024, block_size=16)
    assert graphable_prefill(prefill_step((2, 300), (0, 0), bm))
    assert graphable_prefill(prefill_step((1, 300, 1), (5, 0, 9), bm)), "decodes beside a prompt"
    assert not graphable_prefill([])
    assert not graphable_prefill(prefill_step((MAX_PREFILL_GRAPH_TOKENS, 2), (0, 0), bm))
    assert graphable_prefill(prefill_step((MAX_PREFILL_GRAPH_TOKENS,), (0,), bm))
    many = prefill_step((2,) + (1,) * (MAX_GRAPH_BATCH + 1), (0,) * (MAX_GRAPH_BATCH + 2), bm)
    assert not graphable_prefill(many), "more decodes than the largest decode bucket"
    assert graphable_prefill(many[:-1])
    assert prefill_bucket(2) == 16 and prefill_bucket(257) == 512
    assert prefill_bucket(MAX_PREFILL_GRAPH_TOKENS) == PREFILL_BUCKETS[-1]
    assert prefill_bucket(MAX_PREFILL_GRAPH_TOKENS + 1) is None
    inputs = PrefillInputs.of(16, 0, max_segments=4, block_q=8, width=4)
    buffer = np.zeros(inputs.size, dtype=np.int64)
    refused = "a prefill graph of 16 tokens and 0 decodes cannot take segments of"
    with pytest.raises(ValueError, match=f"{refused} \\[20\\] tokens"):
        inputs.fill(buffer, prefill_step((20,), (0,), bm), list(range(20)), 16, 8, 511)
    with pytest.raises(ValueError, match=f"{refused} \\[2, 2, 2, 2, 2\\] tokens"):
        inputs.fill(buffer, prefill_step((2,) * 5, (0,) * 5, bm), list(range(10)), 16, 8, 511)
    with pytest.raises(ValueError, match=f"{refused} \\[2, 1\\] tokens"):
        inputs.fill(buffer, prefill_step((2, 1), (0, 4), bm), list(range(3)), 16, 8, 511)
    two = PrefillInputs.of(16, 2, max_segments=4, block_q=8, width=4)
    with pytest.raises(ValueError, match="16 tokens and 2 decodes cannot take segments of \\[2\\]"):
        two.fill(np.zeros(two.size, dtype=np.int64), prefill_step((2,), (0,), bm), [1, 2], 16, 8, 9)
    with pytest.raises(ValueError, match="does not fit its block table of block size 16"):
        inputs.fill(buffer, [Segment([3], 10, 8)], list(range(8)), 16, 8, 511)
