"""`RowRecords`: a completion's guidance left in its generate call's rows of bytes, read when
used, `collate` gathering a batch's rows at once, and an engine's completions through pickle."""

import io
import pickle
from dataclasses import replace

import pytest
import torch
from tiny_models import DEVICES, engine_config, rollout_model

from fp4rl.fp4 import CompactCodes, compact
from fp4rl.ops import quantize
from fp4rl.records import (
    Completion,
    RowRecords,
    collate,
    record_members,
    record_nbytes,
)
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.rollout.rows import RowLayout

KEYS = [(2, "k"), (3, "k"), (5, "expert_hidden")]


def call_rows(rows: int, g: torch.Generator):
    """One call's packed rows (routing of layer 0 first, as the engine lays them out) and its
    items by key: an NVFP4 record, its compact form, a compact record of [rows, 2, 32]."""
    t = quantize(torch.randn(rows, 48, generator=g) * 2, scaling="row")
    items = {
        0: torch.randint(0, 9, (rows, 3), generator=g, dtype=torch.int32),
        KEYS[0]: t,
        KEYS[1]: compact(t),
        KEYS[2]: compact(quantize(torch.randn(rows, 2, 32, generator=g), scaling="row")),
    }
    layout = RowLayout.of(list(items), list(items.values()))
    return layout, layout.pack(list(items.values())), items


def assert_same(got, want, what) -> None:
    assert type(got) is type(want), what
    for a, b in zip(record_members(got), record_members(want), strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), what
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def rows_of(record, index):
    return type(record)(*(m[index] for m in record_members(record)))


def test_records_are_read_from_the_rows_when_first_used():
    g = torch.Generator().manual_seed(0)
    layout, rows, items = call_rows(9, g)
    index = torch.tensor([4, 0, 8, 8, 2])
    (records,) = layout.gather(rows, [index], KEYS)
    assert isinstance(records, RowRecords) and records._block is None  # nothing read yet
    assert list(records) == KEYS and len(records) == 3 and records.num_rows == 5
    assert records.row_nbytes() == sum(record_nbytes(rows_of(items[k], index)) for k in KEYS)
    assert records._block is None  # their size is known without reading them
    for key in KEYS:
        assert_same(records[key], rows_of(items[key], index), key)
        assert records[key] is records[key]  # made once
    # One gather for all of the sequence's records, into memory of its own (not the rows').
    storages = {m.untyped_storage().data_ptr() for k in KEYS for m in record_members(records[k])}
    assert storages == {records.block().untyped_storage().data_ptr()}
    assert rows.untyped_storage().data_ptr() not in storages
    with pytest.raises(KeyError):
        records[(9, "k")]


def test_other_records_join_the_rows_and_saving_carries_only_the_records():
    g = torch.Generator().manual_seed(1)
    layout, rows, items = call_rows(6, g)
    (records,) = layout.gather(rows, [torch.arange(6)], KEYS[1:])
    marked = records.with_others({(1, "k"): None}).with_others({(1, "k"): None, (4, "v"): None})
    assert list(marked) == [KEYS[1], KEYS[2], (1, "k"), (4, "v")] and len(marked) == 4
    assert marked[(1, "k")] is None and (1, "k") in marked and (1, "k") not in records
    with pytest.raises(ValueError, match=r"the rows already hold the records of \[\(3, 'k'\)\]"):
        records.with_others({KEYS[1]: None})  # a record lies in one place only
    saved = io.BytesIO()
    torch.save(records, saved)
    saved.seek(0)
    plain = torch.load(saved, weights_only=False)
    assert type(plain) is dict and list(plain) == KEYS[1:]
    for key in plain:
        assert_same(plain[key], items[key], key)


def completion(i: int, guidance, T: int) -> Completion:
    return Completion(
        prompt_index=i,
        sample_index=0,
        prompt_ids=(1,) * 3,
        completion_ids=(2,) * (T - 2),
        finish_reason="length",
        policy_version=0,
        guidance=guidance,
    )


def test_collate_gathers_a_batch_of_row_records_as_reading_them_one_by_one():
    """Completions of two calls, interleaved, with a site left to nearest rounding: collate's
    one gather per run of a call's completions gives, bit for bit, the records that reading
    each completion's and concatenating them gives, each member contiguous."""
    g = torch.Generator().manual_seed(2)
    calls = [call_rows(n, g) for n in (12, 10)]
    batch = []
    for i, (call, index) in enumerate([(0, [3, 1, 2]), (0, [0, 5, 6, 7]), (1, [9, 8, 0]),
                                       (0, [11, 4, 4]), (1, [1, 2, 3, 4, 5])]):  # fmt: skip
        layout, rows, _ = calls[call]
        (records,) = layout.gather(rows, [torch.tensor(index)], KEYS)
        batch.append(completion(i, records.with_others({(1, "v"): None}), len(index)))
    got = collate(batch).guidance
    assert all(c.guidance._block is None for c in batch)  # no completion read its own
    read = [completion(i, dict(c.guidance), c.num_fed_tokens) for i, c in enumerate(batch)]
    want = collate(read).guidance  # record by record: each completion's, then concatenated
    assert list(got) == list(want) == [*KEYS, (1, "v")] and got[(1, "v")] is None
    for key in KEYS:
        assert_same(got[key], want[key], key)
        assert all(m.is_contiguous() for m in record_members(got[key]))
    assert isinstance(got[KEYS[1]], CompactCodes)
    assert [c.guidance_nbytes() for c in batch] == [c.guidance_nbytes() for c in read]


def test_collate_names_a_completion_whose_rows_do_not_match_its_tokens():
    g = torch.Generator().manual_seed(3)
    layout, rows, _ = call_rows(8, g)
    (records,) = layout.gather(rows, [torch.arange(5)], KEYS)
    with pytest.raises(ValueError, match=r"prompt 7, sample 0\): guidance for .* has 5 rows for 6"):
        collate([completion(7, records, 6)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["full", "compact"])
def test_an_engines_completions_travel_through_pickle(form, device):
    """What a rollout worker in another process would send: completions with their routing
    and guidance, the records still in their call's rows, pickled and read back bit for bit
    (E4M3 block scales included, which torch alone cannot unpickle). On a GPU, from graphed
    steps whose rows the engine copied to pinned memory."""
    dtype = torch.bfloat16 if device == "cuda" else None
    packed, _ = rollout_model("nvfp4", dtype=dtype, device=device)
    engine = Engine(packed, engine_config(capture_routing=True, guidance=form))
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=0, return_logprobs=True)
    sent = engine.generate([[1, 2, 3], [4, 5]] * 4, params)
    got = pickle.loads(pickle.dumps(sent))
    # One completion carries its own routing, not its call's: the record views the call's
    # block, which pickle would otherwise write whole with each completion.
    one = sent[0]
    block = one.routing.untyped_storage().nbytes()
    assert block >= 16 * one.routing_nbytes()
    routing_pickled = len(pickle.dumps(one)) - len(pickle.dumps(replace(one, routing=None)))
    assert routing_pickled < block / 2, (routing_pickled, block)
    assert len(got) == len(sent) == 16
    for g, s in zip(got, sent, strict=True):
        assert g.completion_ids == s.completion_ids and torch.equal(g.logprobs, s.logprobs)
        assert torch.equal(g.routing, s.routing)
        assert isinstance(s.guidance, RowRecords) and list(g.guidance) == list(s.guidance)
        for key in s.guidance:
            if s.guidance[key] is None:  # a site compact guidance leaves to nearest rounding
                assert g.guidance[key] is None, key
            else:
                assert_same(g.guidance[key], s.guidance[key], key)


def test_a_detached_completion_keeps_only_its_own_records():
    packed, _ = rollout_model("nvfp4")
    engine = Engine(packed, engine_config(capture_routing=True, guidance="full"))
    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=0)
    sent = engine.generate([[1, 2, 3], [4, 5]] * 2, params)
    one, own = sent[1], sent[1].detached()
    assert isinstance(one.guidance, RowRecords) and not isinstance(own.guidance, RowRecords)
    assert one.routing.untyped_storage().nbytes() > one.routing_nbytes()
    assert own.routing.untyped_storage().nbytes() == own.routing_nbytes()
    assert torch.equal(own.routing, one.routing) and own.completion_ids == one.completion_ids
    assert list(own.guidance) == list(one.guidance)
    for key in one.guidance:
        assert_same(own.guidance[key], one.guidance[key], key)
        for member in record_members(own.guidance[key]):
            assert member.untyped_storage().nbytes() == member.numel() * member.element_size()
    assert own.guidance_nbytes() == one.guidance_nbytes()
