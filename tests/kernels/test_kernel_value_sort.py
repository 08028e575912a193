"""The sorted draw's kernels (`fp4rl.kernels.value_sort`) against torch's sort and float64 exp.

Everything here is exact: the sorted values are the sort's bits (but that both zeros come out
as +0.0), the token at a rank is the stable sort's id there, and the sampler draws the same
tokens and logprobs with the kernels as without them. The sorts compare -0.0 and +0.0 as equal,
keeping ids in order; one test checks the zeros on their own.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from fp4rl import kernels, ops  # noqa: E402
from fp4rl.rollout import sampler  # noqa: E402
from fp4rl.rollout.config import SamplingParams  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]


def rows(B, V, seed, dtype, kind="peaked"):
    """``[B, V]`` logits of ``dtype``: randn * 4 ("peaked"), a few distinct values ("ties"),
    peaked with -inf at random ("holes"), or peaked with infinities and a stretch of +0.0
    ("specials"); no -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 4
    if kind == "ties":
        x = (x / 3).round()
    elif kind == "holes":
        x[torch.rand(B, V, generator=g) < 0.6] = float("-inf")
    elif kind == "specials":
        x[:, 3] = float("inf")
        x[:, 5:9] = float("-inf")
        x[:, 10:40] = 0.0
    x = x.to(dtype)
    return torch.where(x == 0, torch.zeros_like(x), x)  # +0.0 only


def stable_sort(rows_BV):
    return torch.sort(rows_BV.cpu(), dim=-1, descending=True, stable=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["peaked", "ties", "specials"])
def test_sorted_values_are_the_sorts_bits(device, dtype, kind):
    x = rows(3, 2500 + 7, seed=1, dtype=dtype, kind=kind)
    got, ends = kernels.sort_values_by_counting(x.to(device))
    want = stable_sort(x)[0].float()
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
    assert ends.shape == (3, 1 << 16) and ends.dtype == torch.int32


@pytest.mark.parametrize(
    "kind, dtype",
    [("peaked", torch.bfloat16), ("ties", torch.float16), ("specials", torch.bfloat16)],
    ids=str,
)
def test_the_token_at_every_rank_is_the_stable_sorts(device, kind, dtype):
    """One row repeated once per rank (its counts too), each copy asked for its own rank: every
    rank of the row at once, ties included (the "ties" row holds a dozen values)."""
    V = 200
    x = rows(1, V, seed=2, dtype=dtype, kind=kind)
    _, ends = kernels.sort_values_by_counting(x.to(device))
    x, ends = x.expand(V, V).contiguous(), ends.expand(V, -1).contiguous()
    rank = torch.arange(V)
    got = kernels.token_at_rank(x.to(device), ends, rank.to(device))
    want = stable_sort(x[:1])[1][0]
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), want)


def test_both_zeros_sort_as_one_value_in_id_order(device):
    """As the sorts compare them: -0.0 equal to +0.0, their ids ascending; the sorted row holds
    +0.0 for each."""
    x = torch.tensor([[1.0, -0.0, 0.0, -1.0, -0.0, 0.0, 0.0, 2.0]], dtype=torch.bfloat16)
    got, ends = kernels.sort_values_by_counting(x.to(device))
    assert got.cpu().view(torch.int32)[0].tolist() == [
        torch.tensor(v).view(torch.int32).item() for v in (2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0)
    ]
    rank = torch.arange(8)
    tokens = [
        kernels.token_at_rank(x.to(device), ends, rank[r : r + 1].to(device)).item()
        for r in range(8)
    ]
    assert tokens == [7, 0, 1, 2, 4, 5, 6, 3]
    assert tokens == stable_sort(x)[1][0].tolist()


def test_nan_rows_keep_every_index_in_range(device):
    """NaN logits (refused by the engine after the draw) sort somewhere; every rank still maps
    to a token of the row, and no index leaves it."""
    x = rows(2, 1000, seed=3, dtype=torch.bfloat16)
    x[0, 10] = float("nan")
    x[1] = float("nan")
    x[1, 7] = -float("nan")
    got, ends = kernels.sort_values_by_counting(x.to(device))
    assert got.shape == x.shape
    for r in (0, 1, 500, 999):
        token = kernels.token_at_rank(x.to(device), ends, torch.tensor([r, r]).to(device))
        assert ((token >= 0) & (token < 1000)).all()


def test_the_walks_exponentials_and_live_counts_in_one_pass(device):
    """``x.double().exp()`` (on the GPU torch's bits; interpreted, numpy's exp, as Triton's
    interpreter computes it) and each row's count of entries above -inf, rows longer than a
    program's block."""
    x = torch.log_softmax(torch.randn(3, 5000, generator=torch.Generator().manual_seed(4)) * 4, -1)
    x[0, :5] = float("-inf")
    x[1, ::3] = float("-inf")
    x[2] = float("-inf")
    got, live = kernels.walk_exponentials(x.to(device))
    if device == "cuda":
        want = x.cuda().double().exp().cpu()
    else:
        want = torch.from_numpy(np.exp(x.double().numpy()))
    assert got.dtype == torch.float64 and live.dtype == torch.int64
    assert torch.equal(got.cpu().view(torch.int64), want.view(torch.int64))
    assert live.cpu().tolist() == (x > float("-inf")).sum(-1).tolist()


def test_checks_its_inputs(device):
    x = rows(2, 100, seed=5, dtype=torch.bfloat16).to(device)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        kernels.sort_values_by_counting(x.float())
    with pytest.raises(ValueError, match="contiguous"):
        kernels.sort_values_by_counting(x.t().contiguous().t())
    _, ends = kernels.sort_values_by_counting(x)
    rank = torch.zeros(2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="ends_BN must be int32"):
        kernels.token_at_rank(x, ends[:1], rank)
    with pytest.raises(ValueError, match="rank_B must be int64"):
        kernels.token_at_rank(x, ends, rank.int())
    with pytest.raises(ValueError, match="float32"):
        kernels.walk_exponentials(x)
    empty, _ = kernels.sort_values_by_counting(x[:0])
    assert empty.shape == (0, 100)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_sampler_draws_the_same_with_the_kernels(device, dtype, monkeypatch):
    """`sampler.sample` with its sorted draw's kernels against without them (torch's sort and
    passes, held to the full-sort definition by tests/rollout/test_sampler.py): 16-bit rows at
    temperature 1, cut by top-p or not, beside rows of other settings."""
    monkeypatch.setattr(sampler, "SORTED_DRAW_MIN_ROWS", 1)
    monkeypatch.setattr(ops, "_kernels", lambda x: kernels)  # the CPU's tensors too
    B, V = 6, 1500
    settings = [SamplingParams(), SamplingParams(top_p=0.9), SamplingParams(temperature=0.8)]
    for kind in ("peaked", "ties", "holes"):
        x = rows(B, V, seed=6, dtype=dtype, kind=kind).to(device)
        for params in ([SamplingParams()] * B, [settings[b % 3] for b in range(B)]):
            outs = []
            for on in (True, False):
                monkeypatch.setattr(sampler, "SORTED_DRAW_KERNELS", on)
                gens = [sampler.make_generator(7, b, 0) for b in range(B)]
                out = sampler.sample(x, params, gens)
                outs.append([out.token_ids_B, out.logprobs_B.view(torch.int32)])
                outs[-1].append(out.raw_logprobs_B.view(torch.int32))
            for a, b in zip(*outs, strict=True):
                assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.gpu
def test_on_the_gpu_at_qwen3s_vocabulary():
    """Against torch's GPU sort (the definition's bits there): the values (zeros as +0.0), the
    tokens at random ranks and at every rank of a row's zeros, the exponentials, and the
    sampler's draws with the kernels against without them, reading nothing back."""
    B, V = 300, 151936
    for dtype, kind in ((torch.bfloat16, "peaked"), (torch.float16, "ties")):
        x = rows(B, V, seed=8, dtype=dtype, kind=kind).cuda()
        x[0, :100] = -0.0
        want, order = torch.sort(x, dim=-1, descending=True, stable=True)
        got, ends = kernels.sort_values_by_counting(x)
        assert torch.equal(got.view(torch.int32), (want.float() + 0.0).view(torch.int32))
        rank = torch.randint(0, V, (B,), generator=torch.Generator().manual_seed(9)).cuda()
        token = kernels.token_at_rank(x, ends, rank)
        assert torch.equal(token, order.gather(1, rank[:, None])[:, 0])
        zeros = (want[0] == 0).nonzero()[:, 0]  # row 0's zeros, each rank on a row of its own
        rank = zeros[torch.arange(B, device="cuda") % len(zeros)]
        token = kernels.token_at_rank(
            x[:1].expand(B, V).contiguous(), ends[:1].expand(B, -1).contiguous(), rank
        )
        assert torch.equal(token, order[0, rank])
    logprobs = torch.log_softmax(got, -1)
    probs, live = kernels.walk_exponentials(logprobs)
    assert torch.equal(probs.view(torch.int64), logprobs.double().exp().view(torch.int64))
    assert torch.equal(live, (logprobs > float("-inf")).sum(-1))

    x = rows(B, V, seed=10, dtype=torch.bfloat16).cuda()
    sampler.sample(x, [SamplingParams()] * B, [sampler.make_generator(0, b, 0) for b in range(B)])
    for params in ([SamplingParams()] * B, [SamplingParams(top_p=0.95)] * B):
        outs = []
        for on in (True, False):
            sampler.SORTED_DRAW_KERNELS = on
            try:
                gens = [sampler.make_generator(11, b, 0) for b in range(B)]
                if on:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                out = sampler.sample(x, params, gens)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                sampler.SORTED_DRAW_KERNELS = True
            outs.append((out.token_ids_B, out.logprobs_B, out.raw_logprobs_B))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b)
