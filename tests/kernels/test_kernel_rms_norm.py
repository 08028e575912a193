"""The RMSNorm kernel against the eager formulation it replaces on the GPU
(`fp4rl.model.layers.eager_rms_norm`).

The two differ only in the order of one FP32 sum per row (and, in the CPU interpreter, in how
numpy and torch compute rsqrt), so the inverse RMS may move by an ulp or two and an output by
one unit in its last place, with rounding twice (x * inv_rms, then the weight product) at most
two. Each output is held to that, and most outputs to equality. Results do not depend on the
batch a row is in.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import DTYPES  # noqa: E402

from fp4rl.kernels import rms_norm  # noqa: E402
from fp4rl.model.layers import RMSNorm, _KernelRMSNorm, eager_rms_norm  # noqa: E402


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
