"""Capture bookkeeping: which layers a guidance mode keeps, per-sequence splitting, assembly."""

import torch

from fp4rl.fp4 import CompactCodes, compact
from fp4rl.ops import quantize
from fp4rl.rollout.capture import SequenceCapture, StepCapture, kept_layers


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


def test_split_and_reassemble_by_rows():
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(5, 32, generator=g), torch.randn(3, 32, generator=g)
    ids1, ids2 = torch.randint(0, 8, (5, 2), generator=g), torch.randint(0, 8, (3, 2), generator=g)
    # Two steps: rows [0, 2) and [2, 5) belong to two sequences, then one row each.
    seqs = [SequenceCapture(), SequenceCapture()]
    for x, ids, ranges in ((x1, ids1, [(0, 2), (2, 5)]), (x2, ids2, [(0, 1), (1, 2)])):
        cap = step_capture("full")
        cap.record(1, "expert_input", quantize(x, scaling="row"))
        cap.record(0, "expert_input", quantize(x, scaling="row"))  # layer not kept
        cap.record(2, "expert_hidden", quantize(x, scaling="row"))  # site not guided
        cap.record_routing(1, ids)
        for seq, piece in zip(seqs, cap.split(ranges), strict=True):
            seq.pieces.append(piece)
    first = seqs[0].guidance()
    assert list(first) == [(1, "expert_input")]
    expected = quantize(torch.cat([x1[0:2], x2[0:1]]), scaling="row")
    assert first[(1, "expert_input")].equal(expected)  # per-row scales: slicing is exact
    routing = seqs[1].routing(moe_layers=(1, 3), top_k=2)
    assert routing.dtype == torch.int32 and routing.shape == (2, 4, 2)
    assert torch.equal(routing[0], torch.cat([ids1[2:5], ids2[1:2]]).int())
    assert (routing[1] == -1).all()  # layer 3 recorded nothing


def test_compact_records_are_the_mantissa_bits_of_the_full_ones():
    x = torch.randn(4, 2, 16)
    full, comp = step_capture("full"), step_capture("compact")
    for cap in (full, comp):
        cap.record(2, "k", quantize(x, scaling="row"))
    (piece_full,), (piece_comp,) = full.split([(1, 3)]), comp.split([(1, 3)])
    c = piece_comp.sites[(2, "k")]
    assert isinstance(c, CompactCodes)
    reference = compact(piece_full.sites[(2, "k")])
    for a, b in zip(
        (c.mantissa_bits, c.block_scale.view(torch.uint8), c.global_scale),
        (reference.mantissa_bits, reference.block_scale.view(torch.uint8), reference.global_scale),
        strict=True,
    ):
        assert torch.equal(a, b)
