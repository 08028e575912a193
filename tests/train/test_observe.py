"""The mismatch observatory on the tiny model in BF16, where the trainer's own rounding differs
from the rollout's: guided rounding agrees everywhere, nearest rounding does not, and most of
its disagreements are adjacent codewords."""

import math

import torch
from tiny_models import engine_config, rollout_model

from fp4rl.records import collate
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.train.grpo import GrpoConfig, grpo_loss
from fp4rl.train.observe import observe, signed_index
from fp4rl.train.policy import policy_logprobs

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7] * 20, [90, 12, 55, 4, 4, 4, 100]]


def test_signed_index_puts_both_zeros_at_zero():
    codes = torch.tensor([0, 8, 1, 9, 7, 15], dtype=torch.uint8)
    assert signed_index(codes).tolist() == [0, 0, 1, -1, 7, -7]


def test_guided_agrees_everywhere_nearest_mostly_adjacent_and_live_routing_is_measured():
    packed, qat = rollout_model("nvfp4", "nvfp4", dtype=torch.bfloat16)
    config = engine_config(capture_routing=True, guidance="full")
    out = Engine(packed, config).generate(PROMPTS, SamplingParams(n=2, max_tokens=12, seed=3))
    batch = collate(out)
    guided = observe(qat, batch, replay=True, guided=True)
    nearest = observe(qat, batch, replay=True, guided=False)
    live = observe(qat, batch, replay=False, guided=False)
    # Signed codewords (the two zeros as one): guided rounding takes the rollout's everywhere.
    assert guided["code_agreement"] == 1.0
    assert {k for k in guided if k.startswith("code_agreement/")} == {
        "code_agreement/expert_input", "code_agreement/expert_hidden", "code_agreement/k",
        "code_agreement/v", "code_agreement/layer1", "code_agreement/layer2",
    }  # fmt: skip
    # BF16 cached decode vs full-sequence forward: nearest rounding disagrees somewhere (a few
    # percent observed), and almost always by one grid step.
    assert 0.5 < nearest["code_agreement"] < 1.0
    assert nearest["adjacent_share"] > 0.9
    assert guided["observed_token_mult_prob_error"] < nearest["observed_token_mult_prob_error"]
    assert guided["observed_kl"] >= 0 and guided["observed_max_abs_dlogp"] < 0.1
    # Per completion: the sum of its tokens' gaps, recomputed here from the same forward.
    with torch.no_grad():
        d_N = policy_logprobs(qat, batch, replay=True, guided=False) - batch.sampling_logprobs_N
    seq_Q = torch.zeros(batch.num_seqs, dtype=torch.float64)
    seq_Q = seq_Q.index_add(0, batch.seq_index_N, d_N.double()).abs()
    assert nearest["observed_seq_abs_dlogp"] == float(seq_Q.sum()) / batch.num_seqs
    assert nearest["observed_seq_max_abs_dlogp"] == float(seq_Q.max())
    assert nearest["observed_seq_past_2x"] == float((seq_Q > math.log(2)).sum()) / batch.num_seqs
    assert guided["observed_seq_abs_dlogp"] < nearest["observed_seq_abs_dlogp"]
    assert 0 <= nearest["observed_seq_past_2x"] <= 1
    assert set(live) >= {"router_agreement/layer1", "router_agreement/layer3"}
    assert all(0 <= live[f"router_agreement/layer{i}"] <= 1 for i in (1, 2, 3))


def test_observed_metrics_never_overwrite_the_updates_in_a_step():
    """The loop merges observe's metrics and the update's into one entry of metrics.jsonl: no
    key may be written by both (the update's gap is over its own tokens, KL to the reference)."""
    packed, qat = rollout_model("nvfp4", "nvfp4", dtype=torch.bfloat16)
    config = engine_config(capture_routing=True, guidance="full")
    out = Engine(packed, config).generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=4, seed=3))
    batch = collate(out)
    observed = observe(qat, batch, replay=True, guided=False)
    logp_N = batch.sampling_logprobs_N.clone().requires_grad_(True)
    _, update = grpo_loss(
        logp_N,
        logp_rollout_N=batch.sampling_logprobs_N,
        advantages_N=torch.ones_like(logp_N),
        seq_index_N=batch.seq_index_N,
        num_seqs=batch.num_seqs,
        config=GrpoConfig(kl_coef=0.1),
        logp_ref_N=batch.sampling_logprobs_N,
        entropy_N=torch.ones_like(logp_N),
    )
    assert {"token_mult_prob_error", "kl", "entropy"} <= set(update)
    assert {"observed_token_mult_prob_error", "observed_kl", "observed_max_abs_dlogp"} <= set(
        observed
    )
    assert not set(observed) & set(update)
