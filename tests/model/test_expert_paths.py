"""Which path the experts' intermediate takes: the fused SwiGLU-and-site kernel only where no
gradient is wanted and the site neither follows guidance nor is recorded; the same values on
every path. (`fp4rl.ops.swiglu` is stood in for here by the eager formulation, since its kernel
runs on the GPU; tests/kernels/test_kernel_swiglu.py holds the kernel to it.)"""

import torch

from fp4rl import ops
from fp4rl.model.experts import PackedExperts, eager_swiglu
from fp4rl.model.sites import SiteRecords

E, H, I, T, K = 4, 32, 32, 5, 2  # noqa: E741


def packed_experts() -> PackedExperts:
    g = torch.Generator().manual_seed(0)
    experts = PackedExperts(E, H, I, layer=3)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(torch.bfloat16)
    experts.install(*experts.quantized(w13, w2), torch.bfloat16)
    return experts


def test_fused_intermediate_only_where_nothing_needs_the_site(monkeypatch):
    calls = []

    def standin(gate_up, *, quantize=False):
        calls.append(quantize)
        h = eager_swiglu(gate_up)
        return ops.fake_quantize(h, scaling="row") if quantize else h

    monkeypatch.setattr(ops, "swiglu", standin)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, K), generator=g)
    weights = torch.rand(T, K, generator=g)
    experts = packed_experts()
    with torch.no_grad():
        fused = experts(x, ids, weights)
        assert calls == [True]
        records = SiteRecords()
        recorded = experts(x, ids, weights, capture=records)
        assert calls == [True, False] and (3, "expert_hidden") in records.sites
    assert torch.equal(fused, recorded)
    # With a gradient wanted, neither kernel runs.
    x.requires_grad_(True)
    experts(x, ids, weights)
    assert calls == [True, False]
