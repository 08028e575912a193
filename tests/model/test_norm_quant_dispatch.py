"""Where the model asks `fp4rl.ops.add_rms_norm_quantize` for the post-attention add + RMSNorm
with its FP4 layer's expert-input site (`fp4rl.kernels.norm_quant`): only where no gradient is
recorded and that site rounds to nearest with nobody keeping its record; and what the experts
do with its answer. Off the GPU the op answers None; here it is also made to answer with the
unfused results, which must leave the logits' bits as they are."""

import dataclasses

import pytest
import torch
from tiny_models import FP4_EVERYWHERE, packed_twin, qat_model

from fp4rl import ops
from fp4rl.model.attention import CausalAttention
from fp4rl.model.layers import eager_rms_norm
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.sites import SiteRecords

TOKENS = torch.tensor([3, 1, 4, 1, 5, 9])


def attn():
    return CausalAttention([4, 2])


def model_of(fp4_experts: str, precision: PrecisionConfig = FP4_EVERYWHERE, dtype=torch.float32):
    """The trainer's model ("qat") or the rollout's ("packed", the same weights)."""
    qat = qat_model(precision, dtype=dtype)
    return qat if fp4_experts == "qat" else packed_twin(qat, precision)


def unfused(x, delta, weight, eps):
    """What the layer computes without the fused kernel on the CPU: torch's add, the eager
    RMSNorm and the site's round-to-nearest fake quantization."""
    s = x + delta
    h = eager_rms_norm(s, weight, eps)
    return s, h, ops.fake_quantize(h, scaling="row")


@pytest.fixture
def asked(monkeypatch):
    """``asked(answer) -> calls``: the op records each call's inputs and answers ``answer(x,
    delta, weight, eps)``."""

    def use(answer):
        calls = []

        def op(x, delta, weight, eps):
            calls.append(x)
            return answer(x, delta, weight, eps)

        monkeypatch.setattr(ops, "add_rms_norm_quantize", op)
        return calls

    return use


class KeepsOne(SiteRecords):
    """A capture that keeps the expert input of one layer alone."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer

    def records(self, layer: int, site: str) -> bool:
        return (layer, site) == (self.layer, "expert_input")


@pytest.mark.parametrize("fp4_experts", ["qat", "packed"])
def test_asked_once_per_fp4_moe_layer_without_gradients(asked, fp4_experts):
    """Once per FP4 MoE layer in inference mode and without autograd (the trainer's
    observation); never under autograd. BF16 MoE layers never ask."""
    model = model_of(fp4_experts, PrecisionConfig(bf16_first_layers=2, bf16_last_layers=0))
    fp4 = [p.index for p in model.plan.layers if p.fp4]
    assert fp4 == [2, 3] and 1 in model.moe_layers  # layer 1: a BF16 MoE layer
    calls = asked(lambda *args: None)
    with torch.inference_mode():
        model(TOKENS, attn())
    assert len(calls) == len(fp4)
    with torch.no_grad():
        model(TOKENS, attn())
    assert len(calls) == 2 * len(fp4)
    if fp4_experts == "qat":  # parameters that want gradients
        model(TOKENS, attn()).sum().backward()
        assert len(calls) == 2 * len(fp4)


def test_not_asked_where_the_site_is_guided_or_recorded(asked):
    """Guidance for the expert input, or a capture that keeps it: not asked for those layers.
    Guidance the plan does not let the expert input follow, or a capture that keeps nothing of
    it: asked."""
    model = qat_model()
    moe = len(model.moe_layers)
    records = SiteRecords()
    with torch.inference_mode():
        model(TOKENS, attn(), capture=records)
    assert (model.moe_layers[0], "expert_input") in records.sites
    calls = asked(lambda *args: None)
    with torch.inference_mode():
        model(TOKENS, attn(), capture=SiteRecords())
        model(TOKENS, attn(), guidance=records.sites)
        assert calls == []
        model(TOKENS, attn(), capture=KeepsOne(model.moe_layers[0]))
        assert len(calls) == moe - 1
    plan = dataclasses.replace(FP4_EVERYWHERE, guided_sites=("expert_hidden", "k", "v"))
    unguided_input = qat_model(plan)
    guidance = {k: v for k, v in records.sites.items() if k[1] != "expert_input"}
    with torch.inference_mode():
        unguided_input(TOKENS, attn(), guidance=guidance)
    assert len(calls) == 2 * moe - 1


@pytest.mark.parametrize("fp4_experts", ["qat", "packed"])
def test_the_experts_take_the_site_values_it_answers(asked, fp4_experts):
    """Answering with the unfused results leaves the logits' bits unchanged; answering with the
    norm itself as the site's values (no quantization) changes them: the experts take what
    the op gives in place of their own input site, and the router still reads the norm."""
    model = model_of(fp4_experts, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = model(TOKENS, attn())
        calls = asked(unfused)
        got = model(TOKENS, attn())
        assert len(calls) == len(model.moe_layers)
        assert torch.equal(got, want)
        asked(lambda *args: unfused(*args)[:2] + unfused(*args)[1:2])
        assert not torch.equal(model(TOKENS, attn()), want)
