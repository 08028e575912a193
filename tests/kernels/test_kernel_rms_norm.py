"""The RMSNorm kernel against the eager formulation it replaces on the GPU
(`fp4rl.model.layers.eager_rms_norm`).

The two differ only in the order of one FP32 sum per row (and, in the CPU interpreter, in how
numpy and torch compute rsqrt), so the inverse RMS may move by an ulp or two and an output by
one unit in its last place, with rounding twice (x * inv_rms, then the weight product) at most
two. Each output is held to that, and most outputs to equality. Results do not depend on the
batch a row is in.

The kernel with the residual add before it (`launch_add`) is held to torch's add, then this
kernel, bit for bit, and the model's forward to the same with and without it.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import DTYPES, assert_same_values  # noqa: E402
from tiny_models import qat_model  # noqa: E402

from fp4rl import kernels, ops  # noqa: E402
from fp4rl.kernels import rms_norm  # noqa: E402
from fp4rl.model.attention import CausalAttention  # noqa: E402
from fp4rl.model.layers import RMSNorm, _KernelRMSNorm, eager_rms_norm  # noqa: E402
from fp4rl.model.precision import PrecisionConfig  # noqa: E402


def rows(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def assert_close_to_eager(got, x, w, eps, what, *, most_equal=0.99):
    want = eager_rms_norm(x, w, eps)
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN positions differ"
    ok = ~want.isnan()
    got, want = got[ok].double(), want[ok].double()
    ulp = torch.finfo(x.dtype).eps * want.abs().clamp_min(torch.finfo(x.dtype).tiny)
    excess = (got - want).abs() - 2 * ulp
    assert not (excess > 0).any(), f"{what}: off by more than two ulps ({float(excess.max())})"
    equal = (got == want).double().mean() if got.numel() else 1.0
    assert equal >= most_equal, f"{what}: only {float(equal):.3f} of the outputs equal"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 16), (3, 100), (2, 7, 128), (1, 1), (4, 3), (0, 64)])
def test_close_to_the_eager_norm(device, dtype, shape):
    x = rows(shape, dtype, seed=sum(shape), scale=3.0)
    w = rows(shape[-1:], dtype, seed=1) + 1
    got = rms_norm.launch(x.to(device), w.to(device), 1e-6)
    # A few elements per row: one flipped output is a large share of a tiny tensor. FP32
    # outputs keep every bit of x * inv_rms, so an inverse RMS an ulp apart shows in its whole
    # row: for them only the bound holds.
    most_equal = 0.0 if dtype == torch.float32 else 0.75
    assert_close_to_eager(got, x, w, 1e-6, f"{dtype} {shape}", most_equal=most_equal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_rows(device, dtype):
    """Zeros (the inverse RMS is 1 / sqrt(eps)), tiny and huge rows (squares that underflow or
    overflow to inf: the row becomes zeros, or NaN where x is inf), an inf and a NaN."""
    big = torch.finfo(dtype).max
    x = torch.tensor(
        [
            [0.0] * 16,
            [1e-30] * 15 + [-1e-30],
            [big] * 8 + [-big] * 8,
            [1.0] * 15 + [float("inf")],
            [1.0] * 15 + [float("nan")],
            [-0.0] * 8 + [3.0] * 8,
        ]
    ).to(dtype)
    w = torch.linspace(-2, 2, 16).to(dtype)
    got = rms_norm.launch(x.to(device), w.to(device), 1e-5)
    most_equal = 0.0 if dtype == torch.float32 else 0.95  # as in test_close_to_the_eager_norm
    assert_close_to_eager(got, x, w, 1e-5, str(dtype), most_equal=most_equal)
    assert got[4].isnan().all()


def test_a_row_does_not_depend_on_its_batch(device):
    x = rows((33, 2048), torch.bfloat16, seed=3, scale=3.0).to(device)
    w = (rows((2048,), torch.bfloat16, seed=4) + 1).to(device)
    batch = rms_norm.launch(x, w, 1e-6)
    for r in (0, 17, 32):
        assert torch.equal(rms_norm.launch(x[r : r + 1].contiguous(), w, 1e-6)[0], batch[r])
    assert_close_to_eager(batch, x.cpu(), w.cpu(), 1e-6, "64 x 2048")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gradients_are_the_eager_formulations(device, dtype):
    """Where autograd records (the trainer), `RMSNorm` takes the kernel's values forward (on the
    GPU) and the eager formulation's gradients backward, for x and the weight."""
    x = rows((6, 32), dtype, seed=7, scale=2.0).to(device)
    norm = RMSNorm(32, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(rows((32,), dtype, seed=8) + 1)
    grad = rows((6, 32), dtype, seed=9).to(device)
    x1 = x.clone().requires_grad_()
    norm(x1).backward(grad)
    x2, w2 = x.clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    eager_rms_norm(x2, w2, 1e-6).backward(grad)
    assert torch.equal(x1.grad, x2.grad) and torch.equal(norm.weight.grad, w2.grad)
    # The autograd function itself, which `RMSNorm` takes on the GPU only.
    x3, w3 = x.clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    _KernelRMSNorm.apply(x3, w3, 1e-6).backward(grad)
    assert torch.equal(x3.grad, x2.grad) and torch.equal(w3.grad, w2.grad)


def test_checks_name_the_values(device):
    x = torch.ones(2, 16, device=device)
    with pytest.raises(ValueError, match="must share a dtype"):
        rms_norm.launch(x, torch.ones(16, dtype=torch.bfloat16, device=device), 1e-6)
    with pytest.raises(ValueError, match=r"weight must be \[16\] for x of shape \(2, 16\); got"):
        rms_norm.launch(x, torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="x must be contiguous"):
        rms_norm.launch(torch.ones(16, 2, device=device).t(), torch.ones(16, device=device), 1e-6)


# -- the residual add before the norm (`launch_add`) -----------------------------------------


def check_add(x, delta, w, eps, device, what):
    """`launch_add` against torch's ``x + delta`` on the same device, then `launch` of that
    sum."""
    x, delta, w = x.to(device), delta.to(device), w.to(device)
    s, y = rms_norm.launch_add(x, delta, w, eps)
    want_s = x + delta
    assert_same_values(s, want_s.cpu(), f"{what}: the sum")
    assert_same_values(y, rms_norm.launch(want_s, w, eps).cpu(), f"{what}: the norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(5, 16), (3, 100), (2, 7, 128), (1, 1), (4, 3), (2, 48), (3, 1000), (0, 64)]
)
def test_add_then_norm_bit_for_bit(device, dtype, shape):
    x = rows(shape, dtype, seed=sum(shape), scale=3.0)
    delta = rows(shape, dtype, seed=sum(shape) + 1, scale=0.5)
    w = rows(shape[-1:], dtype, seed=2) + 1
    check_add(x, delta, w, 1e-6, device, f"{dtype} {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_then_norm_of_special_rows(device, dtype):
    """Sums that cancel to zeros (the inverse RMS is 1 / sqrt(eps)), -0 + -0, ties of the
    sum's rounding, sums that overflow to inf, inf - inf (NaN), an inf and a NaN."""
    big, ulp = torch.finfo(dtype).max, torch.finfo(dtype).eps
    x = torch.tensor(
        [
            [1.5] * 8 + [-3.0] * 8,
            [-0.0] * 8 + [2.0] * 8,
            [1.0] * 16,
            [big] * 8 + [1.0] * 8,
            [float("inf")] + [1.0] * 15,
            [1.0] * 15 + [2.0],
            [1e-30] * 15 + [-1e-30],
        ]
    ).to(dtype)
    delta = torch.tensor(
        [
            [-1.5] * 8 + [3.0] * 8,
            [-0.0] * 8 + [1.0] * 8,
            [ulp / 2, 3 * ulp / 2, -ulp / 4, ulp / 4] * 4,  # ties to even, both ways
            [big] * 8 + [1.0] * 8,
            [-float("inf")] + [1.0] * 15,
            [0.0] * 15 + [float("nan")],
            [1e-30] * 16,
        ]
    ).to(dtype)
    w = torch.linspace(-2, 2, 16).to(dtype)
    check_add(x, delta, w, 1e-5, device, str(dtype))


def test_add_checks_name_the_values(device):
    x, w = torch.ones(2, 16, device=device), torch.ones(16, device=device)
    with pytest.raises(ValueError, match=r"delta must be torch.float32 of shape \(2, 16\) like x; "
                       r"got torch.bfloat16 of shape \(2, 16\)"):  # fmt: skip
        rms_norm.launch_add(x, x.to(torch.bfloat16), w, 1e-6)
    with pytest.raises(ValueError, match=r"got torch.float32 of shape \(16,\)"):
        rms_norm.launch_add(x, x[0], w, 1e-6)
    with pytest.raises(ValueError, match="must share a dtype"):
        rms_norm.launch_add(x, x, w.to(torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="delta must be contiguous"):
        rms_norm.launch_add(x, torch.ones(16, 2, device=device).t(), w, 1e-6)


def test_ops_leaves_the_cpu_to_the_caller():
    x = torch.ones(2, 16)
    assert ops.add_rms_norm(x, x, torch.ones(16), 1e-6) is None


def interpreted(op):
    """``op`` (an `fp4rl.ops` function) with CPU tensors sent to the kernels too: under the
    interpreter here, as CUDA tensors are on the GPU."""

    def run(*args):
        real = ops._kernels
        ops._kernels = lambda x: kernels
        try:
            return op(*args)
        finally:
            ops._kernels = real

    return run


def use_kernels(monkeypatch, device, *, fused=True) -> list[str]:
    """Route `ops.rms_norm` and `ops.add_rms_norm` to the kernels (CPU tensors too, under the
    interpreter), or ``add_rms_norm`` to None (the caller adds, then norms) where not
    ``fused``; returns the list their calls are recorded in, by name."""
    calls = []
    for name in ("rms_norm", "add_rms_norm"):
        op = getattr(ops, name)
        if device == "cpu":
            op = interpreted(op)
        if name == "add_rms_norm" and not fused:
            op = lambda *args: None  # noqa: E731

        def run(*args, name=name, op=op):
            calls.append(name)
            return op(*args)

        monkeypatch.setattr(ops, name, run)
    return calls


def test_sum_and_norm_takes_the_kernel_outside_autograd(device, monkeypatch):
    """`RMSNorm.sum_and_norm` without autograd: the fused kernel; with hooks on the module, the
    add then the call, which the hooks see; with autograd, the add then the call, with the
    eager formulation's gradients. The same values every way."""
    dtype = torch.bfloat16
    x, delta = (rows((6, 48), dtype, seed=s, scale=2.0).to(device) for s in (10, 11))
    norm = RMSNorm(48, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(rows((48,), dtype, seed=12) + 1)
    want_s = x + delta
    want_y = rms_norm.launch(want_s, norm.weight.detach(), 1e-6).cpu()
    calls = use_kernels(monkeypatch, device)
    with torch.inference_mode():
        s, y = norm.sum_and_norm(x, delta)
    assert calls == ["add_rms_norm"]
    assert_same_values(s, want_s.cpu(), "sum")
    assert_same_values(y, want_y, "norm")
    seen = []
    handle = norm.register_forward_hook(lambda module, args, out: seen.append((args[0], out)))
    with torch.no_grad():
        s, y = norm.sum_and_norm(x, delta)
    handle.remove()
    assert calls == ["add_rms_norm", "rms_norm"] and len(seen) == 1
    assert seen[0][0] is s and seen[0][1] is y
    assert_same_values(y, want_y, "norm, hooked")
    x1, d1 = x.clone().requires_grad_(), delta.clone().requires_grad_()
    s, y = norm.sum_and_norm(x1, d1)
    grad = rows((6, 48), dtype, seed=13).to(device)
    y.backward(grad)
    assert "add_rms_norm" not in calls[2:]
    assert_same_values(y.detach(), want_y, "norm, with autograd")
    x2, d2 = x.clone().requires_grad_(), delta.clone().requires_grad_()
    w2 = norm.weight.detach().clone().requires_grad_()
    eager_rms_norm(x2 + d2, w2, 1e-6).backward(grad)
    assert torch.equal(x1.grad, x2.grad) and torch.equal(d1.grad, d2.grad)
    assert torch.equal(norm.weight.grad, w2.grad)


def test_model_forward_is_unchanged_by_the_fused_add(device, monkeypatch):
    """The tiny model's hidden states in inference mode with the residual adds inside the
    norms' kernel equal those of torch's adds then the RMSNorm kernel, bit for bit: two fused
    launches per layer (the first layer's input norm has no add before it, the final norm
    has one), each in place of an RMSNorm launch."""
    model = qat_model(PrecisionConfig(experts="bf16"), dtype=torch.bfloat16, device=device)
    L = len(model.layers)
    tokens = torch.tensor([1, 2, 3, 4, 5, 6], device=device)
    out, calls = {}, {}
    for fused in (True, False):
        with monkeypatch.context() as m:
            calls[fused] = use_kernels(m, device, fused=fused)
            with torch.inference_mode():
                out[fused] = model.hidden_states(tokens, CausalAttention([4, 2], device=device))
        assert calls[fused].count("add_rms_norm") == 2 * L
    assert calls[False].count("rms_norm") == calls[True].count("rms_norm") + 2 * L
    assert_same_values(out[True], out[False].cpu(), "final hidden states")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 2048), (64, 2048), (256, 2048), (64, 32, 128), (4096, 2048)])
def test_real_shapes_on_gpu(shape):
    """Against the eager formulation on the same GPU (the same rsqrt): only the sum's order."""
    x = rows(shape, torch.bfloat16, seed=shape[0], scale=2.0).cuda()
    w = (rows(shape[-1:], torch.bfloat16, seed=5) + 1).cuda()
    got = rms_norm.launch(x, w, 1e-6)
    want = eager_rms_norm(x, w, 1e-6)
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
    assert not ((got.float() - want.float()).abs() > 2 * ulp).any()
    assert (got == want).float().mean() > 0.99


def offset_by_one(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` on the GPU one element past an aligned address."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
    out = buffer[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("R", [1, 64, 256])
def test_add_then_norm_at_real_shapes_on_gpu(dtype, R):
    """Qwen3-30B-A3B's hidden rows (2048) at decode and prefill batch sizes, against torch's add
    on the GPU then the RMSNorm kernel of the sum; also with x and delta one element past an
    aligned address (narrower loads), against the kernel of an aligned sum."""
    x = rows((R, 2048), dtype, seed=R, scale=2.0)
    delta = rows((R, 2048), dtype, seed=R + 1, scale=0.5)
    w = rows((2048,), dtype, seed=5) + 1
    check_add(x, delta, w, 1e-6, "cuda", f"{dtype} R={R}")
    check_add(offset_by_one(x), offset_by_one(delta), w, 1e-6, "cuda", f"{dtype} R={R} offset")
