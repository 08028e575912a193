"""Capture bookkeeping: which layers a guidance mode keeps, each sequence's rows gathered from
the log of a generate call's steps."""

import torch

from fp4rl.fp4 import CompactCodes, compact
from fp4rl.ops import quantize
from fp4rl.records import to_host_together
from fp4rl.rollout.capture import CaptureLog, SequenceCapture, StepCapture, kept_layers


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
