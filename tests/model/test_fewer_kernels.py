"""Formulations that launch fewer kernels per decoder layer give the bits of the ones they replace.

The previous formulations (`previous_formulations.py`) are the references; the new ones now
launch fewer kernels (the residual adds inside the norms, one kernel with them on the GPU).
Each new one is held to its reference bitwise on many random inputs (special values included),
outputs and gradients, and the whole model -- the engine's generation with its records, the
trainer's logprobs and gradients under its three attention backends -- is held to the model
running the references.
"""

import dataclasses

import pytest
import torch
from previous_formulations import (
    install,
    reference_apply_rope,
    reference_hidden_states,
    reference_paged_attend,
    reference_rmsnorm,
)
from tiny_models import FP4_EVERYWHERE, engine_config, packed_twin, qat_model, tiny_precision
from torch.utils._python_dispatch import TorchDispatchMode

from fp4rl.model.attention import Bf16KV, CausalAttention, NewKV, Nvfp4KV
from fp4rl.model.layers import RMSNorm, RopeTables, apply_rope, op_to, rope_cos_sin
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.transformer import MoETransformer
from fp4rl.records import collate
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.rollout.attention import AttentionMetadata, PagedAttention, Segment
from fp4rl.rollout.kv_cache import KVCache, KVCacheSpec
from fp4rl.train.policy import policy_logprobs

DTYPES = (torch.bfloat16, torch.float32, torch.float16)


@pytest.fixture
def references(monkeypatch):
    """Run the model with the previous formulations once the test calls it."""
    return lambda: install(monkeypatch)


# -- helpers ---------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, zeros' signs included; every NaN as one canonical NaN: IEEE leaves
    the sign and payload of an arithmetic NaN open (x86 passes an operand's on, CUDA gives a
    canonical one), so a NaN is held to be a NaN, not to a sign bit."""
    t = t.detach()
    if t.is_floating_point():
        t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    return t.contiguous().view(torch.uint8)


def assert_bitwise(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bitwise(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bitwise(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))
    elif dataclasses.is_dataclass(a):
        assert_bitwise(dataclasses.astuple(a), dataclasses.astuple(b))
    else:
        assert a == b


def awkward(shape, dtype, g) -> torch.Tensor:
    """Random values over many binades, with zeros of both signs, ties and extremes."""
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g))
    flat = x.view(-1)
    n = flat.numel()
    picks = torch.randperm(n, generator=g)
    flat[picks[: n // 16]] = 0.0
    flat[picks[n // 16 : n // 8]] = -0.0
    flat[picks[n // 8 : n // 8 + 4]] = torch.tensor([1.0, -1.0, 3.0e4, -1.0e-30])
    return x.to(dtype)


# -- the pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (5, 4, 16), (3, 2, 128)])
def test_rmsnorm_matches_its_reference_bitwise(dtype, shape):
    g = torch.Generator().manual_seed(shape[-1] + len(shape))
    norm = RMSNorm(shape[-1], 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=g))
    for trial in range(20):
        x = awkward(shape, dtype, g)
        if trial == 0:
            x[0] = 0.0  # a row of zeros: eps alone under the root
        if trial == 1:
            x.view(-1)[::7] = float("inf")
        with torch.no_grad():  # out= rounds in the product's kernel
            assert_bitwise(norm(x), reference_rmsnorm(norm, x))
        with torch.inference_mode():
            assert_bitwise(norm(x), reference_rmsnorm(norm, x))
        # Recorded by autograd: values and gradients.
        outs, grads = [], []
        for forward in (RMSNorm.forward, reference_rmsnorm):
            xg = x.clone().requires_grad_(True)
            norm.weight.grad = None
            y = forward(norm, xg)
            y.backward(torch.ones_like(y) + 0.5 * (x != 0))
            outs.append(y)
            grads.append((xg.grad, norm.weight.grad))
        assert_bitwise(outs[0], outs[1])
        assert_bitwise(grads[0], grads[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [torch.mul, torch.div])
def test_op_to_is_the_op_then_the_cast(dtype, op):
    g = torch.Generator().manual_seed(1)
    for a_shape, b_shape in [((8, 64), (8, 1)), ((3, 4, 16), (16,)), ((5,), (5,))]:
        a, b = awkward(a_shape, torch.float32, g), awkward(b_shape, torch.float32, g)
        with torch.no_grad():
            assert_bitwise(op_to(op, a, b, dtype), op(a, b).to(dtype))
        ag = a.clone().requires_grad_(True)
        out = op_to(op, ag, b, dtype)
        assert out.requires_grad and out.dtype == dtype
        assert_bitwise(out, op(a, b).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, theta", [(16, 1e4), (64, 1e6), (128, 1e6)])
def test_rope_tables_and_apply_match_their_reference_bitwise(dtype, head_dim, theta):
    g = torch.Generator().manual_seed(head_dim)
    T, H = 37, 3
    positions = torch.cat([torch.arange(9), torch.randint(0, 40000, (T - 9,), generator=g)])
    tables = RopeTables(positions, head_dim, theta, dtype)
    cos, signed_sin = tables.cos, tables.signed_sin
    ref_cos, ref_sin = rope_cos_sin(positions, head_dim, theta, dtype)
    assert_bitwise(cos, ref_cos)
    half = head_dim // 2
    assert_bitwise(signed_sin, torch.cat((-ref_sin[:, :half], ref_sin[:, half:]), -1))
    for _ in range(10):
        x = awkward((T, H, head_dim), dtype, g)
        upstream = awkward((T, H, head_dim), dtype, g)
        with torch.no_grad():
            new = apply_rope(x, cos, signed_sin)
            assert_bitwise(new, reference_apply_rope(x, ref_cos, ref_sin))
        outs, grads = [], []
        for rope, args in (
            (apply_rope, (cos, signed_sin)),
            (reference_apply_rope, (ref_cos, ref_sin)),
        ):
            xg = x.clone().requires_grad_(True)
            y = rope(xg, *args)
            y.backward(upstream)
            outs.append(y)
            grads.append(xg.grad)
        assert_bitwise(outs[0], outs[1])
        assert_bitwise(grads[0], grads[1])


def attention_steps():
    """Steps of three sequences: prefills beside decodes, then decodes alone."""
    tables = {"a": [9, 2, 14, 5], "b": [0, 11, 7, 3], "c": [12, 1, 8, 15]}
    steps = [
        [("a", 0, 6), ("b", 0, 3)],
        [("a", 6, 1), ("c", 0, 5), ("b", 3, 1)],
        [("a", 7, 1), ("b", 4, 1), ("c", 5, 1)],
        [("b", 5, 1)],
        [("c", 6, 1), ("a", 8, 1)],
    ]
    return [[Segment(tables[s], start, n) for s, start, n in step] for step in steps]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_of_decodes_alone_matches_gather_and_scatter(dtype):
    g = torch.Generator().manual_seed(3)
    spec = KVCacheSpec(layer_formats=("bf16", "nvfp4"), num_kv_heads=2, head_dim=32, dtype=dtype)
    caches = [KVCache(spec, num_blocks=16, block_size=4, device="cpu") for _ in range(2)]
    formats = (Bf16KV(), Nvfp4KV(1, ()))
    for segments in attention_steps():
        meta = AttentionMetadata.build(segments, 4, "cpu")
        T = meta.positions_T.numel()
        rows = [i for i, s in enumerate(segments) if s.num_new == 1]
        if len(rows) == len(segments):  # decodes alone: rows 0..T-1, in order
            assert torch.equal(meta.decode_rows_B, torch.arange(T))
        assert meta.decode_context_B.dtype == torch.int32
        for layer in range(2):
            q, k, v = (awkward((T, h, 32), dtype, g) for h in (4, 2, 2))
            new = PagedAttention(caches[0], meta).attend(layer, q, NewKV(k, v, formats[layer]))
            ref = reference_paged_attend(
                PagedAttention(caches[1], meta), layer, q, NewKV(k, v, formats[layer])
            )
            assert_bitwise(new, ref)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert_bitwise(list(a.tensors()), list(b.tensors()))


# -- the whole model -------------------------------------------------------------------------


def generate_and_score(qat, precision, guidance):
    """The engine's completions and records, then the trainer's logprobs and gradients under
    each of its attention backends (replayed routing, guided rounding)."""
    packed = packed_twin(qat, precision)
    engine = Engine(packed, engine_config(guidance=guidance, capture_routing=True))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 11]
    completions = engine.generate(prompts, SamplingParams(n=2, max_tokens=10, seed=3))
    out = {"completions": completions}
    batch = collate(completions)
    for forward in ("packed", "packed_fp32", "engine"):
        qat.zero_grad(set_to_none=True)
        logp = policy_logprobs(qat, batch, forward=forward)
        logp.sum().backward()
        grads = {n: p.grad for n, p in qat.named_parameters() if p.grad is not None}
        out[forward] = (logp, grads)
    return out


@pytest.mark.parametrize(
    "dtype, precision, guidance",
    [
        (torch.bfloat16, FP4_EVERYWHERE, "full"),
        (torch.bfloat16, tiny_precision("nvfp4"), "compact"),
        (torch.float32, tiny_precision("bf16"), "full"),
    ],
)
def test_model_matches_the_previous_formulations(references, dtype, precision, guidance):
    qat = qat_model(precision, dtype=dtype)
    new = generate_and_score(qat, precision, guidance)
    references()
    ref = generate_and_score(qat, precision, guidance)
    assert_bitwise(new, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_residual_adds_inside_the_norms_keep_the_model_bitwise(dtype):
    """The layers handing their MLP output to the next norm to add (`RMSNorm.sum_and_norm`)
    give the logits of each layer adding it itself, in inference mode, without gradients and
    with them (the gradients too), under replayed routing and with none."""
    model = qat_model(tiny_precision("nvfp4"), dtype=dtype)
    tokens = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    c, g = model.config, torch.Generator().manual_seed(4)
    shape = (len(model.moe_layers), 7, c.num_experts_per_tok)
    routing = torch.randint(-1, c.num_experts, shape, generator=g)  # -1: no record, live
    for replay in (None, routing):
        for mode in (torch.inference_mode, torch.no_grad):
            with mode():
                new = model(tokens, CausalAttention([4, 3]), routing=replay)
                h = reference_hidden_states(model, tokens, CausalAttention([4, 3]), routing=replay)
                assert_bitwise(new, model.logits(h))
        outs = []
        for hidden_states in (MoETransformer.hidden_states, reference_hidden_states):
            model.zero_grad(set_to_none=True)
            h = hidden_states(model, tokens, CausalAttention([4, 3]), routing=replay)
            logits = model.logits(h)
            logits.logsumexp(-1).sum().backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            outs.append((logits, grads))
        assert outs[0][1]  # gradients reached the parameters
        assert_bitwise(outs[0], outs[1])


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_rope_tables_are_computed_once_per_forward():
    model = qat_model(PrecisionConfig(experts="bf16"), dtype=torch.bfloat16)
    assert len(model.layers) > 1
    with torch.no_grad(), Ops() as seen:
        model.hidden_states(torch.tensor([1, 2, 3, 4, 5, 6]), CausalAttention([4, 2]))
    # One cos, one sin, one negation (the signed sin) per forward; none per layer.
    assert [seen.names.count(f"aten::{op}") for op in ("cos", "sin", "neg")] == [1, 1, 1]
