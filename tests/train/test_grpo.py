"""GRPO advantages, clipped surrogate, mismatch correction and aggregation against worked examples.

Every expected number is written out next to the case as the arithmetic that gives it. Values
are FP32; ``TOL`` covers the few ulps that ``exp(log(x))`` and a sum of four terms cost.
"""

import math

import pytest
import torch

from fp4rl.train.grpo import GrpoConfig, group_advantages, grpo_loss

TOL = dict(rtol=0, atol=1e-6)  # FP32 results of size ~1: a few ulps
NONE = GrpoConfig(correction="none")


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def leaf(*values):
    return t(*values).requires_grad_(True)


def loss_and_grad(logp_new_N, **kwargs):
    kwargs.setdefault("seq_index_N", torch.zeros(logp_new_N.shape[0], dtype=torch.long))
    kwargs.setdefault("num_seqs", 1)
    kwargs.setdefault("logp_rollout_N", logp_new_N.detach())
    loss, metrics = grpo_loss(logp_new_N, **kwargs)
    loss.backward()
    return loss, logp_new_N.grad, metrics


# --- advantages ---------------------------------------------------------------------------


def test_advantages_std_normalized():
    adv, zero_var = group_advantages(t(1, 0, 0, 1)[None], eps=0.0)
    # mean 0.5 -> centred [.5, -.5, -.5, .5]; unbiased std = sqrt(4 * .25 / 3) = sqrt(1/3);
    # .5 / sqrt(1/3) = .5 * sqrt(3) = 0.8660254
    a = 0.5 * math.sqrt(3)
    torch.testing.assert_close(adv, t(a, -a, -a, a)[None], **TOL)
    assert zero_var.tolist() == [False]


def test_advantages_leave_one_out_without_std():
    adv, _ = group_advantages(t(1, 0, 0)[None], normalize_std=False, leave_one_out=True)
    # r0 - mean(0, 0) = 1;  r1 - mean(1, 0) = -0.5;  r2 - mean(1, 0) = -0.5
    torch.testing.assert_close(adv, t(1, -0.5, -0.5)[None], **TOL)
    plain, _ = group_advantages(t(1, 0, 0)[None], normalize_std=False)
    # mean 1/3: [2/3, -1/3, -1/3]
    torch.testing.assert_close(plain, t(2 / 3, -1 / 3, -1 / 3)[None], **TOL)


def test_zero_variance_groups_are_exactly_zero_and_reported():
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    adv, zero_var = group_advantages(rewards)
    assert zero_var.tolist() == [True, False, True]
    assert adv[0].eq(0).all() and adv[2].eq(0).all()  # exactly, not up to 0.1 * 3 / 3 rounding
    # group 1: mean 2/3, centred [1/3, -2/3, 1/3], std = sqrt((1/9 + 4/9 + 1/9) / 2) = 1/sqrt(3)
    s = 1 / math.sqrt(3)
    torch.testing.assert_close(adv[1], t(1 / 3 / s, -2 / 3 / s, 1 / 3 / s), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "rewards", [torch.ones(3), torch.ones(2, 1), torch.tensor([[1.0, float("nan")]])]
)
def test_advantages_reject_bad_rewards(rewards):
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(rewards)


# --- the surrogate --------------------------------------------------------------------------


def test_one_step_loss_is_minus_mean_advantage_with_policy_gradient():
    logp = leaf(-1.0, -2.0, -0.5)
    loss, grad, metrics = loss_and_grad(logp, advantages_N=t(1, 1, -2), config=NONE)
    # r = 1 everywhere: loss = -(1 + 1 - 2) / 3 = 0; d loss / d logp_t = -A_t / 3
    torch.testing.assert_close(loss, torch.tensor(0.0), **TOL)
    torch.testing.assert_close(grad, t(-1 / 3, -1 / 3, 2 / 3), **TOL)
    assert float(metrics["ratio_mean"]) == 1.0
    assert float(metrics["clip_frac_low"]) == float(metrics["clip_frac_high"]) == 0.0


def test_clipping_low_and_high():
    prox = t(-1, -1, -1, -1, -1)
    r = t(1.5, 0.5, 0.5, 1.5, 1.25)
    logp = (prox + r.log()).requires_grad_(True)
    adv = t(2, -1, 1, -1, 1)
    loss, grad, m = loss_and_grad(
        logp, logp_prox_N=prox, logp_rollout_N=prox, advantages_N=adv, config=NONE
    )
    # clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28]:
    # t0 A=+2 r=1.5:  min(3, 2.56) = 2.56, clipped high, grad 0
    # t1 A=-1 r=0.5:  min(-0.5, -0.8) = -0.8, clipped low, grad 0
    # t2 A=+1 r=0.5:  min(0.5, 0.8) = 0.5, unclipped, d(-r A)/d logp = -r A = -0.5
    # t3 A=-1 r=1.5:  min(-1.5, -1.28) = -1.5, unclipped (pessimistic side), grad +1.5
    # t4 A=+1 r=1.25: min(1.25, 1.28) = 1.25, under 1 + clip_high (not 1 + clip_low), -1.25
    # loss = -(2.56 - 0.8 + 0.5 - 1.5 + 1.25) / 5 = -2.01 / 5 = -0.402; grads / 5
    torch.testing.assert_close(loss, torch.tensor(-0.402), **TOL)
    torch.testing.assert_close(grad, t(0, 0, -0.1, 0.3, -0.25), **TOL)
    torch.testing.assert_close(m["clip_frac_low"], torch.tensor(0.2), **TOL)  # t1 of 5
    torch.testing.assert_close(m["clip_frac_high"], torch.tensor(0.2), **TOL)  # t0 of 5
    # (1.5 + 0.5 + 0.5 + 1.5 + 1.25) / 5 = 1.05
    torch.testing.assert_close(m["ratio_mean"], torch.tensor(1.05), **TOL)


# --- rollout / trainer mismatch correction ---------------------------------------------------


def test_truncated_importance_sampling():
    logp = leaf(-1.0, -1.0, -1.0)
    rollout = t(-1 - math.log(3), -1 + math.log(2), -1)
    loss, grad, m = loss_and_grad(
        logp, logp_rollout_N=rollout, advantages_N=t(1, 1, 1), config=GrpoConfig(tis_cap=2.0)
    )
    # rho = exp(logp_train - logp_rollout) = [3, 0.5, 1] -> weight min(rho, 2) = [2, 0.5, 1]
    # loss = -(2 + 0.5 + 1) / 3 = -7/6; grad = -w / 3 = [-2/3, -1/6, -1/3]
    torch.testing.assert_close(loss, torch.tensor(-7 / 6), **TOL)
    torch.testing.assert_close(grad, t(-2 / 3, -1 / 6, -1 / 3), **TOL)
    torch.testing.assert_close(m["correction_frac"], torch.tensor(1 / 3), **TOL)  # rho=3 only
    torch.testing.assert_close(m["is_ratio_mean"], torch.tensor(1.5), **TOL)  # (3+.5+1)/3
    # exp|log rho| = [3, 2, 1] -> mean 2
    torch.testing.assert_close(m["token_mult_prob_error"], torch.tensor(2.0), **TOL)


def test_correction_weight_uses_the_proximal_policy_not_the_current_one():
    prox = t(-1.0)
    logp = (prox + math.log(1.1)).requires_grad_(True)
    loss, _, _ = loss_and_grad(
        logp, logp_prox_N=prox, logp_rollout_N=prox, advantages_N=t(1), config=GrpoConfig()
    )
    # tis with cap 2: rho = exp(prox - rollout) = 1 -> weight 1; r = 1.1 (inside [0.8, 1.28]),
    # loss = -1.1.
    # Weighting by exp(new - rollout) = 1.1 instead would give -1.21.
    torch.testing.assert_close(loss, torch.tensor(-1.1), **TOL)


def test_mask_drops_tokens_but_keeps_them_in_the_token_count():
    logp = leaf(-1.0, -1.0, -1.0, -1.0)
    rollout = -1 - t(3, 0.4, 1.5, 1).log()  # rho = [3, 0.4, 1.5, 1]
    config = GrpoConfig(correction="mask", mask_low=0.5, mask_high=2.0)
    loss, grad, m = loss_and_grad(
        logp, logp_rollout_N=rollout, advantages_N=t(1, 1, 1, -1), config=config
    )
    # rho outside [0.5, 2]: t0 (3), t1 (0.4) -> weight [0, 0, 1, 1]
    # loss = -(0 + 0 + 1 - 1) / 4 = 0; grad = -w A / 4 = [0, 0, -1/4, 1/4] (not / 2)
    torch.testing.assert_close(loss, torch.tensor(0.0), **TOL)
    torch.testing.assert_close(grad, t(0, 0, -0.25, 0.25), **TOL)
    assert float(m["correction_frac"]) == 0.5


def test_sequence_tis_weights_each_completion_by_its_capped_ratio():
    logp = leaf(-1.0, -1.0, -1.0, -1.0, -1.0)
    seq = torch.tensor([0, 0, 1, 1, 2])
    rollout = -1 - t(2, 1.5, 3, 0.5, 0.5).log()  # rho per token
    loss, grad, m = loss_and_grad(
        logp, logp_rollout_N=rollout, advantages_N=t(1, 1, 1, 1, -1), seq_index_N=seq,
        num_seqs=3, config=GrpoConfig(correction="seq_tis", tis_cap=2.0),
    )  # fmt: skip
    # completion ratios: 2 * 1.5 = 3, 3 * 0.5 = 1.5, 0.5 -> weights min(., 2) = 2, 1.5, 0.5,
    # on every token of the completion: [2, 2, 1.5, 1.5, 0.5] (token tis: [2, 1.5, 2, 0.5, 0.5])
    # loss = -(2 + 2 + 1.5 + 1.5 - 0.5) / 5 = -1.3; grad = -w A / 5
    torch.testing.assert_close(loss, torch.tensor(-1.3), **TOL)
    torch.testing.assert_close(grad, t(-0.4, -0.4, -0.3, -0.3, 0.1), **TOL)
    torch.testing.assert_close(m["correction_frac"], torch.tensor(0.4), **TOL)  # completion 0
    torch.testing.assert_close(m["is_weight_mean"], torch.tensor(7.5 / 5), **TOL)
    torch.testing.assert_close(m["is_ratio_mean"], torch.tensor(7.5 / 5), **TOL)  # token rho


def test_sequence_mask_drops_whole_completions_by_their_ratio():
    logp = leaf(-1.0, -1.0, -1.0, -1.0, -1.0)
    seq = torch.tensor([0, 0, 1, 1, 2])
    rollout = -1 - t(3, 0.5, 1.5, 1.5, 0.8).log()
    config = GrpoConfig(correction="seq_mask", mask_low=0.5, mask_high=2.0)
    loss, grad, m = loss_and_grad(
        logp, logp_rollout_N=rollout, advantages_N=t(1, 1, 1, 1, -1), seq_index_N=seq,
        num_seqs=3, config=config,
    )  # fmt: skip
    # completion ratios: 1.5 (kept, though its first token's rho 3 is outside), 2.25 (both
    # tokens dropped), 0.8 (kept) -> weights [1, 1, 0, 0, 1]
    # loss = -(1 + 1 + 0 + 0 - 1) / 5 = -0.2; grad = -w A / 5
    torch.testing.assert_close(loss, torch.tensor(-0.2), **TOL)
    torch.testing.assert_close(grad, t(-0.2, -0.2, 0, 0, 0.2), **TOL)
    torch.testing.assert_close(m["correction_frac"], torch.tensor(0.4), **TOL)
    torch.testing.assert_close(m["is_weight_mean"], torch.tensor(0.6), **TOL)


def test_geometric_mask_drops_completions_by_their_mean_ratio_a_token():
    logp = leaf(-1.0, -1.0, -1.0, -1.0, -1.0)
    seq = torch.tensor([0, 0, 1, 1, 2])
    rollout = -1 - t(1.5, 1 / 1.5, 1.01, 1.05, 0.99).log()
    loss, grad, m = loss_and_grad(
        logp, logp_rollout_N=rollout, advantages_N=t(1, 1, 1, 1, -1), seq_index_N=seq,
        num_seqs=3, config=GrpoConfig(correction="geo_mask"),
    )  # fmt: skip
    # geometric means: sqrt(1.5 / 1.5) = 1 (kept, though each token is 50 % off);
    # sqrt(1.01 * 1.05) = 1.0298 > 1.02 (dropped, though its product 1.06 is inside seq_mask's
    # [0.5, 2]); 0.99 (kept) -> weights [1, 1, 0, 0, 1]; loss = -(1 + 1 + 0 + 0 - 1) / 5
    torch.testing.assert_close(loss, torch.tensor(-0.2), **TOL)
    torch.testing.assert_close(grad, t(-0.2, -0.2, 0, 0, 0.2), **TOL)
    torch.testing.assert_close(m["correction_frac"], torch.tensor(0.4), **TOL)
    _, _, m = loss_and_grad(
        leaf(-1.0, -1.0, -1.0, -1.0, -1.0), logp_rollout_N=rollout,
        advantages_N=t(1, 1, 1, 1, -1), seq_index_N=seq, num_seqs=3,
        config=GrpoConfig(correction="geo_mask", geo_mask_low=0.5, geo_mask_high=1.05),
    )  # fmt: skip
    assert float(m["correction_frac"]) == 0.0  # its own bounds, not mask_low / mask_high


@pytest.mark.parametrize("correction, weight", [("seq_tis", 2.0), ("seq_mask", 0.0)])
def test_sequence_ratio_past_fp32_caps_or_masks_without_nan(correction, weight):
    logp = leaf(-1.0, -1.0, -1.0)
    # log-ratios 50 + 50 = 100: exp(100) is past FP32's range (+inf)
    rollout = t(-51.0, -51.0, -1.0)
    loss, grad, m = loss_and_grad(
        logp, logp_rollout_N=rollout, advantages_N=t(1, 1, 1), seq_index_N=torch.tensor([0, 0, 1]),
        num_seqs=2, config=GrpoConfig(correction=correction),
    )  # fmt: skip
    # weights [weight, weight, 1]; loss = -(2 weight + 1) / 3
    torch.testing.assert_close(loss, torch.tensor(-(2 * weight + 1) / 3), **TOL)
    torch.testing.assert_close(grad, -t(weight, weight, 1) / 3, **TOL)
    assert float(m["correction_frac"]) == pytest.approx(2 / 3)


def test_sequence_correction_uses_the_proximal_policy_not_the_current_one():
    prox = t(-1.0, -1.0)
    logp = (prox + math.log(1.1)).requires_grad_(True)
    rollout = prox - math.log(1.5)  # rho = exp(prox - rollout) = 1.5 a token
    loss, _, _ = loss_and_grad(
        logp, logp_prox_N=prox, logp_rollout_N=rollout, advantages_N=t(1, 1),
        config=GrpoConfig(correction="seq_tis", tis_cap=3.0),
    )  # fmt: skip
    # completion ratio 1.5 * 1.5 = 2.25 (under the cap) on both tokens; r = 1.1 inside the clip:
    # loss = -(2.25 * 1.1 + 2.25 * 1.1) / 2 = -2.475.
    # From the current policy, exp(new - rollout) = 1.65 a token, the ratio would be 2.7225
    # (loss -2.99475).
    torch.testing.assert_close(loss, torch.tensor(-2.475), **TOL)


# --- aggregation, KL, entropy ----------------------------------------------------------------

SEQ_3_1 = torch.tensor([0, 0, 0, 1])  # completion 0 has three tokens, completion 1 one


@pytest.mark.parametrize(
    "aggregation, expected_loss, expected_grad",
    [
        # -(1 + 1 + 1 - 1) / 4 tokens = -0.5; every token -A / 4
        ("token_mean", -0.5, (-1 / 4, -1 / 4, -1 / 4, 1 / 4)),
        # (-(3 / 3) + (1 / 1)) / 2 completions = 0; seq 0 tokens -1 / (3 * 2), seq 1 +1 / 2
        ("seq_mean", 0.0, (-1 / 6, -1 / 6, -1 / 6, 1 / 2)),
    ],
)
def test_token_mean_and_seq_mean(aggregation, expected_loss, expected_grad):
    logp = leaf(-0.1, -0.2, -0.3, -0.4)
    loss, grad, _ = loss_and_grad(
        logp,
        seq_index_N=SEQ_3_1,
        num_seqs=2,
        advantages_N=t(1, 1, 1, -1),
        config=GrpoConfig(correction="none", aggregation=aggregation),
    )
    torch.testing.assert_close(loss, torch.tensor(expected_loss), **TOL)
    torch.testing.assert_close(grad, t(*expected_grad), **TOL)


def test_kl_k3_to_reference():
    logp = leaf(-1.0, -2.0)
    ref = t(-1.0, -2.0 + math.log(2))
    config = GrpoConfig(correction="none", kl_coef=0.1)
    loss, grad, m = loss_and_grad(logp, logp_ref_N=ref, advantages_N=t(0, 0), config=config)
    # d = ref - new = [0, ln 2]; k3 = e^d - d - 1 = [0, 1 - ln 2]; loss = 0.1 * (1 - ln 2) / 2
    # d k3 / d new = 1 - e^d = [0, -1] -> grad = 0.1 * [0, -1] / 2
    k3 = 1 - math.log(2)
    torch.testing.assert_close(loss, torch.tensor(0.1 * k3 / 2), **TOL)
    torch.testing.assert_close(grad, t(0, -0.05), **TOL)
    torch.testing.assert_close(m["kl"], torch.tensor(k3 / 2), **TOL)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs logp_ref_N"):
        grpo_loss(logp, logp_rollout_N=ref, advantages_N=t(0, 0), seq_index_N=SEQ_3_1[:2],
                  num_seqs=1, config=config)  # fmt: skip


def test_entropy_is_reported_only_when_given():
    logp = leaf(-1.0, -2.0)
    _, _, m = loss_and_grad(logp, advantages_N=t(1, 1), config=NONE, entropy_N=t(0.5, 1.5))
    assert float(m["entropy"]) == 1.0  # (0.5 + 1.5) / 2
    _, _, m = loss_and_grad(leaf(-1.0), advantages_N=t(1), config=NONE)
    assert "entropy" not in m and "kl" not in m
    assert all(v.ndim == 0 and not v.requires_grad for v in m.values())


# --- micro-batching --------------------------------------------------------------------------


@pytest.mark.parametrize("correction", ["tis", "seq_tis", "seq_mask", "geo_mask"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batches_sum_to_the_whole_batch(aggregation, correction):
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4, 2, 5]
    seq_N = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths))
    logp = -torch.rand(15, generator=gen)
    adv = torch.randn(5, generator=gen)[seq_N]
    rollout = logp - 0.3 * torch.randn(15, generator=gen)
    # The completions' geometric-mean ratios are 1.23, 0.84, 1.30, 0.84, 1.26: bounds that keep
    # some and drop others.
    config = GrpoConfig(
        aggregation=aggregation, correction=correction, kl_coef=0.05, geo_mask_low=0.8,
        geo_mask_high=1.25,
    )  # fmt: skip
    ref = logp - 0.1

    def run(token_slices, seq_ranges):
        x = logp.clone().requires_grad_(True)
        total = 0.0
        for (a, b), (s0, s1) in zip(token_slices, seq_ranges, strict=True):
            loss, _ = grpo_loss(
                x[a:b], logp_rollout_N=rollout[a:b], advantages_N=adv[a:b],
                seq_index_N=seq_N[a:b] - s0, num_seqs=s1 - s0, config=config,
                logp_ref_N=ref[a:b], total_tokens=15, total_seqs=5,
            )  # fmt: skip
            loss.backward()
            total += float(loss.detach())
        return total, x.grad

    whole_loss, whole_grad = run([(0, 15)], [(0, 5)])
    split_loss, split_grad = run([(0, 4), (4, 10), (10, 15)], [(0, 2), (2, 4), (4, 5)])
    assert split_loss == pytest.approx(whole_loss, abs=1e-6)  # three FP32 sums vs one
    torch.testing.assert_close(split_grad, whole_grad, rtol=0, atol=1e-7)


def test_inputs_are_checked():
    logp = leaf(-1.0, -2.0)
    seq = torch.zeros(2, dtype=torch.long)
    common = dict(logp_rollout_N=t(-1, -2), advantages_N=t(1, 1), num_seqs=1, config=NONE)
    with pytest.raises(ValueError, match="total_tokens=1"):
        grpo_loss(logp, seq_index_N=seq, total_tokens=1, **common)
    with pytest.raises(ValueError, match="seq_index_N must be long"):
        grpo_loss(logp, seq_index_N=seq.int(), **common)
    with pytest.raises(ValueError, match="advantages_N has shape"):
        grpo_loss(logp, seq_index_N=seq, **{**common, "advantages_N": t(1)})


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value",
    [
        ("clip_low", 1.0),
        ("clip_low", -0.1),
        ("clip_high", float("inf")),
        ("tis_cap", 0.5),
        ("mask_low", 0.0),
        ("mask_high", 0.9),
        ("geo_mask_low", 1.01),
        ("geo_mask_high", 0.99),
        ("kl_coef", -1e-3),
        ("kl_coef", True),
        ("normalize_std", 1),
        ("aggregation", "sum"),
        ("correction", "icepop"),
    ],
)
def test_config_rejects_naming_key_and_value(key, value):
    with pytest.raises(ValueError, match=rf"grpo\.{key} .*got {value!r}"):
        GrpoConfig(**{key: value})


def test_config_names_allowed_modes():
    modes = r"\('none', 'tis', 'mask', 'seq_tis', 'seq_mask', 'geo_mask'\)"
    with pytest.raises(ValueError, match=modes):
        GrpoConfig(correction="is")
    assert GrpoConfig(clip_low=0, tis_cap=3).tis_cap == 3.0  # ints become floats
