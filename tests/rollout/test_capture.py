"""Capture bookkeeping: which layers a guidance mode keeps, each sequence's rows gathered from
the log of a generate call's steps."""

import pytest
import torch

from fp4rl.fp4 import CompactCodes, compact, sparse
from fp4rl.ops import quantize
from fp4rl.records import record_cat, record_gather, record_rows
from fp4rl.rollout.capture import (
    CaptureLog,
    PackedRows,
    SequenceCapture,
    StepCapture,
    kept_layers,
)
from fp4rl.rollout.rows import HostRows, RowLayout, to_host_together


def test_kept_layers():
    fp4 = (3, 9, 4, 5, 6)
    assert kept_layers(None, fp4, 0.5) == frozenset()
    assert kept_layers("full", fp4, 0.5) == frozenset(fp4)
    # The latter ceil(fraction * n) of the FP4 layers in index order.
    assert kept_layers("compact", fp4, 0.5) == {5, 6, 9}
    assert kept_layers("compact", fp4, 0.2) == {9}
    assert kept_layers("compact", fp4, 1.0) == frozenset(fp4)


def step_capture(mode, layers=frozenset({1, 2}), sites=("expert_input", "k")):
    keep = {(layer, site) for layer in layers for site in sites}
    return StepCapture(routing=True, guidance=mode, keep=keep)


def test_compact_codes_are_kept_as_given_and_refused_where_full_codes_are_kept():
    """A kernel may hand compact guidance its `CompactCodes` (made on the way): kept as they
    are; full guidance keeps the `NVFP4Tensor` and refuses compact codes by the site's name."""
    t = quantize(torch.randn(3, 32, generator=torch.Generator().manual_seed(4)), scaling="row")
    cap = step_capture("compact")
    codes = compact(t)
    cap.record(1, "k", codes)
    cap.record(2, "k", t)
    assert cap.sites[(1, "k")] is codes
    assert torch.equal(cap.sites[(2, "k")].mantissa_bits, codes.mantissa_bits)
    assert cap.record_form == "compact" and step_capture("full").record_form == "full"
    with pytest.raises(ValueError, match=r"layers.1 site 'k': got compact codes, but 'full'"):
        step_capture("full").record(1, "k", codes)


def test_sequences_gather_their_rows_from_the_log():
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(5, 32, generator=g), torch.randn(3, 32, generator=g)
    ids1, ids2 = torch.randint(0, 8, (5, 2), generator=g), torch.randint(0, 8, (3, 2), generator=g)
    # Two steps: rows [0, 2) and [2, 5) belong to two sequences, then one row each.
    seqs, log = [SequenceCapture(), SequenceCapture()], CaptureLog()
    for x, ids, ranges in ((x1, ids1, [(0, 2), (2, 5)]), (x2, ids2, [(0, 1), (1, 2)])):
        cap = step_capture("full")
        cap.record(1, "expert_input", quantize(x, scaling="row"))
        cap.record(0, "expert_input", quantize(x, scaling="row"))  # layer not kept
        cap.record(2, "expert_hidden", quantize(x, scaling="row"))  # site not guided
        cap.record_routing(1, ids)
        log.add(cap, len(x), [(seq, a, b) for seq, (a, b) in zip(seqs, ranges, strict=True)])
    (_, first), (routing, _) = log.assemble(seqs, moe_layers=(1, 3), top_k=2)
    assert list(first) == [(1, "expert_input")]
    expected = quantize(torch.cat([x1[0:2], x2[0:1]]), scaling="row")
    assert first[(1, "expert_input")].equal(expected)  # per-row scales: slicing is exact
    assert routing.dtype == torch.int32 and routing.shape == (2, 4, 2)
    assert torch.equal(routing[0], torch.cat([ids1[2:5], ids2[1:2]]).int())
    assert (routing[1] == -1).all()  # layer 3 recorded nothing
    assert not log.steps  # assembling empties the log


def test_a_preempted_sequence_keeps_only_its_recomputed_rows():
    x = torch.randn(3, 32)
    seq, log = SequenceCapture(), CaptureLog()
    for rows in ((0, 2), (2, 3)):  # two steps, then preempted: recomputed in a third
        cap = step_capture("full")
        cap.record(1, "k", quantize(x, scaling="row"))
        log.add(cap, 3, [(seq, *rows)])
    seq.clear()
    cap = step_capture("full")
    cap.record(1, "k", quantize(x.flip(0), scaling="row"))
    log.add(cap, 3, [(seq, 0, 3)])
    ((_, guidance),) = log.assemble([seq], moe_layers=(1,), top_k=2)
    assert guidance[(1, "k")].equal(quantize(x.flip(0), scaling="row"))


def test_compact_records_are_the_mantissa_bits_of_the_full_ones():
    x = torch.randn(4, 2, 16)
    assembled = {}
    for mode in ("full", "compact"):
        cap, seq, log = step_capture(mode), SequenceCapture(), CaptureLog()
        cap.record(2, "k", quantize(x, scaling="row"))
        log.add(cap, 4, [(seq, 1, 3)])
        ((_, assembled[mode]),) = log.assemble([seq], moe_layers=(1,), top_k=2)
    c = assembled["compact"][(2, "k")]
    assert isinstance(c, CompactCodes)
    reference = compact(assembled["full"][(2, "k")])
    for a, b in zip(
        (c.mantissa_bits, c.block_scale.view(torch.uint8), c.global_scale),
        (reference.mantissa_bits, reference.block_scale.view(torch.uint8), reference.global_scale),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_to_host_keeps_the_first_rows_of_every_record():
    capture = StepCapture(routing=True, guidance="compact", keep={(0, "k")})
    ids = torch.arange(12, dtype=torch.int32).view(6, 2)
    capture.record_routing(0, ids)
    t = quantize(torch.randn(6, 32, generator=torch.Generator().manual_seed(0)), scaling="row")
    capture.record(0, "k", t)
    host = capture.to_host(4)
    assert (host.keep_routing, host.guidance, host.keep) == (True, "compact", capture.keep)
    assert torch.equal(host.routing[0], ids[:4]) and host.routing[0].device.type == "cpu"
    want = compact(t)
    got = host.sites[(0, "k")]
    assert isinstance(got, CompactCodes)
    for a, b in zip(
        (got.mantissa_bits, got.block_scale, got.global_scale),
        (want.mantissa_bits[:4], want.block_scale[:4], want.global_scale[:4]),
        strict=True,
    ):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    whole = capture.to_host()
    assert whole.routing[0].shape == (6, 2) and whole.sites[(0, "k")].global_scale.shape[0] == 6


def test_records_go_to_the_host_through_one_buffer_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    t = quantize(torch.randn(5, 48, generator=g), scaling="row")
    items = [
        torch.arange(15, dtype=torch.int32).view(5, 3),
        t,
        compact(t),
        torch.tensor([True, False, True]),  # 3 bytes: the next piece starts 16-aligned
        torch.randn(2, 3, generator=g, dtype=torch.float64),
        torch.empty(0, 4),
    ]
    moved = to_host_together(items)
    assert [type(m) for m in moved] == [type(i) for i in items]
    buffers = set()
    for a, b in zip(moved, items, strict=True):
        a_members = a.tensors() if hasattr(a, "tensors") else (a,)
        b_members = b.tensors() if hasattr(b, "tensors") else (b,)
        if isinstance(a, CompactCodes):
            a_members = (a.mantissa_bits, a.block_scale, a.global_scale)
            b_members = (b.mantissa_bits, b.block_scale, b.global_scale)
        for x, y in zip(a_members, b_members, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            if x.numel():
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                assert x.data_ptr() % 16 == 0
                buffers.add(x.untyped_storage().data_ptr())
    assert len(buffers) == 1  # one buffer for the whole step


def row_items(rows: int, g: torch.Generator):
    """Token-major items of every kind and awkward widths: 3 int32 ids (12 bytes), bools, a
    float64 pair, an NVFP4 record of [rows, 2, 48] and its compact form."""
    t = quantize(torch.randn(rows, 2, 48, generator=g), scaling="row")
    return {
        1: torch.randint(0, 9, (rows, 3), generator=g, dtype=torch.int32),
        (1, "flags"): torch.rand(rows, generator=g) > 0.5,
        (1, "pair"): torch.randn(rows, 2, generator=g, dtype=torch.float64),
        (2, "k"): t,
        (3, "k"): compact(t),
    }


def members(item) -> tuple[torch.Tensor, ...]:
    if isinstance(item, torch.Tensor):
        return (item,)
    if isinstance(item, CompactCodes):
        return item.mantissa_bits, item.block_scale, item.global_scale
    return item.tensors()


def assert_same(got, want, what) -> None:
    """Same kind, and member by member the same dtype, shape and bytes."""
    assert type(got) is type(want), what
    for a, b in zip(members(got), members(want), strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), what
        a, b = (m.contiguous().reshape(-1).view(torch.uint8) for m in (a, b))
        assert torch.equal(a, b), what


def test_a_row_layout_packs_any_prefix_of_tokens_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    items = row_items(7, g)
    layout = RowLayout.of(list(items), list(items.values()))
    # One layout whatever the number of tokens: made once, then found again.
    assert RowLayout.of(list(items), list(row_items(3, g).values())) is layout
    assert layout.row_bytes % 16 == 0
    assert all(offset % 16 == 0 for item in layout.members for offset, _, _ in item)
    rows = layout.pack(list(items.values()))
    assert rows.dtype == torch.uint8 and rows.shape == (7, layout.row_bytes)
    for r in (7, 4, 1):  # rows 0..r hold the records of tokens 0..r
        unpacked = layout.unpack(rows[:r])
        assert list(unpacked) == list(items)
        for key, item in items.items():
            want = item[:r] if isinstance(item, torch.Tensor) else record_rows(item, 0, r)
            assert_same(unpacked[key], want, key)


def test_a_row_layout_gathers_rows_into_records_of_their_own():
    g = torch.Generator().manual_seed(3)
    items = row_items(9, g)
    layout = RowLayout.of(list(items), list(items.values()))
    rows = layout.pack(list(items.values()))
    indices = [torch.tensor([4, 0, 8, 8]), torch.tensor([], dtype=torch.long), torch.arange(9)]
    got = layout.gather(rows, indices, keys={1, (2, "k")})
    storages = set()
    for index, records in zip(indices, got, strict=True):
        assert list(records) == [1, (2, "k")]
        assert_same(records[1], items[1][index], index)
        spans = [(i, i + 1) for i in index.tolist()]
        assert_same(records[(2, "k")], record_gather(items[(2, "k")], spans), index)
        # An index's records share one buffer of their own: not rows', not another index's.
        mine = {m.untyped_storage().data_ptr() for m in (records[1], *members(records[(2, "k")]))}
        assert len(mine) == 1 and rows.untyped_storage().data_ptr() not in mine
        storages |= mine
    assert len(storages) == len(indices)


def test_gathered_members_of_any_dtype_view_their_rows():
    """The gathered stretch ends 16-aligned: 16 bytes of float64 then 12 of int32 (28 bytes of
    members) still give float64 views."""
    g = torch.Generator().manual_seed(6)
    items = {
        (0, "pair"): torch.randn(5, 2, generator=g, dtype=torch.float64),
        (0, "ids"): torch.randint(0, 9, (5, 3), generator=g, dtype=torch.int32),
    }
    layout = RowLayout.of(list(items), list(items.values()))
    rows = layout.pack(list(items.values()))
    index = torch.tensor([3, 1, 3])
    (got,) = layout.gather(rows, [index])
    for key, item in items.items():
        assert_same(got[key], item[index], key)


def test_a_row_layout_refuses_what_does_not_fit_it():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(4))
    t = quantize(x, scaling="row")
    with pytest.raises(ValueError, match=r"\(1, 'k'\): a SparseCodes has no fixed bytes per token"):
        RowLayout.of([(1, "k")], [sparse(x, t, 0.1)])
    layout = RowLayout.of([0], [torch.zeros(4, 2, dtype=torch.int32)])
    with pytest.raises(ValueError, match=r"0: a member of torch.int64 \(4, 2\) in a layout of"):
        layout.pack([torch.zeros(4, 2, dtype=torch.long)])
    with pytest.raises(ValueError, match=r"0: a member of torch.int32 \(4, 3\) in a layout of"):
        layout.pack([torch.zeros(4, 3, dtype=torch.int32)])


def random_step(g, rows: int, mode: str) -> tuple[StepCapture, dict]:
    """A step's capture of ``rows`` tokens: routing of layers 3 and 1 (top-3: 12 bytes a
    token), two guided sites; and the records themselves, by key (layer for routing)."""
    x, y = torch.randn(rows, 2, 32, generator=g) * 3, torch.randn(rows, 64, generator=g)
    records = {3: torch.randint(0, 9, (rows, 3), generator=g, dtype=torch.int32)}
    records[1] = torch.randint(0, 9, (rows, 3), generator=g, dtype=torch.int32)
    cap = StepCapture(
        routing=True, guidance=mode, keep={(1, "k"), (3, "expert_input")}, sparse_delta=0.2
    )
    for key, values in (((1, "k"), x), ((3, "expert_input"), y)):
        cap.record(*key, quantize(values, scaling="row"), values)
        records[key] = cap.sites[key]
    for layer in (3, 1):
        cap.record_routing(layer, records[layer])
    return cap, records


@pytest.mark.parametrize(
    "mode, form",
    [(m, f) for m in ("full", "compact", "sparse")
     for f in ("live", "to_host", "graphed", "host_rows")
     if (m, f) != ("sparse", "graphed")],  # sparse guidance is never graphed
)  # fmt: skip
def test_assembly_equals_cutting_every_step_per_sequence(mode, form, monkeypatch):
    """Each sequence's records from the log are its spans of each step's records, cut and
    concatenated one by one (the plain reference), bit for bit: steps of several sizes, rows
    shared by two sequences (a prompt's samples) or by none (padding), a preempted sequence,
    routing placed in ``moe_layers`` order with -1 for a layer that recorded nothing. In form
    "host_rows" the steps' rows lie in the log's `HostRows` (as the engine's on a GPU), in
    chunks so small that the steps spill over four of them."""
    monkeypatch.setattr(HostRows, "MIN_CHUNK_BYTES", 1)
    g = torch.Generator().manual_seed(5)
    seqs, log, steps = [SequenceCapture() for _ in range(5)], CaptureLog(), []
    for step in range(6):
        rows = (8, 5, 8, 6, 8, 7)[step]  # in "host_rows", two steps skip a chunk's last rows
        padding = 0 if form == "live" else 3  # rows past the step's own: a graph's bucket
        cap, records = random_step(g, rows + padding, mode)
        steps.append(records)
        if form == "live":
            logged = cap
        elif form == "to_host":
            logged = cap.to_host(rows)
        elif form == "graphed":  # as `DecodeGraphs.run`: the graph packed the bucket, rows 0..B
            logged = cap.holding(cap.pack().to_host(rows))
        else:  # what `PackedRows.to_host(rows, into)` does from a GPU
            packed = cap.pack()
            host = PackedRows(packed.layout, *log.host_rows.copy_in(packed.rows[:rows]))
            logged = cap.holding(host, cap.to_host(rows).loose())
        cuts = sorted(torch.randperm(rows - 1, generator=g)[:4].add(1).tolist())
        ranges = list(zip([0, *cuts], [*cuts, rows], strict=True))  # 5 ranges cover the rows
        owners = torch.randperm(5, generator=g).tolist()
        spans = [(seqs[s], *ranges[i]) for i, s in enumerate(owners) if (step + s) % 3]
        spans.append((seqs[owners[0]], *ranges[1]))  # a row range fed to two sequences
        if step == 3:
            seqs[2].clear()  # preempted: what it was fed so far is recomputed later
        log.add(logged, rows, spans)
    moe_layers = (3, 0, 1)
    got = log.assemble(seqs, moe_layers, top_k=3)
    for seq, (routing, guidance) in zip(seqs, got, strict=True):

        def cut(key, seq=seq):
            return [record_rows(steps[s][key], a, b) for s, a, b in seq.spans]

        T = sum(b - a for _, a, b in seq.spans)
        want = torch.full((3, T, 3), -1, dtype=torch.int32)
        want[0], want[2] = (
            torch.cat([steps[s][3][a:b] for s, a, b in seq.spans]),
            torch.cat([steps[s][1][a:b] for s, a, b in seq.spans]),
        )
        assert_same(routing, want, "routing")
        assert sorted(guidance) == [(1, "k"), (3, "expert_input")]
        for key, record in guidance.items():
            want = record_cat(cut(key))
            assert_same(record, want.pack() if mode == "sparse" else want, key)
