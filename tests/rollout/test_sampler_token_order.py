"""Sampling with ``cdf_order="token"``: the inverse CDF summed in token-id order, no sort. The
same distribution and logprobs as the default draw, one number per token, rows independent of
each other; other tokens than the default draw for the same seed."""

import pytest
import torch

from fp4rl.rollout import sampler
from fp4rl.rollout.config import SamplingParams
from fp4rl.rollout.sampler import make_generator, sample

TOKEN = SamplingParams(cdf_order="token")


def _gens(n, seed=0):
    return [make_generator(seed, 0, j) for j in range(n)]


def _numbers(n, seed=0):
    """The uniform number each of `_gens(n, seed)` gives its first draw."""
    return [torch.rand((), generator=g, dtype=torch.float64).item() for g in _gens(n, seed)]


def test_the_token_is_the_inverse_cdf_in_token_order():
    """Each row's token is the first id whose CDF, summed in id order, exceeds its number
    times the total: here probabilities 0.3, 0.1, 0.4, 0.2 put the boundaries at 0.3, 0.4 and
    0.8, where probability order (0.4, 0.3, 0.2, 0.1) puts them elsewhere."""
    probs = torch.tensor([0.3, 0.1, 0.4, 0.2])
    logits = probs.log().expand(400, 4).contiguous()
    out = sample(logits, [TOKEN] * 400, _gens(400, seed=7))
    cdf = torch.log_softmax(probs.log(), 0).double().exp().cumsum(0)
    want = [int((cdf > u * cdf[-1]).nonzero()[0]) for u in _numbers(400, seed=7)]
    assert out.token_ids_B.tolist() == want
    by_probability = sample(logits, [SamplingParams()] * 400, _gens(400, seed=7))
    assert (by_probability.token_ids_B != out.token_ids_B).float().mean() > 0.3


def test_token_order_matches_the_softmax_frequencies():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, float("-inf")]]).expand(20000, 5).contiguous()
    out = sample(logits, [TOKEN] * 20000, _gens(20000, seed=3))
    counts = torch.bincount(out.token_ids_B, minlength=5).float()
    p = torch.softmax(logits[0], 0)
    assert counts[4] == 0  # probability zero is never drawn
    sigma = (20000 * p * (1 - p)).sqrt()
    assert ((counts - 20000 * p).abs() <= 4 * sigma + 1e-6).all(), (counts, 20000 * p)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_are_those_of_the_default_draw(temperature):
    """``logprob``: log_softmax of the logits over the temperature at the token; ``raw``: of
    the logits themselves; bitwise, as the default draw reports them for a token it picks."""
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(1)) * 4
    out = sample(logits, [SamplingParams(temperature=temperature, cdf_order="token")] * 32,
                 _gens(32))  # fmt: skip
    token = out.token_ids_B[:, None]
    scaled = logits / temperature if temperature != 1.0 else logits
    assert torch.equal(out.logprobs_B, torch.log_softmax(scaled, -1).gather(1, token)[:, 0])
    assert torch.equal(out.raw_logprobs_B, torch.log_softmax(logits, -1).gather(1, token)[:, 0])


def test_a_row_depends_only_on_its_logits_and_generator():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2)) * 3
    params = [
        TOKEN,
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=0.7, cdf_order="token"),
        SamplingParams(top_k=3),
        SamplingParams(temperature=0, cdf_order="token"),
        SamplingParams(),
    ]
    batch = sample(logits, params, [make_generator(11, 0, j) for j in range(6)])
    for b in reversed(range(6)):
        alone = sample(logits[b : b + 1], params[b : b + 1], [make_generator(11, 0, b)])
        assert alone.token_ids_B.item() == batch.token_ids_B[b].item()
        assert alone.logprobs_B.item() == batch.logprobs_B[b].item()
        assert alone.raw_logprobs_B.item() == batch.raw_logprobs_B[b].item()
    assert batch.token_ids_B[4] == logits[4].argmax()  # greedy stays an argmax


def test_each_token_consumes_exactly_one_draw():
    gen, reference = make_generator(5, 1, 2), make_generator(5, 1, 2)
    for _ in range(3):
        sample(torch.randn(1, 10), [TOKEN], [gen])
        torch.rand((), generator=reference, dtype=torch.float64)
    assert torch.equal(gen.get_state(), reference.get_state())


def test_a_number_at_the_total_draws_the_last_token_of_positive_probability():
    """No CDF value exceeds the total: a number at it (u = 1, which torch.rand never gives)
    draws the last token that has probability, never an id past the vocabulary or a token of
    probability zero behind it."""
    logprobs = torch.log_softmax(torch.tensor([[0.5, -1.0, 2.0, float("-inf"), float("-inf")]]), -1)
    token, logprob = sampler._draw_in_token_order(
        logprobs, torch.tensor([1.0], dtype=torch.float64)
    )
    assert token.tolist() == [2] and logprob.item() == logprobs[0, 2].item()
    token, _ = sampler._draw_in_token_order(logprobs, torch.tensor([0.0], dtype=torch.float64))
    assert token.tolist() == [0]


def test_nan_logits_still_index_inside_the_vocabulary():
    logits = torch.full((2, 8), float("nan"))
    out = sample(logits, [TOKEN] * 2, _gens(2))
    assert ((out.token_ids_B >= 0) & (out.token_ids_B < 8)).all()


def test_sampling_reads_nothing_back_from_the_device():
    """Logits on the meta device hold no values: a read back (which would wait for a GPU
    step) raises."""
    params = [TOKEN, SamplingParams(temperature=0.5, cdf_order="token"), SamplingParams()]
    out = sample(torch.empty(3, 500, device="meta"), params, _gens(3))
    assert all(t.device.type == "meta" for t in (out.token_ids_B, out.logprobs_B))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_without_waiting_the_draws_of_the_cpu():
    """On the GPU nothing waits for the device (sync-debug raises on a wait), and the draws are
    the CPU's but where the GPU's sums, in another order, move a CDF boundary past a number:
    at Qwen3's vocabulary, at most one row in a hundred, logprobs within FP32 rounding."""
    B, V = 256, 151936
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(4)) * 4
    params = [TOKEN, SamplingParams(temperature=0.7, cdf_order="token")] * (B // 2)
    on_gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(on_gpu, params, _gens(B))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = sample(logits, params, _gens(B))
    same = out.token_ids_B.cpu() == cpu.token_ids_B
    assert same.float().mean() >= 0.99
    torch.testing.assert_close(out.logprobs_B.cpu()[same], cpu.logprobs_B[same], rtol=0, atol=1e-4)
