"""Which path an FP4 site takes: values only (one fake-quant op) unless a capture keeps its
record."""

import pytest
import torch

from fp4rl import ops
from fp4rl.model import sites
from fp4rl.model.sites import Fp4Site, SiteRecords
from fp4rl.ops import dequantize, quantize
from fp4rl.rollout.capture import StepCapture as Capture


class _KeepsNothing(SiteRecords):
    def records(self, layer, site):
        return False


@pytest.mark.parametrize(
    "capture",
    [None, _KeepsNothing(), Capture(routing=True, guidance=None, keep=frozenset()),
     Capture(routing=True, guidance="compact", keep=frozenset({(5, "expert_input")}))],
    ids=["no capture", "keeps nothing", "routing only", "compact, other layers"],
)  # fmt: skip
def test_a_site_nobody_records_is_one_fake_quant(monkeypatch, capture):
    calls = {"fake": 0, "quantize": 0}
    fake, quantize_site = sites.fake_quantize, sites.quantize_site

    def counting_fake(*a, **kw):
        calls["fake"] += 1
        return fake(*a, **kw)

    def counting_quantize(*a, **kw):
        calls["quantize"] += 1
        return quantize_site(*a, **kw)

    monkeypatch.setattr(sites, "fake_quantize", counting_fake)
    monkeypatch.setattr(sites, "quantize_site", counting_quantize)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = Fp4Site(2, "expert_input", guided=True)(x, None, capture)
    assert calls == {"fake": 1, "quantize": 0}
    assert torch.equal(got, dequantize(quantize(x, scaling="row"), x.dtype))


def test_a_recorded_site_makes_and_records_its_tensor(monkeypatch):
    records = SiteRecords()
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = Fp4Site(2, "expert_input", guided=True)(x, None, records)
    want = quantize(x, scaling="row")
    assert list(records.sites) == [(2, "expert_input")] and records.sites[
        (2, "expert_input")
    ].equal(want)
    assert torch.equal(got, dequantize(want, x.dtype))


def test_which_record_a_kernel_on_the_way_must_make():
    """`Fp4Site.on_the_way`: "" where nobody keeps the record, the capture's record form where
    it keeps one, None where the site must run itself (it follows guidance, or its capture
    keeps the values too); `keep` hands a record made on the way to the capture as it is."""
    site = Fp4Site(2, "expert_input", guided=True)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    guidance = {(2, "expert_input"): quantize(x, scaling="row")}
    kept = {(2, "expert_input")}
    assert site.on_the_way(None, None) == ""
    assert site.on_the_way(None, _KeepsNothing()) == ""
    assert site.on_the_way(None, SiteRecords()) == "full"
    assert site.on_the_way(None, Capture(routing=False, guidance="full", keep=kept)) == "full"
    compact = Capture(routing=False, guidance="compact", keep=kept)
    assert site.on_the_way(None, compact) == "compact"
    sparse = Capture(routing=False, guidance="sparse", keep=kept, sparse_delta=0.5)
    assert site.on_the_way(None, sparse) is None
    assert site.on_the_way(guidance, None) is None
    assert Fp4Site(2, "expert_input", guided=False).on_the_way(guidance, compact) == "compact"
    record = ops.compact(quantize(x, scaling="row"))
    site.keep(compact, record)
    assert compact.sites[(2, "expert_input")] is record  # kept as made, not compacted again
