"""QAT forward, straight-through gradients, router replay, the precision plan, chunked logprobs."""

import pytest
import torch
from tiny_models import FP4_EVERYWHERE, qat_model, tiny_config

from fp4rl.fp4 import reference as R
from fp4rl.model.attention import CausalAttention
from fp4rl.model.experts import Experts
from fp4rl.model.logprobs import token_logprobs
from fp4rl.model.precision import PrecisionConfig, resolve_plan
from fp4rl.model.sites import SiteRecords


def tiny_model(precision=FP4_EVERYWHERE, config=None, seed=0):
    return qat_model(precision, config=config, seed=seed)


def ste(x, fq):
    """The textbook straight-through estimator: forward ~ fq (one FP32 rounding), grad 1."""
    return x + (fq - x).detach()


class ReferenceSiteExperts(Experts):
    """BF16 experts whose FP4 sites are the reference quantize-dequantize, written out here.

    With ``exact=True`` a site returns the quantized value itself (forward parity); otherwise it
    wraps it in the textbook estimator (gradient parity).
    """

    exact = True

    def site(self, x, fq):
        return fq if self.exact else ste(x, fq)

    def weights(self):
        i = self.intermediate
        w1, w3 = self.w13[:, :i].detach(), self.w13[:, i:].detach()
        s13 = R.global_scale_from_amax(R.amax_of(w1, w3, dims=(1, 2)))
        fq13 = [R.dequantize(R.quantize(w, scaling=2, global_scale=s13)) for w in (w1, w3)]
        fq2 = R.dequantize(R.quantize(self.w2.detach(), scaling=2))
        return self.site(self.w13, torch.cat(fq13, 1)), self.site(self.w2, fq2)

    def input_site(self, x_TH, guidance, capture):
        return self.site(x_TH, R.dequantize(R.quantize(x_TH.detach(), scaling="row")))

    def hidden_site(self, h_AI, row_order_Tk, guidance, capture):
        canonical = h_AI.detach()[row_order_Tk.flatten()]  # token-major rows
        fq = R.dequantize(R.quantize(canonical, scaling="row"))
        return self.site(h_AI, fq[torch.argsort(row_order_Tk.flatten())])


def reference_twin(qat_model, exact=True):
    """The same weights in a BF16-expert model whose FP4 sites are `ReferenceSiteExperts`."""
    twin = tiny_model(PrecisionConfig(experts="bf16"), config=qat_model.config)
    for p in qat_model.plan.layers:
        if p.fp4:
            old = twin.layers[p.index].mlp.experts
            twin.layers[p.index].mlp.experts = ReferenceSiteExperts(
                old.num_experts, qat_model.config.hidden_size, old.intermediate, p.index
            )
            twin.layers[p.index].mlp.experts.exact = exact
    twin.load_state_dict(qat_model.state_dict())
    return twin


def test_qat_forward_equals_reference_sites_bitwise_in_fp32():
    model = tiny_model(PrecisionConfig(bf16_first_layers=1, bf16_last_layers=0))
    assert model.plan.fp4_layers == (1, 2, 3)
    twin = reference_twin(model)
    tokens = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(0))
    lens = [9, 14]
    got = model(tokens, CausalAttention(lens))
    want = twin(tokens, CausalAttention(lens))
    assert torch.equal(got, want)
    # and the FP4 sites matter: the BF16 model gives different logits
    bf16 = tiny_model(PrecisionConfig(experts="bf16"))
    bf16.load_state_dict(model.state_dict())
    assert not torch.equal(bf16(tokens, CausalAttention(lens)), got)


def test_straight_through_gradients_match_the_reference_twin():
    model = tiny_model(PrecisionConfig(bf16_first_layers=1, bf16_last_layers=0))
    twin = reference_twin(model, exact=False)
    tokens = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(1))
    for m in (model, twin):
        m(tokens, CausalAttention([12])).logsumexp(-1).sum().backward()
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert a.grad is not None and a.grad.abs().sum() > 0, name
        # The textbook estimator's forward x + (fq - x) differs from fq by FP32 rounding only,
        # so the gradients agree to FP32 precision, not bitwise.
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_router_replay_reproduces_outputs_and_counts_fallbacks():
    model = tiny_model()
    tokens = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(2))
    rec = SiteRecords()
    live = model(tokens, CausalAttention([16]), capture=rec)
    routing = torch.stack([rec.routing[i] for i in model.moe_layers])
    assert routing.shape == (3, 16, 2) and routing.dtype == torch.int32
    stats = {}
    assert torch.equal(model(tokens, CausalAttention([16]), routing=routing, stats=stats), live)
    assert stats["replay_fallback_tokens"] == 0
    partial = routing.clone()
    partial[:, 3] = -1
    stats = {}
    assert torch.equal(model(tokens, CausalAttention([16]), routing=partial, stats=stats), live)
    assert stats["replay_fallback_tokens"] == 3  # token 3 in each of 3 MoE layers
    # Forcing other experts changes the output, and the router still receives a gradient.
    forced = (routing + 1) % 8
    out = model(tokens, CausalAttention([16]), routing=forced)
    assert not torch.equal(out, live)
    out.sum().backward()
    assert model.layers[1].mlp.router.weight.grad.abs().sum() > 0


def test_replay_shape_is_checked():
    model = tiny_model()
    with pytest.raises(ValueError, match=r"routing must be an int tensor of shape \(3, 5, 2\)"):
        model(torch.zeros(5, dtype=torch.long), CausalAttention([5]), routing=torch.zeros(2, 5, 2))


def test_guidance_from_own_capture_reproduces_nearest_and_missing_sites_fail_closed():
    model = tiny_model()
    tokens = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(3))
    rec = SiteRecords()
    out = model(tokens, CausalAttention([10]), capture=rec)
    assert set(rec.sites) == {
        (i, s) for i in (1, 2, 3) for s in ("k", "v", "expert_input", "expert_hidden")
    }
    assert set(rec.sites) == model.plan.guided_keys()
    assert rec.sites[(2, "expert_hidden")].shape == (10, 2, 32)
    assert torch.equal(model(tokens, CausalAttention([10]), guidance=rec.sites), out)
    partial = {k: v for k, v in rec.sites.items() if k != (2, "expert_hidden")}
    with pytest.raises(ValueError, match="no entry for layers.2 site 'expert_hidden'"):
        model(tokens, CausalAttention([10]), guidance=partial)


def test_packed_sequences_match_separate_forwards():
    model = tiny_model(PrecisionConfig(experts="bf16"))
    a = torch.randint(0, 128, (7,))
    b = torch.randint(0, 128, (12,))
    packed = model(torch.cat([a, b]), CausalAttention([7, 12]))
    torch.testing.assert_close(packed[:7], model(a, CausalAttention([7])), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[7:], model(b, CausalAttention([12])), rtol=1e-5, atol=1e-5)


def test_plan_keeps_boundary_layers_bf16_and_prints():
    plan = resolve_plan(tiny_config(num_hidden_layers=8), PrecisionConfig(kv_cache="nvfp4"))
    assert plan.fp4_layers == (2, 3)
    assert [p.kv_cache for p in plan.layers] == ["bf16"] * 2 + ["nvfp4"] * 2 + ["bf16"] * 4
    text = str(plan)
    assert "    2  moe    nvfp4    nvfp4" in text and "    7  moe    bf16     bf16" in text


def test_eligibility_errors_name_the_problem():
    dense = tiny_config(mlp_only_layers=(0, 1, 2, 3))
    with pytest.raises(ValueError, match="needs routed experts"):
        resolve_plan(dense, PrecisionConfig())
    odd = tiny_config(moe_intermediate_size=40)
    with pytest.raises(ValueError, match="moe_intermediate_size to be a multiple of 16, got 40"):
        resolve_plan(odd, FP4_EVERYWHERE)
    with pytest.raises(ValueError, match="precision.kv_cache"):
        PrecisionConfig(kv_cache="fp8")


def test_nvfp4_that_resolves_to_no_layer_is_refused():
    """The defaults keep 2 + 4 boundary layers BF16: on a model of 6 or fewer layers they
    used to leave no FP4 layer at all, silently (guidance came back empty)."""
    with pytest.raises(
        ValueError,
        match=r"leaves no FP4 layer: of the 4 decoder layers, MoE "
        r"layers \[1, 2, 3\] .*bf16_first_layers=2, bf16_last_layers=4",
    ):
        resolve_plan(tiny_config(), PrecisionConfig())
    with pytest.raises(ValueError, match="precision.experts='bf16' leaves none"):
        resolve_plan(tiny_config(), PrecisionConfig(experts="bf16", kv_cache="nvfp4"))
    # Lowering the boundary, or asking for no FP4 at all, is fine.
    assert resolve_plan(tiny_config(), PrecisionConfig(bf16_last_layers=1)).fp4_layers == (2,)
    assert resolve_plan(tiny_config(), PrecisionConfig(experts="bf16")).fp4_layers == ()


def test_a_model_without_fp4_has_no_multiple_of_16_requirement():
    odd = tiny_config(hidden_size=60, moe_intermediate_size=40, head_dim=24)
    plan = resolve_plan(odd, PrecisionConfig(experts="bf16"))
    model = qat_model(PrecisionConfig(experts="bf16"), config=odd)
    assert plan.fp4_layers == () and model(torch.arange(5), CausalAttention([5])).shape == (5, 128)
    with pytest.raises(ValueError, match="hidden_size to be a multiple of 16, got 60"):
        resolve_plan(odd, FP4_EVERYWHERE)


def test_guidance_must_match_the_plan_layer_by_layer():
    """K/V records for a layer whose KV is BF16, or none for one whose KV is NVFP4, used to
    give a silent 0.075 / 0.174 trainer-vs-rollout logprob gap; now both name the layer."""
    bf16_kv = tiny_model(PrecisionConfig(bf16_first_layers=1, bf16_last_layers=0))
    nvfp4_kv = tiny_model(FP4_EVERYWHERE)
    nvfp4_kv.load_state_dict(bf16_kv.state_dict())
    tokens = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(4))
    with_kv, without_kv = SiteRecords(), SiteRecords()
    nvfp4_kv(tokens, CausalAttention([9]), capture=with_kv)
    bf16_kv(tokens, CausalAttention([9]), capture=without_kv)
    assert (1, "k") in with_kv.sites and (1, "k") not in without_kv.sites
    with pytest.raises(ValueError, match=r"record for layers.1 site 'k'.*kv_cache=bf16"):
        bf16_kv(tokens, CausalAttention([9]), guidance=with_kv.sites)
    with pytest.raises(ValueError, match="no entry for layers.1 site 'k'"):
        nvfp4_kv(tokens, CausalAttention([9]), guidance=without_kv.sites)
    short = {k: r.map(lambda m: m[:8]) for k, r in with_kv.sites.items()}
    with pytest.raises(ValueError, match="has 8 rows for 9 tokens"):
        nvfp4_kv(tokens, CausalAttention([9]), guidance=short)


def test_trainer_inputs_are_checked_naming_the_argument():
    model = tiny_model()
    with pytest.raises(ValueError, match="covers 7 tokens .* tokens_T has 5"):
        model(torch.arange(5), CausalAttention([3, 4]))
    with pytest.raises(ValueError, match="seq_lens must be positive lengths"):
        CausalAttention([3, 0])
    with pytest.raises(ValueError, match="tokens_T must be a 1-D int32/int64 tensor"):
        model(torch.zeros(5), CausalAttention([5]))


def test_chunked_logprobs_equal_full_softmax_and_backprop():
    lm_head = torch.nn.Linear(16, 50, bias=False)
    h = torch.randn(37, 16, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    got = token_logprobs(lm_head, h, t, chunk=8)
    want = torch.log_softmax(lm_head(h).float(), -1).gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    (g_got,) = torch.autograd.grad(got.sum(), h)
    (g_want,) = torch.autograd.grad(want.sum(), h)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-6)


def test_weight_only_trainer_quantizes_weights_and_leaves_activations_bf16():
    """The asymmetric baseline's trainer: the QAT model's weights, no activation or K/V site."""
    w4a4 = tiny_model()
    w4a16 = qat_model(FP4_EVERYWHERE, fp4_experts="qat_weights")
    w4a16.load_state_dict(w4a4.state_dict())
    tokens = torch.randint(0, 128, (11,), generator=torch.Generator().manual_seed(6))
    rec = SiteRecords()
    out = w4a16(tokens, CausalAttention([11]), capture=rec)
    assert rec.sites == {} and w4a16.guided_keys == frozenset()
    ours, theirs = w4a16.layers[1].mlp.experts, w4a4.layers[1].mlp.experts
    pairs = zip(ours.weights(), theirs.weights(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)  # the same fake-quantized weights
    assert not torch.equal(out, w4a4(tokens, CausalAttention([11])))  # activations differ
