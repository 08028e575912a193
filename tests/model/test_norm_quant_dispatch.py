"""Where the model asks `fp4rl.ops.add_rms_norm_quantize` for the post-attention add + RMSNorm
with its FP4 layer's expert-input site (`fp4rl.kernels.norm_quant`): only where no gradient is
recorded and that site rounds to nearest, with the site's record in the form the capture keeps
where it keeps one; and what the experts do with its answer. Off the GPU the op answers None;
here it is also made to answer with the unfused results, which must leave the logits' and the
records' bits as they are."""

import dataclasses

import pytest
import torch
from tiny_models import FP4_EVERYWHERE, packed_twin, qat_model

from fp4rl import ops
from fp4rl.model.attention import CausalAttention
from fp4rl.model.layers import eager_rms_norm
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.sites import SiteRecords
from fp4rl.rollout.capture import StepCapture

TOKENS = torch.tensor([3, 1, 4, 1, 5, 9])


def attn():
    return CausalAttention([4, 2])


def model_of(fp4_experts: str, precision: PrecisionConfig = FP4_EVERYWHERE, dtype=torch.float32):
    """The trainer's model ("qat") or the rollout's ("packed", the same weights)."""
    qat = qat_model(precision, dtype=dtype)
    return qat if fp4_experts == "qat" else packed_twin(qat, precision)


def unfused(x, delta, weight, eps, record=None):
    """What the layer computes without the fused kernel on the CPU: torch's add, the eager
    RMSNorm, the site's round-to-nearest fake quantization and, asked for, its record."""
    s = x + delta
    h = eager_rms_norm(s, weight, eps)
    t = None if record is None else ops.quantize(h, scaling="row")
    if record == "compact":
        t = ops.compact(t)
    return s, h, ops.fake_quantize(h, scaling="row"), t


@pytest.fixture
def asked(monkeypatch):
    """``asked(answer) -> calls``: the op records each call's ``(x, record)`` and answers
    ``answer(x, delta, weight, eps, record)``; no call asks for rows permuted for the experts'
    GEMM (the CPU's GEMM reads them in real order)."""

    def use(answer):
        calls = []

        def op(x, delta, weight, eps, record=None, permuted_by=None):
            assert permuted_by is None
            calls.append((x, record))
            return answer(x, delta, weight, eps, record)

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


def test_asked_for_the_record_a_capture_keeps_and_not_where_guided(asked):
    """A capture that keeps the expert input: asked with its record form in those layers (None
    in the others). A capture that keeps values too (sparse guidance), or guidance for the
    expert input: not asked for those layers. Guidance the plan does not let the expert input
    follow: asked."""
    model = qat_model()
    moe = model.moe_layers
    records = SiteRecords()
    with torch.inference_mode():
        model(TOKENS, attn(), capture=records)
    assert (moe[0], "expert_input") in records.sites
    calls = asked(lambda *args: None)
    with torch.inference_mode():
        model(TOKENS, attn(), capture=SiteRecords())
        assert [form for _, form in calls] == ["full"] * len(moe)
        calls.clear()
        model(TOKENS, attn(), capture=KeepsOne(moe[0]))
        assert [form for _, form in calls] == ["full"] + [None] * (len(moe) - 1)
        calls.clear()
        sparse = StepCapture(routing=False, guidance="sparse", keep=set(records.sites),
                             sparse_delta=0.5)  # fmt: skip
        model(TOKENS, attn(), capture=sparse)
        model(TOKENS, attn(), guidance=records.sites)
        assert calls == []
    plan = dataclasses.replace(FP4_EVERYWHERE, guided_sites=("expert_hidden", "k", "v"))
    unguided_input = qat_model(plan)
    guidance = {k: v for k, v in records.sites.items() if k[1] != "expert_input"}
    with torch.inference_mode():
        unguided_input(TOKENS, attn(), guidance=guidance)
    assert len(calls) == len(moe)


@pytest.mark.parametrize("mode", ["full", "compact"])
def test_the_records_it_answers_are_the_sites_records(asked, mode):
    """A rollout capture keeping every site: the records the op makes (here the unfused ones)
    are kept as the site's own, bitwise what the layers record where the op answers None."""
    model = model_of("packed", dtype=torch.bfloat16)
    keep = {(layer, "expert_input") for layer in model.moe_layers}

    def forward(answer):
        asked(answer)
        capture = StepCapture(routing=False, guidance=mode, keep=keep)
        with torch.inference_mode():
            logits = model(TOKENS, attn(), capture=capture)
        return logits, capture.sites

    want_logits, want = forward(lambda *args: None)
    got_logits, got = forward(unfused)
    assert torch.equal(got_logits, want_logits) and set(got) == set(want) == keep
    for key, record in want.items():
        kind = type(record)
        assert isinstance(got[key], kind)
        for name in ("block_scale", "global_scale"):
            assert torch.equal(getattr(got[key], name).view(torch.uint8),
                               getattr(record, name).view(torch.uint8))  # fmt: skip
        bits = "mantissa_bits" if mode == "compact" else "codes"
        assert torch.equal(getattr(got[key], bits), getattr(record, bits))


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
        asked(lambda *args: unfused(*args)[:2] + unfused(*args)[1:2] + (None,))
        assert not torch.equal(model(TOKENS, attn()), want)
