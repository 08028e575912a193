"""Which path the experts' intermediate takes: the fused SwiGLU-and-site kernel only where no
gradient is wanted and the site does not follow guidance (with the site's record from the same
kernel where a capture keeps it); the same values and records on every path. (`fp4rl.ops.swiglu`
and `fp4rl.ops.swiglu_site` are stood in for here by the eager formulation, since their kernel
runs on the GPU; tests/kernels/test_kernel_swiglu.py holds the kernel to them.)"""

import pytest
import torch

from fp4rl import ops
from fp4rl.model.experts import PackedExperts, eager_swiglu
from fp4rl.model.sites import SiteRecords
from fp4rl.rollout.capture import StepCapture

E, H, I, T, K = 4, 32, 32, 5, 2  # noqa: E741


def packed_experts() -> PackedExperts:
    g = torch.Generator().manual_seed(0)
    experts = PackedExperts(E, H, I, layer=3)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(torch.bfloat16)
    experts.install(*experts.quantized(w13, w2), torch.bfloat16)
    return experts


def standins(monkeypatch, fused: bool = True) -> list:
    """`ops.swiglu` and `ops.swiglu_site` as eager formulations (``fused``) or answering None;
    returns the calls: ``quantize`` of each `swiglu`, the record form of each `swiglu_site`."""
    calls = []

    def swiglu(gate_up, *, quantize=False, permuted_by=None):
        assert permuted_by is None  # the CPU's GEMM reads rows in real order
        calls.append(quantize)
        if not fused:
            return None
        h = eager_swiglu(gate_up)
        return ops.fake_quantize(h, scaling="row") if quantize else h

    def swiglu_site(gate_up, record, row_order=None, permuted_by=None):
        assert permuted_by is None
        calls.append(record)
        if not fused:
            return None
        h = eager_swiglu(gate_up)
        rows = h[row_order.flatten()].view(*row_order.shape, h.shape[-1])
        t = ops.quantize(rows, scaling="row")
        return ops.fake_quantize(h, scaling="row"), ops.compact(t) if record == "compact" else t

    monkeypatch.setattr(ops, "swiglu", swiglu)
    monkeypatch.setattr(ops, "swiglu_site", swiglu_site)
    return calls


def inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, K), generator=g)
    return x, ids, torch.rand(T, K, generator=g)


def test_fused_intermediate_only_where_nothing_needs_the_site(monkeypatch):
    calls = standins(monkeypatch)
    x, ids, weights = inputs()
    experts = packed_experts()
    with torch.no_grad():
        fused = experts(x, ids, weights)
        assert calls == [True]
        records = SiteRecords()
        recorded = experts(x, ids, weights, capture=records)
        assert calls == [True, "full"] and (3, "expert_hidden") in records.sites
        sparse = StepCapture(routing=False, guidance="sparse", keep={(3, "expert_hidden")},
                             sparse_delta=0.5)  # fmt: skip
        experts(x, ids, weights, capture=sparse)  # keeps values too: the site runs itself
        assert calls == [True, "full", False] and (3, "expert_hidden") in sparse.sites
    assert torch.equal(fused, recorded)
    # With a gradient wanted, neither kernel runs.
    x.requires_grad_(True)
    experts(x, ids, weights)
    assert calls == [True, "full", False]


@pytest.mark.parametrize("mode", ["full", "compact"])
def test_the_fused_record_is_the_sites_record_in_token_order(monkeypatch, mode):
    """The record the fused op makes (rows picked by the experts' row order) is bitwise the
    one the site makes where the op answers None, ``[T, k, I]`` in token order."""
    x, ids, weights = inputs()
    experts = packed_experts()
    out = {}
    for fused in (True, False):
        standins(monkeypatch, fused)
        capture = StepCapture(routing=False, guidance=mode, keep={(3, "expert_hidden")})
        with torch.no_grad():
            y = experts(x, ids, weights, capture=capture)
        out[fused] = y, capture.sites[(3, "expert_hidden")]
    (y, got), (y_want, want) = out[True], out[False]
    assert torch.equal(y, y_want) and type(got) is type(want) and got.shape == (T, K, I)
    bits = "mantissa_bits" if mode == "compact" else "codes"
    for name in (bits, "block_scale", "global_scale"):
        assert torch.equal(getattr(got, name).view(torch.uint8),
                           getattr(want, name).view(torch.uint8)), name  # fmt: skip
