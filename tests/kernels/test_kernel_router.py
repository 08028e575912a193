"""The router kernels against their plain-PyTorch twin (bitwise) and against the eager `Router`
they replace on the engine's path (bounded), and their place in `Router.forward`.

Twin: `router.reference_route` adds every FP32 sum in the kernels' order, so the kernels match
it bit for bit for BF16 and FP16 operands (whose products are exact in FP32), given the same
exp: the interpreter's is numpy's, so under it the twin takes numpy's too.

Eager: the kernels' logits and the eager GEMM's are two summation orders of the same products,
each within ``gamma_H * sum_h |x_h W_eh|`` of the exact sum (``gamma_n = n u / (1 - n u)``,
u = 2**-24), so they differ by at most ``D = 2 gamma_H max_e sum_h |x_h W_eh|``. A softmax
probability moves by a factor within ``exp(±D)`` under logit shifts of at most D (relative
``D`` to first order); each side's own rounding of ``l - m`` (``u |l - m|``), its exp (a few
ulps), its sum over E (``gamma_E``) and its division (u) add ``(|l - m| + E + 6) u`` each. The
normalization divides by a sum of k of them: twice the probabilities' bound plus
``(k + 2) u``. Every weight is held to that relative bound plus one unit in the last place of
the output dtype (both sides round once to it), and every kernel id ``i_j`` must have an eager
probability within the probabilities' bound of the eager j-th largest: an id can differ only
at a near tie. Such rows are counted and must be rare.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from fp4rl import ops  # noqa: E402
from fp4rl.kernels import router  # noqa: E402
from fp4rl.model import moe  # noqa: E402
from fp4rl.model.moe import Router  # noqa: E402

ON_GPU = torch.cuda.is_available()
U = 2.0**-24
TWIN_DTYPES = (torch.bfloat16, torch.float16)  # exact products: the twin is bitwise


def router_inputs(T, E, H, dtype, seed, *, weight_dtype=None, scale=3.0):
    """``(x [T, H], W [E, H])``: logits of standard deviation about ``scale``, as trained routers
    give (a few experts stand out)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w = torch.randn(E, H, generator=g) * (scale / H**0.5)
    return x.to(dtype), w.to(weight_dtype or dtype)


def twin_exp(t: torch.Tensor) -> torch.Tensor:
    """The kernel's exp: CUDA's expf on the GPU (torch's CUDA exp is the same function), numpy's
    float32 exp under the interpreter."""
    if t.is_cuda:
        return torch.exp(t)
    return torch.from_numpy(np.exp(t.numpy()))


def eager_route(x, w, top_k, norm):
    """`Router`'s eager formulation: ``(weights, ids, FP32 probabilities)``."""
    with torch.no_grad():
        weights, ids, _ = moe.eager_route(x, w, top_k, norm)
        probs = torch.softmax(torch.nn.functional.linear(x.float(), w.float()), -1)
    return weights, ids, probs


def assert_close_to_eager(got_w, got_ids, x, w, top_k, norm, what, *, max_near_ties, most_equal=0):
    """The module docstring's bounds, and at least ``most_equal`` of the weights equal eager's
    where the ids agree; returns the number of rows whose ids differ."""
    want_w, want_ids, probs_TE = eager_route(x, w, top_k, norm)
    got_w, got_ids = got_w.cpu(), got_ids.cpu()
    want_w, want_ids, probs_TE = want_w.cpu(), want_ids.cpu(), probs_TE.cpu()
    T, E = probs_TE.shape
    H = x.shape[1]
    assert got_w.dtype == want_w.dtype and got_w.shape == want_w.shape == (T, top_k), what
    assert got_ids.dtype == torch.int64 and got_ids.shape == (T, top_k), what
    # D: the two logit sums' largest possible difference, per row.
    products = x.cpu().double().abs() @ w.cpu().double().abs().T
    gamma_h = H * U / (1 - H * U)
    D_T = 2 * gamma_h * products.max(-1).values
    logits = x.cpu().double() @ w.cpu().double().T
    spread_T = (logits.max(-1).values[:, None] - logits).gather(1, want_ids).max(-1).values
    rel_p_T = D_T + 2 * (spread_T + 1 + E + 6) * U
    rel_w_T = 2 * rel_p_T + (top_k + 2) * U if norm else rel_p_T
    # Ids: the eager probability of the kernel's j-th id is within the bound of the eager j-th.
    sorted_p = probs_TE.double().sort(-1, descending=True).values[:, :top_k]
    picked_p = probs_TE.double().gather(1, got_ids)
    slack = (picked_p - sorted_p).abs() - 2 * rel_p_T[:, None] * sorted_p
    assert not (slack > 0).any(), f"{what}: an id differs from eager's away from a near tie"
    differs_T = (got_ids != want_ids).any(-1)
    assert int(differs_T.sum()) <= max_near_ties, f"{what}: {int(differs_T.sum())} rows differ"
    # Weights, where the ids agree (a near tie swaps weights along with ids).
    same = ~differs_T
    g, e = got_w[same].double(), want_w[same].double()
    ulp = torch.finfo(got_w.dtype).eps * e.abs() + torch.finfo(got_w.dtype).tiny
    excess = (g - e).abs() - rel_w_T[same][:, None] * e.abs() - ulp
    assert not (excess > 0).any(), f"{what}: a weight off by more than the bound"
    equal = (g == e).double().mean().item() if g.numel() else 1.0
    assert equal >= most_equal, f"{what}: only {equal:.4f} of the weights equal eager's"
    return int(differs_T.sum())


def assert_route_equal(a, b, what):
    (wa, ia), (wb, ib) = a, b
    assert torch.equal(ia.cpu(), ib.cpu()), f"{what}: ids differ"
    wa, wb = wa.cpu(), wb.cpu()
    assert torch.equal(wa.isnan(), wb.isnan()), f"{what}: NaN positions differ"
    assert torch.equal(wa[~wa.isnan()], wb[~wb.isnan()]), f"{what}: weights differ"


# ---- the twin ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", TWIN_DTYPES, ids=str)
@pytest.mark.parametrize(
    "T, E, H", [(5, 16, 64), (3, 12, 40), (2, 7, 300), (4, 64, 2048), (1, 3, 1), (6, 20, 129)]
)
def test_logit_partials_are_the_twins(device, dtype, T, E, H):
    """Every partial sum bitwise, whatever the tile (the tile sets the programs, not the sums)."""
    x, w = router_inputs(T, E, H, dtype, seed=T * 1000 + E + H)
    x, w = x.to(device), w.to(device)
    want = router.reference_logit_partials(x, w)
    assert want.shape == (T, router.sum_order(H).num_splits(H), E)
    for tile in (None, router.LogitsTile(1, 4, 1), router.LogitsTile(8, 2, 2)):
        got = router.logit_partials(x, w, tile)
        assert torch.equal(got.cpu(), want.cpu()), f"{T}x{E}x{H} tile {tile}"


@pytest.mark.parametrize("dtype", TWIN_DTYPES, ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no norm"])
@pytest.mark.parametrize(
    "T, E, H, k", [(9, 16, 64, 4), (3, 12, 40, 3), (5, 60, 96, 8), (2, 5, 16, 5)]
)
def test_routing_is_the_twins(device, dtype, norm, T, E, H, k):
    x, w = router_inputs(T, E, H, dtype, seed=T + E + H + k)
    x, w = x.to(device), w.to(device)
    got = router.launch(x, w, k, norm)
    assert_route_equal(got, router.reference_route(x, w, k, norm, exp=twin_exp), f"{T}x{E}x{H}")


def test_sum_order_depends_on_h_alone():
    """Slices of 256 columns and 64 lanes at Qwen3-30B-A3B's H = 2048 (8 partials); at most 16
    partials; lanes and slices cover H."""
    assert router.sum_order(2048) == router.SumOrder(lanes=64, split=256)
    for H in (1, 15, 16, 64, 100, 300, 2048, 4096, 5120, 7168, 16384):
        order = router.sum_order(H)
        assert order.split % order.lanes == 0 and order.num_splits(H) <= router.MAX_SPLITS
        assert (order.num_splits(H) - 1) * order.split < H <= order.num_splits(H) * order.split


# ---- against the eager router -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no norm"])
@pytest.mark.parametrize("T, E, H, k", [(16, 16, 64, 4), (8, 60, 128, 8), (4, 128, 256, 8)])
def test_close_to_the_eager_router(device, dtype, norm, T, E, H, k):
    x, w = router_inputs(T, E, H, dtype, seed=E * H + k)
    x, w = x.to(device), w.to(device)
    got = router.launch(x, w, k, norm)
    # FP32 weights keep every bit of the probabilities, which the sums' orders move: for them
    # only the bound holds. BF16 and FP16 weights mostly round the same.
    most_equal = 0.0 if dtype == torch.float32 else 0.9
    what = f"{dtype} {T}x{E}x{H}"
    assert_close_to_eager(*got, x, w, k, norm, what, max_near_ties=1, most_equal=most_equal)


def test_mixed_dtypes_close_to_eager(device):
    """BF16 activations and an FP32 router weight, whose products the FMAs round once each."""
    x, w = router_inputs(12, 32, 96, torch.bfloat16, seed=4, weight_dtype=torch.float32)
    got = router.launch(x.to(device), w.to(device), 6, True)
    assert got[0].dtype == torch.bfloat16
    assert_close_to_eager(*got, x, w, 6, True, "bf16 x, fp32 W", max_near_ties=1)


def test_ties_go_to_the_lowest_id(device):
    """Experts with equal weight rows have equal logits: the lowest id comes first, and equal
    probabilities get equal weights."""
    x, w = router_inputs(6, 10, 32, torch.bfloat16, seed=5)
    w[7], w[3], w[8] = w[2], w[5], w[5]  # 2 == 7 and 3 == 5 == 8
    weights, ids = router.launch(x.to(device), w.to(device), 10, True)
    weights, ids = weights.cpu(), ids.cpu()
    for t in range(6):
        position = {int(e): j for j, e in enumerate(ids[t])}
        assert position[2] + 1 == position[7], f"row {t}: {ids[t].tolist()}"
        assert position[3] + 1 == position[5] and position[5] + 1 == position[8], ids[t].tolist()
        assert weights[t, position[2]] == weights[t, position[7]]
        assert weights[t, position[3]] == weights[t, position[8]]
    # All experts equal: ids 0, 1, ..., k - 1 and weights 1 / k.
    weights, ids = router.launch(x.to(device), w[:1].repeat(10, 1).to(device), 4, True)
    assert torch.equal(ids.cpu(), torch.arange(4).repeat(6, 1))
    assert (weights.cpu() == 0.25).all()


# ---- batch invariance -------------------------------------------------------------------------


def test_a_row_does_not_depend_on_its_batch(device):
    """Row r alone, and at other positions of a batch of 300 (other tiles), gives the same bits."""
    E, H, k = (128, 2048, 8) if ON_GPU else (16, 96, 4)
    x, w = router_inputs(300, E, H, torch.bfloat16, seed=6)
    x, w = x.to(device), w.to(device)
    batch = router.launch(x, w, k, True)
    perm = torch.randperm(300, generator=torch.Generator().manual_seed(7)).to(device)
    shuffled = router.launch(x[perm].contiguous(), w, k, True)
    inverse = torch.argsort(perm)
    assert_route_equal((shuffled[0][inverse], shuffled[1][inverse]), batch, "shuffled batch")
    for r in (0, 1, 17, 150, 299):
        alone = router.launch(x[r : r + 1].contiguous(), w, k, True)
        assert_route_equal(alone, (batch[0][r : r + 1], batch[1][r : r + 1]), f"row {r}")
        seven = router.launch(x[max(r - 3, 0) : max(r - 3, 0) + 7].contiguous(), w, k, True)
        at = r - max(r - 3, 0)
        assert_route_equal((seven[0][at], seven[1][at]), (batch[0][r], batch[1][r]), f"{r} in 7")


# ---- non-finite input -------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no norm"])
def test_non_finite_rows_keep_ids_in_range(device, norm):
    """A NaN or ±inf activation, an expert row of NaN, logits of -inf: ids stay distinct in
    ``[0, E)``, rows whose softmax is NaN get NaN weights (as eagerly), other rows are as they
    are alone."""
    E, H, k = 12, 32, 5
    x, w = router_inputs(6, E, H, torch.bfloat16, seed=8)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2, 7] = -float("inf")
    x[3] = 0.0
    x[3, 0] = float("inf")  # some logits +inf, some -inf, some NaN (inf * 0)
    weights, ids = router.launch(x.to(device), w.to(device), k, norm)
    weights, ids = weights.cpu(), ids.cpu()
    assert ((ids >= 0) & (ids < E)).all()
    assert all(len(set(row.tolist())) == k for row in ids)
    want_w, _, _ = eager_route(x, w, k, norm)
    assert torch.equal(weights[:4].isnan(), want_w[:4].isnan())
    assert weights[:4].isnan().all() and not weights[4:].isnan().any()
    assert torch.equal(ids[:4], torch.arange(k).repeat(4, 1))  # keys 0: the lowest ids
    alone = router.launch(x[4:].to(device), w.to(device), k, norm)
    assert_route_equal(alone, (weights[4:], ids[4:]), "finite rows")
    # A NaN expert row: every row's logits hold a NaN.
    w_nan = w.clone()
    w_nan[9, 1] = float("nan")
    weights, ids = router.launch(x[4:].to(device), w_nan.to(device), k, norm)
    assert weights.isnan().all() and ((ids >= 0) & (ids < E)).all()


# ---- checks -----------------------------------------------------------------------------------


def test_checks_name_the_values(device):
    x = torch.ones(4, 32, dtype=torch.bfloat16, device=device)
    w = torch.ones(8, 32, dtype=torch.bfloat16, device=device)
    refused = [
        ((x.int(), w, 2), r"dtypes among .*; got torch.int32 and torch.bfloat16"),
        ((x, w.double(), 2), r"got torch.bfloat16 and torch.float64"),
        ((x[0], w, 2), r"x_TH must be \[T, H\] with H >= 1; got shape \(32,\)"),
        ((x[:, :0], w[:, :0], 2), r"H >= 1; got shape \(4, 0\)"),
        ((x, w[:, :16], 2), r"weight_EH must be \[E, 32\] for x_TH of shape \(4, 32\); got shape"),
        ((x, w[:0], 1), r"experts must be in \[1, 1024\]; got E = 0"),
        ((x, w.repeat(129, 1), 2), "got E = 1032"),
        ((x, w, 0), r"top_k must be an int in \[1, min\(E, 16\)\] = \[1, 8\]; got 0"),
        ((x, w, 9), r"= \[1, 8\]; got 9"),
        ((x, w, 2.0), r"got 2.0"),
        ((x, w.to("meta"), 2), r"weight_EH must be on .* like x_TH; got meta"),
    ]
    for args, message in refused:
        assert not router.supported(*args), message
        with pytest.raises(ValueError, match=message):
            router.launch(*args, True)
    with pytest.raises(ValueError, match="top_k must be an int .*; got True"):
        router.launch(x, w, True, True)
    # Strided inputs are supported (`ops.route` makes them contiguous), not launched.
    for args, message in (
        ((x.t().contiguous().t(), w, 2), "x_TH must be contiguous"),
        ((x, w.t().contiguous().t(), 2), "weight_EH must be contiguous"),
    ):
        assert router.supported(*args)
        with pytest.raises(ValueError, match=message):
            router.launch(*args, True)


def test_tiles_are_checked():
    with pytest.raises(ValueError, match="block_t must be a power of two; got 3"):
        router.LogitsTile(3, 8, 1)
    with pytest.raises(ValueError, match="block_e must be a power of two; got 0"):
        router.LogitsTile(1, 0, 1)
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4 or 8; got 16"):
        router.LogitsTile(1, 8, 16)


def test_no_rows(device):
    x, w = router_inputs(0, 8, 32, torch.bfloat16, seed=0)
    weights, ids = router.launch(x.to(device), w.to(device), 2, True)
    assert weights.shape == ids.shape == (0, 2) and ids.dtype == torch.int64


# ---- in the model -----------------------------------------------------------------------------


@pytest.fixture
def kernel_route(monkeypatch):
    """`ops.route` runs the kernels on every device (on the CPU under the interpreter); returns
    the list of its calls' results."""
    calls = []

    def route(x_TH, weight_EH, top_k, norm_topk_prob):
        out = router.launch(x_TH.contiguous(), weight_EH.contiguous(), top_k, norm_topk_prob)
        calls.append(out)
        return out

    monkeypatch.setattr(ops, "route", route)
    return calls


def test_the_router_takes_the_kernels_in_inference_mode_without_replay(device, kernel_route):
    x, w = router_inputs(7, 16, 64, torch.bfloat16, seed=9)
    module = Router(64, 16, 4, True).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(w)
    x = x.to(device)
    with torch.inference_mode():
        weights, ids, live = module(x)
    assert len(kernel_route) == 1 and live == 7
    assert weights is kernel_route[0][0] and ids is kernel_route[0][1]
    # The trainer's forwards, with gradients or without, and replayed routing: the eager ops.
    weights, ids, _ = module(x)
    assert weights.requires_grad and len(kernel_route) == 1
    with torch.no_grad():
        module(x)
    assert len(kernel_route) == 1
    with torch.inference_mode():
        module(x, torch.full((7, 4), -1, device=device))
    assert len(kernel_route) == 1


def test_ops_leaves_cpu_tensors_to_the_eager_router():
    x, w = router_inputs(3, 8, 32, torch.bfloat16, seed=0)
    assert ops.route(x, w, 2, True) is None


# ---- on the GPU: Qwen3-30B-A3B's router (E = 128, k = 8, H = 2048) -------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 64, 300])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no norm"])
def test_real_shapes_on_gpu(T, norm):
    """Through `ops.route`: bitwise the twin (libdevice's expf is torch's CUDA exp), and within
    the bounds of the eager router on the same GPU (cuBLAS's sum order)."""
    x, w = router_inputs(T, 128, 2048, torch.bfloat16, seed=T)
    x, w = x.cuda(), w.cuda()
    got = ops.route(x, w, 8, norm)
    assert got is not None, "the kernels did not run"
    assert_route_equal(got, router.reference_route(x, w, 8, norm, exp=twin_exp), f"T={T}")
    near_ties = max(1, T // 100)
    assert_close_to_eager(*got, x, w, 8, norm, f"T={T}", max_near_ties=near_ties, most_equal=0.99)


@pytest.mark.gpu
def test_ops_leaves_unsupported_shapes_to_eager_on_gpu():
    x = torch.ones(4, 32, dtype=torch.bfloat16, device="cuda")
    assert ops.route(x, torch.ones(2048, 32, dtype=torch.bfloat16, device="cuda"), 8, True) is None
    assert ops.route(x, torch.ones(64, 32, dtype=torch.bfloat16, device="cuda"), 17, True) is None
    many = torch.ones(router.MAX_ROWS + 1, 32, dtype=torch.bfloat16, device="cuda")
    assert ops.route(many, torch.ones(64, 32, dtype=torch.bfloat16, device="cuda"), 8, True) is None
    w = torch.ones(64, 32, dtype=torch.bfloat16, device="cuda")
    assert ops.route(many[: router.MAX_ROWS], w, 8, True) is not None


@pytest.mark.gpu
def test_captured_in_a_cuda_graph_without_a_sync():
    x, w = (t.cuda() for t in router_inputs(64, 128, 2048, torch.bfloat16, seed=10))
    router.launch(x, w, 8, True)  # compile outside the capture
    fresh = [router_inputs(64, 128, 2048, torch.bfloat16, seed=s)[0].cuda() for s in (11, 12)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # nothing below may read a value back
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = router.launch(x, w, 8, True)
        replays = []
        for inputs in fresh:
            x.copy_(inputs)
            graph.replay()
            replays.append((inputs, out[0].clone(), out[1].clone()))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for inputs, weights, ids in replays:
        assert_route_equal((weights, ids), router.launch(inputs, w, 8, True), "replay")
