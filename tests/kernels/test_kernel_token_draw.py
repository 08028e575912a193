"""The token-order draw kernel (`fp4rl.kernels.token_draw`) against torch's float64 scan.

The kernel adds the same float64 exponentials in another order than ``cumsum`` (chunk sums,
their scan, a walk of one chunk), so its CDF differs from the reference's by a few float64
ulps of the total: a token may differ only where the reference CDF lies that close to ``u *
total`` (a near tie), which random numbers practically never do. The tests below also put
numbers on the reference's boundaries on purpose, where either neighbour may come out.
Everything else is exact: the logprob is the input's bits, tokens of probability zero are never
drawn, and a row's result does not depend on the rows beside it.

Under the interpreter every program costs tens of milliseconds: the sizes are small (V of a few
thousand, not multiples of the chunk, so rows end inside a chunk), a few hundred rows in all.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from fp4rl import kernels  # noqa: E402

NEAR_TIE = 1e-12  # relative to the row's total: far above any sum order's rounding here
ONE_BELOW = 1.0 - 2.0**-53  # the largest float64 below 1


def logprobs(B, V, seed, scale=4.0):
    """``log_softmax`` of ``randn * scale`` logits, float32 ``[B, V]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(B, V, generator=g) * scale, -1)


def uniforms(n, seed):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def reference(logprobs_BV, u_B):
    """``(token, cdf [B, V], target [B])`` by torch's float64 ``exp().cumsum()`` where the
    tensors are: the sampler's torch formulation of `_draw_in_token_order` written out (the
    sampler itself may send CUDA tensors to the kernel)."""
    cdf_BV = logprobs_BV.double().exp().cumsum(-1)
    total_B1 = cdf_BV[:, -1:].contiguous()
    target_B1 = (u_B[:, None] * total_B1).contiguous()
    token_B = torch.searchsorted(cdf_BV, target_B1, right=True)[:, 0]
    last_B = torch.searchsorted(cdf_BV, total_B1, right=False)[:, 0]
    token_B = torch.minimum(token_B, last_B).clamp_(0, logprobs_BV.shape[1] - 1)
    return token_B, cdf_BV, target_B1[:, 0]


def draw(logprobs_BV, u_B, device):
    """`kernels.draw_in_token_order` on ``device``; results on the CPU, the logprob checked to
    be the input's bits at the token."""
    on = logprobs_BV.to(device)
    token_B, logprob_B = kernels.draw_in_token_order(on, u_B.to(device))
    assert token_B.dtype == torch.int64 and logprob_B.dtype == torch.float32
    assert token_B.shape == logprob_B.shape == (logprobs_BV.shape[0],)
    token_B, logprob_B = token_B.cpu(), logprob_B.cpu()
    V = logprobs_BV.shape[1]
    assert ((token_B >= 0) & (token_B < V)).all(), token_B
    want = logprobs_BV.cpu().gather(1, token_B[:, None])[:, 0]
    assert torch.equal(logprob_B.view(torch.int32), want.view(torch.int32))
    return token_B, logprob_B


def near_ties(got_B, logprobs_BV, u_B):
    """Rows where ``got`` differs from the reference; each must be a near tie: every reference
    CDF value between the two tokens within `NEAR_TIE` of the total from the target."""
    want_B, cdf_BV, target_B = reference(logprobs_BV.cpu(), u_B.cpu())
    rows = (got_B != want_B).nonzero()[:, 0].tolist()
    for b in rows:
        lo, hi = sorted((int(got_B[b]), int(want_B[b])))
        gap = (cdf_BV[b, lo:hi] - target_B[b]).abs().max().item()
        assert gap <= NEAR_TIE * cdf_BV[b, -1].item(), (b, int(got_B[b]), int(want_B[b]), gap)
    return rows


def on_boundaries(logprobs_BV, seed):
    """A number per row that puts ``u * total`` on a reference CDF boundary (within an ulp) of a
    random token of the row: the neighbouring tokens are both fair draws there."""
    _, cdf_BV, _ = reference(logprobs_BV, torch.zeros(len(logprobs_BV), dtype=torch.float64))
    g = torch.Generator().manual_seed(seed)
    at_B = torch.randint(0, logprobs_BV.shape[1], (logprobs_BV.shape[0],), generator=g)
    return cdf_BV.gather(1, at_B[:, None])[:, 0] / cdf_BV[:, -1]


@pytest.mark.parametrize("V", [5000, 3000 + 17, 2048, 1])
def test_the_tokens_of_torchs_float64_scan_but_at_near_ties(device, V):
    rows = logprobs(8, V, seed=V)
    rows[4:] = logprobs(4, V, seed=V + 1, scale=0.5)  # flat rows: the CDF crosses every chunk
    u = uniforms(8, seed=V)
    got, _ = draw(rows, u, device)
    assert near_ties(got, rows, u) == []  # random numbers are not near ties
    u_edge = on_boundaries(rows, seed=V)
    got, _ = draw(rows, u_edge, device)
    assert len(near_ties(got, rows, u_edge)) <= 8  # numbers on a boundary may take either side


def test_tokens_of_probability_zero_are_never_drawn(device):
    """Rows with -inf holes: a -inf tail (the last chunk all -inf), a -inf head (the first chunk
    all -inf), every other token -inf, and a single live stretch. A number just below 1 (and 1
    itself, which torch.rand never gives) draws the last token of positive probability, 0 the
    first; random numbers only live tokens."""
    V = 5000
    rows = logprobs(4, V, seed=3, scale=1.0)
    rows[0, 3500:] = float("-inf")
    rows[1, :2100] = float("-inf")
    rows[2, 1::2] = float("-inf")
    rows[3, :2500] = float("-inf")
    rows[3, 2601:] = float("-inf")
    live = rows > float("-inf")
    ids = torch.arange(V)
    first = torch.where(live, ids, V).min(-1).values
    last = torch.where(live, ids, -1).max(-1).values
    numbers = [ONE_BELOW, 1.0, 0.0, *uniforms(3, seed=4).tolist()]
    batch = rows.repeat(len(numbers), 1)
    u = torch.tensor(numbers, dtype=torch.float64).repeat_interleave(4)
    got, logprob = draw(batch, u, device)
    got = got.view(len(numbers), 4)
    assert got[0].tolist() == last.tolist()
    assert got[1].tolist() == last.tolist()
    assert got[2].tolist() == first.tolist()
    assert (logprob > float("-inf")).all()
    assert near_ties(got.flatten(), batch, u) == []


def test_rows_without_probability_index_inside_the_vocabulary(device):
    """NaN rows (refused by the engine after the draw) and a row of -inf: an index in range,
    no error; the logprob is still the input's bits there (NaN, -inf)."""
    V = 3017
    rows = logprobs(3, V, seed=5)
    rows[0] = float("nan")
    rows[1] = float("-inf")
    rows[2, 2500] = float("nan")
    got, logprob = draw(rows, uniforms(3, seed=5), device)
    assert got[1] == 0  # as torch's scan: its CDF of zeros reaches the total (0) at once
    assert logprob[0].isnan() and logprob[1] == float("-inf")


@pytest.mark.parametrize("V", [5000, 3000 + 17])
def test_a_row_draws_the_same_alone_in_any_batch(device, V):
    """Bitwise, with numbers on the reference's boundaries, where any change in a sum's order
    would show: each row alone, the rows in another order, and a misaligned view of them."""
    rows = logprobs(5, V, seed=6 + V, scale=2.0)
    u = on_boundaries(rows, seed=7)
    token, logprob = draw(rows, u, device)
    for b in range(5):
        alone = draw(rows[b : b + 1], u[b : b + 1], device)
        assert alone[0].item() == token[b].item() and alone[1].item() == logprob[b].item()
    order = torch.tensor([3, 0, 4, 2, 1])
    shuffled = draw(rows[order], u[order], device)
    assert torch.equal(shuffled[0], token[order]) and torch.equal(shuffled[1], logprob[order])
    # A view at a 4-byte offset: the launcher copies it to an aligned buffer first.
    flat = torch.empty(5 * V + 1, device=device)
    view = flat[1:].view(5, V)
    view.copy_(rows)
    assert view.data_ptr() % 16
    moved = kernels.draw_in_token_order(view, u.to(device))
    assert torch.equal(moved[0].cpu(), token) and torch.equal(moved[1].cpu(), logprob)


def test_the_frequencies_are_the_softmax(device):
    """Many numbers on one row: each token's share of the draws is its probability. The row
    spans two chunks, with probability in both, around the chunk's edge, and -inf between.
    The numbers are the quantiles ``(i + 1/2) / N``: an inverse CDF then draws each stretch of
    tokens between two given ids ``N * p`` times up to one, a bound tighter than any sample of
    N random numbers would allow."""
    V, N = 2600, 64
    spikes = torch.tensor([0, 7, 1023, 1024, 2047, 2048, 2100, 2599])
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(V, generator=g) - 6.0
    logits[torch.randperm(V, generator=g)[: V // 2]] = float("-inf")
    logits[spikes] = torch.rand(len(spikes), generator=g) * 3.0
    row = torch.log_softmax(logits, -1)
    u = (torch.arange(N, dtype=torch.float64) + 0.5) / N
    got, _ = draw(row.expand(N, V).contiguous(), u, device)
    assert row[got].gt(float("-inf")).all()
    # Stretches: each spike alone, and the ids between two spikes together.
    edges = torch.cat([spikes, spikes + 1]).unique()
    stretch_V = torch.bucketize(torch.arange(V), edges, right=True)
    p = torch.zeros(len(edges) + 1, dtype=torch.float64).index_add_(
        0, stretch_V, row.double().exp()
    )
    counts = torch.bincount(stretch_V[got], minlength=len(edges) + 1).double()
    assert ((counts - N * p / p.sum()).abs() <= 1.0 + 1e-9).all(), (counts, N * p / p.sum())


def test_checks_its_inputs(device):
    rows = logprobs(2, 50, seed=9).to(device)
    u = uniforms(2, seed=9).to(device)
    with pytest.raises(ValueError, match="float32"):
        kernels.draw_in_token_order(rows.double(), u)
    with pytest.raises(ValueError, match="float64"):
        kernels.draw_in_token_order(rows, u.float())
    with pytest.raises(ValueError, match="contiguous"):
        kernels.draw_in_token_order(rows.t().contiguous().t(), u)
    token, logprob = kernels.draw_in_token_order(rows[:0], u[:0])
    assert token.shape == logprob.shape == (0,)


@pytest.mark.gpu
def test_on_the_gpu_the_draws_of_torchs_scan_without_waiting():
    """At Qwen3's vocabulary: the kernel's tokens are torch's float64 scan's on the same GPU
    tensors but at near ties (at least 99 in 100 equal; in practice all), nothing waits for the
    device (sync-debug raises on a wait), a row alone draws what it draws in the batch, and a
    CUDA graph of the two launches replays them on new inputs."""
    B, V = 256, 151936
    rows = logprobs(B, V, seed=10).cuda()
    u = uniforms(B, seed=10).cuda()
    kernels.draw_in_token_order(rows[:1], u[:1])  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        token, logprob = kernels.draw_in_token_order(rows, u)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want, _, _ = reference(rows, u)
    want_logprob = rows.gather(1, want[:, None])[:, 0]
    same = (token == want).cpu()
    assert same.float().mean() >= 0.99
    assert torch.equal(logprob.cpu()[same], want_logprob.cpu()[same])
    assert torch.equal(
        logprob.view(torch.int32), rows.gather(1, token[:, None])[:, 0].view(torch.int32)
    )
    near_ties(token.cpu(), rows, u)  # against the CPU's scan too
    for b in (0, 1, 77, 255):
        alone = kernels.draw_in_token_order(rows[b : b + 1], u[b : b + 1])
        assert alone[0].item() == token[b].item() and alone[1].item() == logprob[b].item()

    static_rows, static_u = rows.clone(), u.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = kernels.draw_in_token_order(static_rows, static_u)
    static_rows.copy_(logprobs(B, V, seed=11).cuda())
    static_u.copy_(uniforms(B, seed=11).cuda())
    graph.replay()
    eager = kernels.draw_in_token_order(static_rows, static_u)
    assert torch.equal(replayed[0], eager[0]) and torch.equal(replayed[1], eager[1])
