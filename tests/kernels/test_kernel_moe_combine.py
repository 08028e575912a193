"""The MoE combine kernel against the eager formulation it replaces on the GPU
(`fp4rl.model.experts.eager_combine`), and its place in the experts' forward.

The kernel rounds each weight and each product exactly as the eager ops do; only the order of
the FP32 sum over a token's k products may differ (its own: j = 0, 1, ..., k - 1). Whatever
the order, an FP32 sum of k terms with k - 1 roundings lies within ``gamma_{k-1} * sum |p_j|``
of the exact sum s (``gamma_n = n u / (1 - n u)``, u = 2**-24), and rounding to the output
dtype is monotone: so every output lies between the dtype roundings of ``s - delta`` and
``s + delta``, s and delta computed in float64 from the eager products. Each output is held to
that range (the eager result too, which checks the bound), most outputs to equality with the
eager result, and special values (NaN, inf, zero weights, -0.0, on sums that are exact in any
order) to the eager bits. Results do not depend on the batch a token is in.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import DTYPES  # noqa: E402

from fp4rl import ops  # noqa: E402
from fp4rl.kernels import expert_sort, moe_combine  # noqa: E402
from fp4rl.model import experts  # noqa: E402
from fp4rl.model.experts import Experts, _KernelCombine, eager_combine  # noqa: E402


def combine_inputs(T, k, H, dtype, weight_dtype, seed, extra_rows=0):
    """``(y [T*k + extra_rows, H], row_order [T, k], weights [T, k])``: y over a few binades,
    row_order a random permutation of y's rows (the extra rows left unread), softmax weights."""
    g = torch.Generator().manual_seed(seed)
    A = T * k + extra_rows
    y = torch.randn(A, H, generator=g) * torch.exp2(torch.randint(-3, 4, (A, 1), generator=g))
    row_order = torch.randperm(A, generator=g)[: T * k].view(T, k)
    weights = torch.softmax(torch.randn(T, k, generator=g) * 2, -1)
    return y.to(dtype), row_order, weights.to(weight_dtype)


def eager_products(y_AH, row_order_Tk, weights_Tk):
    """The eager formulation's products ``[T, k, H]`` in y's dtype (CPU torch)."""
    T, k = row_order_Tk.shape
    y_TkH = y_AH[row_order_Tk.flatten()].view(T, k, y_AH.shape[1])
    return y_TkH * weights_Tk.unsqueeze(-1).to(y_AH.dtype)


def reordered_sum_range(p_TkH):
    """``(lo, hi, finite)``: the outputs any FP32 summation order of the k products can round
    to lie in ``[lo, hi]``, where every product is ``finite``."""
    k = p_TkH.shape[1]
    p = p_TkH.double()
    s = p.sum(1)
    u = 2.0**-24
    gamma = (k - 1) * u / (1 - (k - 1) * u)
    # A little slack for the float64 arithmetic computing s and delta themselves.
    delta = gamma * p.abs().sum(1) * (1 + 2.0**-30) + s.abs() * 2.0**-50
    # Through FP32 on purpose: the kernel rounds an FP32 sum, and both roundings are monotone.
    lo, hi = ((s + d).float().to(p_TkH.dtype) for d in (-delta, delta))
    return lo, hi, p_TkH.isfinite().all(1)


def assert_close_to_eager(got, y, row_order, weights, what, *, most_equal=0.99):
    got = got.cpu()
    y, row_order, weights = y.cpu(), row_order.cpu(), weights.cpu()
    want = eager_combine(y, row_order, weights)
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {got.shape}"
    lo, hi, finite = reordered_sum_range(eager_products(y, row_order, weights))
    for name, out in (("kernel", got), ("eager", want)):
        outside = finite & ~((lo <= out) & (out <= hi))
        assert not outside.any(), (
            f"{what}: {name} output {out[outside][0].item()} outside the reordered-sum range "
            f"[{lo[outside][0].item()}, {hi[outside][0].item()}]"
        )
    # Where a product is not finite the order does not matter: NaN stays NaN, infs add up.
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN positions differ"
    special = ~finite & ~want.isnan()
    assert torch.equal(got[special], want[special]), f"{what}: non-finite outputs differ"
    same = (got == want) | (got.isnan() & want.isnan())
    equal = same.double().mean().item() if got.numel() else 1.0
    assert equal >= most_equal, f"{what}: only {equal:.4f} of the outputs equal eager's"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight_dtype", [torch.float32, "same"], ids=["fp32 weights", "same"])
@pytest.mark.parametrize(
    "T, k, H", [(5, 8, 64), (3, 1, 16), (4, 16, 48), (2, 3, 272), (1, 8, 2048), (0, 8, 64)]
)
def test_within_the_reordered_sum_bound(device, dtype, weight_dtype, T, k, H):
    weight_dtype = dtype if weight_dtype == "same" else weight_dtype
    y, row_order, w = combine_inputs(T, k, H, dtype, weight_dtype, seed=T * 100 + k + H)
    got = moe_combine.launch(y.to(device), row_order.to(device), w.to(device))
    assert got.device.type == device
    # Tiny tensors: one output on the other side of a rounding is a large share of them. FP32
    # outputs keep every bit of the sum, so for them only the bound holds (torch's CPU sum
    # adds 16 terms in another order than the kernel).
    most_equal = 0.0 if dtype == torch.float32 else 0.9
    assert_close_to_eager(got, y, row_order, w, f"{dtype} {T}x{k}x{H}", most_equal=most_equal)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mostly_equal_at_a_decode_shape(device, dtype):
    """64 tokens of 8 experts (a decode batch), 4 unread rows, the router's FP32 weights."""
    y, row_order, w = combine_inputs(64, 8, 256, dtype, torch.float32, seed=1, extra_rows=4)
    got = moe_combine.launch(y.to(device), row_order.to(device), w.to(device))
    assert_close_to_eager(got, y, row_order, w, str(dtype))


@pytest.mark.parametrize("tile", [(16, 1), (64, 2), (1024, 4)])
def test_other_tiles_give_the_same_bits(device, tile):
    """The tile splits H only; each output's arithmetic is the same."""
    tile = moe_combine.CombineTile(*tile)
    for H in (48, 128):
        y, row_order, w = combine_inputs(3, 4, H, torch.float32, torch.float32, seed=H)
        y, row_order, w = y.to(device), row_order.to(device), w.to(device)
        got = moe_combine.launch(y, row_order, w, tile)
        assert torch.equal(got, moe_combine.launch(y, row_order, w)), f"H={H} {tile}"
        assert_close_to_eager(got, y, row_order, w, f"H={H} {tile}", most_equal=0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_as_eager(device, dtype):
    """Values whose every partial sum is exact (so any order gives the same bits): NaN and ±inf
    in y, zero and -0.0 weights (inf times zero is NaN), rows of -0.0 (they sum to +0.0, as
    torch's sum starts from +0.0)."""
    nan, inf = float("nan"), float("inf")
    y = torch.tensor(
        [
            [1.0, -2.0, 0.5, 4.0] * 4,
            [nan, 1.0, -0.0, inf] * 4,
            [-0.0] * 16,
            [-inf, 0.25, 8.0, -0.0] * 4,
            [3.0, -0.0, -1.0, 2.0] * 4,
            [0.0, -0.5, 16.0, -0.0] * 4,
        ]
    ).to(dtype)
    row_order = torch.tensor([[0, 1, 2], [2, 2, 2], [3, 1, 4], [5, 0, 3], [2, 5, 2]])
    weights = torch.tensor(
        [[0.5, 0.25, 1.0], [1.0, 0.5, 2.0], [0.0, 1.0, -0.5], [0.5, -0.0, 0.0], [1.0, 1.0, 0.5]]
    )
    for w in (weights, weights.to(dtype)):
        got = moe_combine.launch(y.to(device), row_order.to(device), w.to(device)).cpu()
        want = eager_combine(y, row_order, w)
        assert torch.equal(got.isnan(), want.isnan()), f"{dtype}: NaN positions"
        ok = ~want.isnan()
        assert torch.equal(got[ok], want[ok]), f"{dtype}: values"
        assert torch.equal(got[ok].signbit(), want[ok].signbit()), f"{dtype}: signs of zero"
        assert got[0, 0::4].isnan().all()  # token 0 gathers row 1's NaN column
        assert (got[1] == 0).all() and not got[1].signbit().any()  # -0.0s sum to +0.0
        assert got[3, 0::4].isnan().all()  # -inf times a zero weight


def test_rows_outside_y_read_nothing_and_give_nan(device):
    y = torch.ones(8, 32, dtype=torch.bfloat16, device=device)
    row_order = torch.tensor([[0, 1], [-1, 2], [3, 8]], device=device)
    got = moe_combine.launch(y, row_order, torch.ones(3, 2, device=device)).cpu()
    assert torch.equal(got[0], torch.full((32,), 2.0, dtype=torch.bfloat16))
    assert got[1:].isnan().all()


def test_a_token_does_not_depend_on_its_batch(device):
    """A token's rows give the same bits whatever the other tokens and wherever its rows lie."""
    y, row_order, w = combine_inputs(33, 8, 512, torch.bfloat16, torch.float32, seed=3)
    y, row_order, w = y.to(device), row_order.to(device), w.to(device)
    batch = moe_combine.launch(y, row_order, w)
    shifted = torch.cat([torch.randn(5, 512, device=device).to(y.dtype), y])
    for t in (0, 17, 32):
        alone = moe_combine.launch(y, row_order[t : t + 1].contiguous(), w[t : t + 1].contiguous())
        assert torch.equal(alone[0], batch[t]), f"token {t} alone"
        moved = moe_combine.launch(shifted, (row_order[t : t + 2] + 5).contiguous(), w[t : t + 2])
        assert torch.equal(moved[0], batch[t]), f"token {t} with other rows, later in y"
    assert_close_to_eager(batch, y, row_order, w, "33 x 8 x 512")


@pytest.fixture
def kernel_combine(monkeypatch):
    """`ops.moe_combine` runs the kernel on every device (on the CPU under the interpreter);
    returns the list of its calls' ``(y, row_order, weights, out)``."""
    calls = []

    def combine(y_AH, row_order_Tk, weights_Tk):
        out = moe_combine.launch(y_AH, row_order_Tk, weights_Tk)
        calls.append((y_AH, row_order_Tk, weights_Tk, out))
        return out

    monkeypatch.setattr(ops, "moe_combine", combine)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_are_the_eager_formulations(device, kernel_combine, dtype, weight_dtype):
    """The autograd function takes the kernel's values forward and the eager formulation's
    gradients backward, for y and the weights (the trainer's combine on the GPU)."""
    y, row_order, w = combine_inputs(6, 4, 32, dtype, weight_dtype, seed=7, extra_rows=2)
    y, row_order, w = y.to(device), row_order.to(device), w.to(device)
    grad = torch.randn(6, 32, generator=torch.Generator().manual_seed(8)).to(dtype).to(device)
    y1, w1 = y.clone().requires_grad_(), w.clone().requires_grad_()
    out = _KernelCombine.apply(y1, row_order, w1)
    assert len(kernel_combine) == 1 and torch.equal(out, kernel_combine[0][3])
    out.backward(grad)
    y2, w2 = y.clone().requires_grad_(), w.clone().requires_grad_()
    eager_combine(y2, row_order, w2).backward(grad)
    assert torch.equal(y1.grad, y2.grad) and torch.equal(w1.grad, w2.grad)
    assert w1.grad.dtype == weight_dtype
    # y alone needing a gradient (the weights held fixed).
    y3 = y.clone().requires_grad_()
    _KernelCombine.apply(y3, row_order, w).backward(grad)
    assert torch.equal(y3.grad, y2.grad)


def test_the_experts_forward_takes_the_kernels(device, kernel_combine, monkeypatch):
    """Outside autograd the experts' forward sorts with the sort kernel (its inverse the
    combine's row order) and combines with the combine kernel, whose output it returns."""
    sorts = []

    def sort(ids, num_experts):
        result = expert_sort.launch(ids.contiguous(), num_experts)
        sorts.append(result)
        return result

    monkeypatch.setattr(ops, "sort_by_expert", sort)
    T, k, E, H, I = 9, 4, 6, 32, 16
    g = torch.Generator().manual_seed(11)
    module = Experts(E, H, I, layer=0).to(torch.bfloat16)
    with torch.no_grad():
        module.w13.copy_(torch.randn(E, 2 * I, H, generator=g) / 4)
        module.w2.copy_(torch.randn(E, H, I, generator=g) / 4)
    module = module.to(device)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device)
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(torch.bfloat16).to(device)
    with torch.no_grad():
        out = module(x, ids, w)
    assert len(sorts) == 1 and len(kernel_combine) == 1
    y_AH, row_order, weights, combined = kernel_combine[0]
    order, inverse, counts = sorts[0]
    assert row_order.shape == (T, k) and torch.equal(row_order.flatten(), inverse)
    want_inverse = torch.empty_like(order).scatter_(0, order, torch.arange(T * k, device=device))
    assert torch.equal(inverse, want_inverse)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=E))
    assert out is combined and weights is w
    assert_close_to_eager(out, y_AH, row_order, w, "experts", most_equal=0.9)


def test_the_dispatch_order_without_kernels():
    """On the CPU `dispatch_order` is torch's stable order, the scatter of its inverse and
    the counts per expert."""
    g = torch.Generator().manual_seed(12)
    for T, k, E in ((0, 8, 4), (1, 1, 1), (7, 8, 60), (300, 8, 128)):
        ids = torch.randint(0, E, (T, k), generator=g)
        order, row_order, counts = experts.dispatch_order(ids, E)
        want = torch.argsort(ids.flatten(), stable=True)
        assert torch.equal(order, want)
        assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=E))
        assert row_order.shape == (T, k) and row_order.dtype == torch.int64
        assert torch.equal(row_order.flatten()[want], torch.arange(T * k))


def test_checks_name_the_values(device):
    y = torch.ones(8, 32, dtype=torch.bfloat16, device=device)
    r = torch.arange(8, device=device).view(4, 2)
    w = torch.ones(4, 2, device=device)
    refused = [
        ((y.int(), r, w), r"dtypes among .*; got torch.int32 and torch.float32"),
        ((y, r, w.double()), r"got torch.bfloat16 and torch.float64"),
        ((y, r.int(), w), "row_order_Tk must be int64; got torch.int32"),
        ((y[0], r, w), r"y_AH must be \[A, H\] .*; got shape \(32,\)"),
        ((y[:, :24], r, w), r"multiple of 16; got shape \(8, 24\)"),
        ((y, r[:, :0], w[:, :0]), r"1 <= k <= 16; got shape \(4, 0\)"),
        ((y, r.repeat(1, 9), w.repeat(1, 9)), r"1 <= k <= 16; got shape \(4, 18\)"),
        ((y, r, w[:3]), r"row_order_Tk's shape \(4, 2\); got \(3, 2\)"),
        ((y, r.to("meta"), w), r"row_order_Tk must be on .* like y_AH; got meta"),
        ((y, r, w.to("meta")), r"weights_Tk must be on .* like y_AH; got meta"),
    ]
    for args, message in refused:
        assert not moe_combine.supported(*args), message
        with pytest.raises(ValueError, match=message):
            moe_combine.launch(*args)
    # Strided inputs are supported (`ops.moe_combine` makes them contiguous), not launched.
    strided = [
        ((y.t().contiguous().t(), r, w), r"y_AH must be contiguous; got shape \(8, 32\)"),
        ((y, r.t().contiguous().t(), w), "row_order_Tk must be contiguous"),
        ((y, r, w.t().contiguous().t()), "weights_Tk must be contiguous"),
    ]
    for args, message in strided:
        assert moe_combine.supported(*args), message
        with pytest.raises(ValueError, match=message):
            moe_combine.launch(*args)


def test_tiles_are_checked():
    for block_h in (8, 48):
        with pytest.raises(
            ValueError, match=f"block_h must be a power of two >= 16; got {block_h}"
        ):
            moe_combine.CombineTile(block_h, 1)
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4 or 8; got 3"):
        moe_combine.CombineTile(64, 3)


def test_ops_leaves_cpu_tensors_to_the_eager_formulation():
    y, row_order, w = combine_inputs(2, 2, 16, torch.bfloat16, torch.float32, seed=0)
    assert ops.moe_combine(y, row_order, w) is None


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 256, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_real_shapes_on_gpu(T, dtype):
    """Qwen3-30B-A3B's combine (k = 8, H = 2048) through `ops.moe_combine` against the eager
    formulation on the same GPU, row orders from the sort kernel."""
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, 128, (T, 8), generator=g).cuda()
    _, row_order, _ = experts.dispatch_order(ids, 128)
    y = (torch.randn(T * 8, 2048, generator=g) * 4).to(dtype).cuda()
    w = torch.softmax(torch.randn(T, 8, generator=g), -1).to(dtype).cuda()
    got = ops.moe_combine(y, row_order, w)
    assert got is not None, "the kernel did not run"
    # FP32 outputs keep every bit of the sum: where torch's CUDA reduction adds in another
    # order, they show it; for them only the bound holds.
    most_equal = 0.99 if dtype == torch.bfloat16 else 0.0
    want = eager_combine(y, row_order, w)
    same = (got == want).float().mean().item()
    assert same >= most_equal, f"only {same:.4f} equal to the eager result on the GPU"
    assert_close_to_eager(got, y, row_order, w, f"T={T}", most_equal=most_equal)


@pytest.mark.gpu
def test_ops_leaves_unsupported_shapes_to_eager_on_gpu():
    y = torch.ones(16, 24, dtype=torch.bfloat16, device="cuda")  # H not a multiple of 16
    r = torch.arange(16, device="cuda").view(8, 2)
    assert ops.moe_combine(y, r, torch.ones(8, 2, device="cuda")) is None
    y = torch.ones(34, 32, dtype=torch.bfloat16, device="cuda")  # k = 17
    r = torch.arange(34, device="cuda").view(2, 17)
    assert ops.moe_combine(y, r, torch.ones(2, 17, device="cuda")) is None


@pytest.mark.gpu
def test_the_trainers_combine_on_gpu():
    """Under autograd `combine` on the GPU runs the kernel forward, eager gradients backward."""
    y, row_order, w = combine_inputs(64, 8, 2048, torch.bfloat16, torch.bfloat16, seed=5)
    y, row_order, w = y.cuda().requires_grad_(), row_order.cuda(), w.cuda().requires_grad_()
    out = experts.combine(y, row_order, w)
    assert torch.equal(out, moe_combine.launch(y.detach(), row_order, w.detach()))
    grad = torch.randn_like(out)
    dy, dw = torch.autograd.grad(out, (y, w), grad)
    want = torch.autograd.grad(eager_combine(y, row_order, w), (y, w), grad)
    assert torch.equal(dy, want[0]) and torch.equal(dw, want[1])


@pytest.mark.gpu
def test_captured_in_a_cuda_graph_without_a_sync():
    y, row_order, w = combine_inputs(64, 8, 2048, torch.bfloat16, torch.float32, seed=9)
    static = [t.cuda() for t in (y, row_order, w)]
    moe_combine.launch(*static)  # compile outside the capture
    fresh = [
        [t.cuda() for t in combine_inputs(64, 8, 2048, torch.bfloat16, torch.float32, seed=s)]
        for s in (10, 11)
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # nothing below may read a value back
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe_combine.launch(*static)
        replays = []
        for inputs in fresh:
            for buffer, t in zip(static, inputs, strict=True):
                buffer.copy_(t)
            graph.replay()
            replays.append((inputs, out.clone()))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for inputs, got in replays:
        assert torch.equal(got, moe_combine.launch(*inputs))
