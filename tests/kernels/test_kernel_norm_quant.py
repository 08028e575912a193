"""The residual add + RMSNorm + expert-input site kernel (`fp4rl.kernels.norm_quant`) against
the two launches it replaces, bit for bit: `rms_norm.launch_add`, then the round-to-nearest
fake quantization of its norm (`fp4rl.kernels.fake_quantize(h, scaling="row")`), itself held to
the reference (``reference.dequantize(reference.quantize(h, scaling="row"), h.dtype)``).

Rows reach the quantizer with E2M1 ties and E4M3 edges (an x of ±1 and eps 0 make the norm the
weight itself), zeros, NaN, inf and huge values. The model's forward in inference mode takes the
kernel's values for its FP4 layers' expert input and keeps its bits.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import (  # noqa: E402
    DTYPES,
    assert_bitwise,
    assert_record_equal,
    assert_same_values,
    e4m3_edge_rows,
    tie_rows,
)
from test_kernel_rms_norm import interpreted, offset_by_one, rows  # noqa: E402
from tiny_models import rollout_model  # noqa: E402

from fp4rl import kernels, ops  # noqa: E402
from fp4rl.fp4 import reference  # noqa: E402
from fp4rl.kernels import norm_quant, rms_norm  # noqa: E402
from fp4rl.kernels.launch import permuted_rows  # noqa: E402
from fp4rl.model.attention import CausalAttention  # noqa: E402
from fp4rl.rollout.capture import StepCapture  # noqa: E402


def check(x, delta, w, eps, device, what):
    """The three outputs against `launch_add` then `fake_quantize` on the same device, and the
    quantization against the reference on the CPU. Returns the kernel's h (on the CPU)."""
    x, delta, w = x.to(device), delta.to(device), w.to(device)
    s, h, h_q, none = norm_quant.launch(x, delta, w, eps)
    assert none is None
    want_s, want_h = rms_norm.launch_add(x, delta, w, eps)
    assert_same_values(s, want_s.cpu(), f"{what}: the sum")
    assert_same_values(h, want_h.cpu(), f"{what}: the norm")
    assert_same_values(h_q, kernels.fake_quantize(want_h, scaling="row").cpu(), f"{what}: site")
    want_t = reference.quantize(want_h.cpu(), scaling="row")
    want_q = reference.dequantize(want_t, x.dtype)
    assert_same_values(h_q, want_q, f"{what}: site against the reference")
    for form in ("full", "compact"):  # the site's record from the same launch
        *outs, record = norm_quant.launch(x, delta, w, eps, form)
        for got, want in zip(outs, (s, h, h_q), strict=True):
            assert_same_values(got, want.cpu(), f"{what}: outputs with a {form} record")
        assert_record_equal(record, want_t, form, f"{what}: {form} record")
    return h.cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 32), (3, 64), (2, 7, 48), (1, 16), (4, 128), (0, 64)])
def test_three_outputs_bit_for_bit(device, dtype, shape):
    x = rows(shape, dtype, seed=sum(shape), scale=3.0)
    delta = rows(shape, dtype, seed=sum(shape) + 1, scale=0.5)
    w = rows(shape[-1:], dtype, seed=2) + 1
    check(x, delta, w, 1e-6, device, f"{dtype} {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_rows(device, dtype):
    """Sums that cancel to zeros, -0 + -0, tiny rows, squares that overflow (the norm is zeros),
    sums that overflow to inf and inf - inf (NaN rows), an inf and a NaN; one weight column
    huge, so that the other blocks of a row get tiny or zero block scales."""
    big = torch.finfo(dtype).max
    x = torch.tensor(
        [
            [1.5] * 16 + [-3.0] * 16,
            [-0.0] * 32,
            [1e-30] * 31 + [-1e-30],
            [big] * 16 + [-big] * 16,
            [big] * 8 + [1.0] * 24,
            [float("inf")] + [1.0] * 31,
            [1.0] * 31 + [2.0],
            [0.25 * (i - 16) for i in range(32)],
        ]
    ).to(dtype)
    delta = torch.tensor(
        [
            [-1.5] * 16 + [3.0] * 16,
            [-0.0] * 32,
            [0.0] * 32,
            [0.0] * 32,
            [big] * 8 + [1.0] * 24,
            [-float("inf")] + [1.0] * 31,
            [0.0] * 31 + [float("nan")],
            [0.0] * 32,
        ]
    ).to(dtype)
    w = torch.linspace(-2, 2, 32)
    w[5] = big / 8  # |s * inv_rms| <= sqrt(32): the product stays finite
    w = w.to(dtype)
    h = check(x, delta, w, 1e-5, device, str(dtype))
    assert h[5].isnan().all() and h[6].isnan().all()  # non-finite rows did reach the site
    assert (h[7, 5].abs() > 1e3 * h[7, 6:].abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_quantizer_ties_and_edges(device, dtype):
    """With x = ±1 and eps 0 the inverse RMS is exactly 1 and the norm is ±weight: weights that
    put scaled values on every E2M1 tie (and an ulp beside), and block ratios on E4M3 rounding
    edges (`kernel_checks`)."""
    weights = [tie_rows(q, dtype)[0][i] for q in (-3, 4) for i in (0, 9, 17)]
    weights += [row for q in (-2, 5) for row in e4m3_edge_rows(q, dtype)]
    for i, w in enumerate(weights):
        D = w.shape[0]
        x = torch.ones(3, D, dtype=dtype)
        x[1] = -1.0
        x[2, 1::3] = -1.0
        delta = torch.zeros(3, D, dtype=dtype)
        h = check(x, delta, w, 0.0, device, f"{dtype} weight {i}")
        assert torch.equal(h, x * w), f"weight {i}: the norm is not ±weight"


@pytest.mark.parametrize(("shape", "step"), [((3, 256), 256), ((2, 5, 128), 32), ((4, 2048), 256)])
def test_permuted_site_values(device, shape, step):
    """With ``permuted_by`` the site's values are stored in `permuted_rows`' order; the sum, the
    norm and the record stay as they were."""
    x = rows(shape, torch.bfloat16, seed=sum(shape), scale=3.0).to(device)
    delta = rows(shape, torch.bfloat16, seed=sum(shape) + 1, scale=0.5).to(device)
    w = (rows(shape[-1:], torch.bfloat16, seed=2) + 1).to(device)
    want = norm_quant.launch(x, delta, w, 1e-6, "compact")
    got = norm_quant.launch(x, delta, w, 1e-6, "compact", permuted_by=step)
    assert_same_values(got[0], want[0].cpu(), "the sum")
    assert_same_values(got[1], want[1].cpu(), "the norm")
    D = shape[-1]
    permuted = permuted_rows(want[2].cpu().view(-1, D), step).view(shape)
    assert_same_values(got[2], permuted, "the site's values, permuted")
    for name in ("mantissa_bits", "block_scale", "global_scale"):
        assert_bitwise(getattr(got[3], name).cpu(), getattr(want[3], name).cpu(), name)
    with pytest.raises(ValueError, match="permuted_by must be a power of two >= 32; got 16"):
        norm_quant.launch(x, delta, w, 1e-6, permuted_by=16)


def test_checks_name_the_values(device):
    x, w = torch.ones(2, 32, device=device), torch.ones(32, device=device)
    with pytest.raises(ValueError, match=r"D a positive multiple of 16 up to 8192; got shape "
                       r"\(2, 24\)"):  # fmt: skip
        norm_quant.launch(x[:, :24].contiguous(), x[:, :24].contiguous(), w[:24], 1e-6)
    wide = torch.ones(1, 8208, device=device)
    with pytest.raises(ValueError, match=r"got shape \(1, 8208\)"):
        norm_quant.launch(wide, wide, torch.ones(8208, device=device), 1e-6)
    with pytest.raises(ValueError, match=r"delta must be torch.float32 of shape \(2, 32\) like "
                       r"x; got torch.bfloat16"):  # fmt: skip
        norm_quant.launch(x, x.to(torch.bfloat16), w, 1e-6)
    with pytest.raises(ValueError, match="must share a dtype"):
        norm_quant.launch(x, x, w.to(torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \[32\] for x of shape \(2, 32\)"):
        norm_quant.launch(x, x, w[:16], 1e-6)
    with pytest.raises(ValueError, match="x must be contiguous"):
        t = torch.ones(32, 2, device=device).t()
        norm_quant.launch(t, t.contiguous(), w, 1e-6)


def test_ops_answers_none_where_the_kernel_does_not_run(device):
    x, w = torch.ones(2, 32), torch.ones(32)
    assert ops.add_rms_norm_quantize(x, x, w, 1e-6) is None  # the CPU
    x, w = x.to(device), w.to(device)
    fused = interpreted(ops.add_rms_norm_quantize)
    assert fused(x[:, :24], x[:, :24], w[:24], 1e-6) is None  # D % 16
    assert fused(x, x.double(), w, 1e-6) is None
    assert fused(x, x[:1], w, 1e-6) is None
    s, h, h_q, record = fused(x, x, w, 1e-6)
    assert torch.equal(s, x + x) and torch.equal(h_q, kernels.fake_quantize(h, scaling="row"))
    assert record is None
    *_, record = fused(x, x, w, 1e-6, "compact")
    assert_record_equal(record, kernels.quantize(h, scaling="row"), "compact", "ops' record")


@pytest.mark.parametrize("mode", [None, "compact"])
def test_model_forward_takes_the_site_from_the_norm(monkeypatch, device, mode):
    """In inference mode each FP4 MoE layer's post-attention norm makes its experts' input
    (one fused launch per FP4 layer, trainer and rollout experts alike) and the logits keep
    their bits: against the same forward with the fused op answering None, where the norm's
    add + RMSNorm kernel runs and the experts quantize their input themselves. With a rollout
    capture keeping the expert inputs (``mode``), the records it keeps keep their bits too."""
    packed, qat = rollout_model(dtype=torch.bfloat16, device=device)
    fp4 = sum(p.fp4 for p in qat.plan.layers)
    assert fp4 > 0
    tokens = torch.tensor([3, 1, 4, 1, 5, 9], device=device)
    keep = {(p.index, "expert_input") for p in qat.plan.layers if p.fp4}
    for model in (qat, packed):
        out, calls, kept = {}, {}, {}
        for fused in (True, False):
            capture = None
            if mode is not None:
                capture = StepCapture(routing=False, guidance=mode, keep=keep)
            calls[fused] = []
            with monkeypatch.context() as m:
                for name in ("rms_norm", "add_rms_norm", "add_rms_norm_quantize"):
                    op = interpreted(getattr(ops, name))
                    if name == "add_rms_norm_quantize" and not fused:
                        op = lambda *args: None  # noqa: E731

                    def run(*args, name=name, op=op, seen=calls[fused]):
                        seen.append(name)
                        return op(*args)

                    m.setattr(ops, name, run)
                with torch.inference_mode():
                    attn = CausalAttention([4, 2], device=device)
                    out[fused] = model(tokens, attn, capture=capture)
                kept[fused] = {} if capture is None else capture.sites
        assert calls[True].count("add_rms_norm_quantize") == fp4
        assert calls[False].count("add_rms_norm") == calls[True].count("add_rms_norm") + fp4
        assert_same_values(out[True], out[False].cpu(), type(model).__name__)
        assert set(kept[True]) == set(kept[False]) == (keep if mode else set())
        for key, record in kept[False].items():
            got = kept[True][key]
            for name in ("mantissa_bits", "block_scale", "global_scale"):
                assert_bitwise(getattr(got, name).cpu(), getattr(record, name).cpu(), str(key))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("R", [1, 64, 256])
def test_real_shapes_on_gpu(dtype, R):
    """Qwen3-30B-A3B's hidden rows (2048) at decode and prefill batch sizes; also with x and
    delta one element past an aligned address."""
    x = rows((R, 2048), dtype, seed=R, scale=2.0)
    delta = rows((R, 2048), dtype, seed=R + 1, scale=0.5)
    w = rows((2048,), dtype, seed=5) + 1
    check(x, delta, w, 1e-6, "cuda", f"{dtype} R={R}")
    check(offset_by_one(x), offset_by_one(delta), w, 1e-6, "cuda", f"{dtype} R={R} offset")
