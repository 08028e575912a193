"""Sampler: greedy, temperature, top-k / top-p masks, per-sequence seeds, logprob meaning."""

import pytest
import torch

from fp4rl.rollout.config import SamplingParams
from fp4rl.rollout.sampler import make_generator, sample, sequence_seed


def _gens(n, seed=0):
    return [make_generator(seed, 0, j) for j in range(n)]


def test_greedy_is_argmax_with_ties_to_the_lowest_id_and_reports_raw_logprob():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    logits[0, 7] = logits[0, 30] = logits[0].max() + 1.0  # a tie
    out = sample(logits, [SamplingParams(temperature=0)] * 5, _gens(5))
    assert out.token_ids_B.tolist() == logits.argmax(-1).tolist()
    assert out.token_ids_B[0] == 7
    raw = torch.log_softmax(logits, -1).gather(1, out.token_ids_B[:, None])[:, 0]
    assert torch.equal(out.logprobs_B, raw) and torch.equal(out.raw_logprobs_B, raw)


def test_logprob_is_of_the_processed_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=g) * 3
    params = SamplingParams(temperature=0.7, top_k=5)
    out = sample(logits, [params] * 64, _gens(64))
    scaled = logits / 0.7
    top5 = scaled.topk(5, dim=-1)
    for b in range(64):
        tok = int(out.token_ids_B[b])
        assert tok in top5.indices[b].tolist()
        expected = scaled[b, tok] - torch.logsumexp(top5.values[b], 0)
        torch.testing.assert_close(out.logprobs_B[b], expected, rtol=0, atol=1e-5)
        raw = torch.log_softmax(logits[b], 0)[tok]
        torch.testing.assert_close(out.raw_logprobs_B[b], raw, rtol=0, atol=0)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(4000, 4).contiguous()
    out = sample(logits, [SamplingParams(top_p=0.75)] * 4000, _gens(4000))
    # 0.5 + 0.3 reaches 0.75: tokens 1 and 3 stay, renormalized to 0.625 / 0.375.
    assert set(out.token_ids_B.tolist()) == {1, 3}
    frac = (out.token_ids_B == 1).float().mean().item()
    assert abs(frac - 0.625) < 4 * (0.625 * 0.375 / 4000) ** 0.5  # 4 sigma
    expected = torch.where(
        out.token_ids_B == 1, torch.tensor(0.625).log(), torch.tensor(0.375).log()
    )
    torch.testing.assert_close(out.logprobs_B, expected, rtol=0, atol=1e-6)


def test_unmasked_sampling_matches_the_softmax_frequencies():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, float("-inf")]]).expand(20000, 5).contiguous()
    out = sample(logits, [SamplingParams()] * 20000, _gens(20000, seed=3))
    counts = torch.bincount(out.token_ids_B, minlength=5).float()
    p = torch.softmax(logits[0], 0)
    assert counts[4] == 0  # probability zero is never drawn
    sigma = (20000 * p * (1 - p)).sqrt()
    assert ((counts - 20000 * p).abs() <= 4 * sigma + 1e-6).all(), (counts, 20000 * p)


def test_a_row_depends_only_on_its_logits_and_generator():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 30, generator=g)
    params = [
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=0),
        SamplingParams(top_k=3),
        SamplingParams(temperature=1.3),
        SamplingParams(top_k=10, top_p=0.5),
        SamplingParams(),
    ]
    batch = sample(logits, params, [make_generator(11, 0, j) for j in range(6)])
    for b in reversed(range(6)):  # alone, and in another order
        alone = sample(logits[b : b + 1], params[b : b + 1], [make_generator(11, 0, b)])
        assert alone.token_ids_B.item() == batch.token_ids_B[b].item()
        assert alone.logprobs_B.item() == batch.logprobs_B[b].item()


def test_each_token_consumes_exactly_one_draw_even_when_greedy():
    for params in (SamplingParams(), SamplingParams(temperature=0)):
        gen = make_generator(5, 1, 2)
        reference = make_generator(5, 1, 2)
        for _ in range(3):
            sample(torch.randn(1, 10), [params], [gen])
            torch.rand((), generator=reference, dtype=torch.float64)
        assert torch.equal(gen.get_state(), reference.get_state())


def test_sequence_seeds_differ_across_samples_and_prompts():
    seeds = {sequence_seed(0, i, j) for i in range(20) for j in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="2 logit rows, 1 params"):
        sample(torch.zeros(2, 4), [SamplingParams()], _gens(2))
