"""The GRPO objective as plain functions over flat per-token tensors.

Owns group advantages, the clipped surrogate, the correction for the rollout/trainer mismatch,
the optional KL to a reference policy and the aggregation over the batch (including the
normalizers that make micro-batching exact). Does not own computing log-probabilities (the
model), packing completions into one token stream (the train step) or the optimizer.

Legend: G prompts (groups), S samples per prompt, N trained token positions of this call (the
completions of several samples packed one after another), Q completions of this call.

Three policies meet here, as in decoupled PPO:

- rollout ``mu``: the engine that sampled (NVFP4 kernels, cached decode): ``logp_rollout_N``;
- proximal ``pi_prox``: the trainer's policy at the start of this optimizer step, i.e. its own
  recompute of the sampled tokens: ``logp_prox_N``;
- current ``pi``: ``logp_new_N``, the only input that carries a gradient.

Per token, with ``r = exp(logp_new - logp_prox)`` and ``rho = exp(logp_prox - logp_rollout)``::

    loss_t = w * -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3_t

The clip keeps several steps on one rollout near ``pi_prox``; ``w`` corrects for the sample
having come from ``mu``, not ``pi_prox``: per token from its own ``rho`` ("tis", "mask"), or per
completion from the completion's ratio ``pi_prox(y|x) / mu(y|x)``, the product of its tokens'
``rho``, the same weight on each of its tokens ("seq_tis", "seq_mask"), or its geometric mean
(the mean of its tokens' ``log rho``, exp'd: "geo_mask"). With one step per
rollout ``logp_prox`` is left out and defaults to ``logp_new.detach()``: ``r`` is 1 in value and
its gradient is that of ``logp_new``, so nothing is clipped and ``w`` alone handles the FP4
rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from fp4rl import checks

Aggregation = Literal["token_mean", "seq_mean"]
Correction = Literal["none", "tis", "mask", "seq_tis", "seq_mask", "geo_mask"]
# The corrections weighting a completion by its own ratio (the product of its tokens' ratios)
# or by that ratio's geometric mean over its tokens.
SEQUENCE_CORRECTIONS = ("seq_tis", "seq_mask", "geo_mask")


@dataclass(frozen=True, kw_only=True, slots=True)
class GrpoConfig:
    normalize_std: bool = True  # divide each group's advantages by its reward std
    leave_one_out: bool = False  # baseline = mean of the other samples of the group
    clip_low: float = 0.2  # r below 1 - clip_low stops pushing a negative-advantage token down
    clip_high: float = 0.28  # larger than clip_low ("clip higher") so rare tokens can rise
    aggregation: Aggregation = "token_mean"
    # Rollout/trainer mismatch: none | tis | mask (each token by its own ratio rho) | seq_tis |
    # seq_mask (each completion by its ratio, the product of its tokens' rho) | geo_mask (each
    # completion by that ratio's geometric mean, the same scale at any length).
    correction: Correction = "tis"
    tis_cap: float = 2.0  # "tis": weight = min(rho, tis_cap); "seq_tis": the completion's, capped
    # "mask": tokens with rho outside [mask_low, mask_high] get weight 0; "seq_mask": every token
    # of a completion whose ratio lies outside.
    mask_low: float = 0.5
    mask_high: float = 2.0
    # "geo_mask": every token of a completion whose geometric-mean ratio lies outside
    # [geo_mask_low, geo_mask_high] gets weight 0 (2 % a token on average, either way).
    geo_mask_low: float = 0.98
    geo_mask_high: float = 1.02
    kl_coef: float = 0.0  # > 0 needs logp_ref_N (a frozen reference policy)
    # Leave samples cut off by max_tokens out of the update (they are counted either way).
    mask_truncated: bool = False
    # Optimizer steps per rollout: prompt p's samples go to mini-batch p % mini_batches, one
    # update each, in order. From the second on, r and the correction are taken against the
    # policy the step started from (its log-probs scored before the first update), so the clip
    # binds. optim's warm-up and schedule count optimizer steps.
    mini_batches: int = 1

    def __post_init__(self) -> None:
        for key in ("normalize_std", "leave_one_out", "mask_truncated"):
            checks.boolean(f"grpo.{key}", getattr(self, key))
        for key, allowed in (("aggregation", Aggregation), ("correction", Correction)):
            checks.choice(f"grpo.{key}", getattr(self, key), get_args(allowed))
        # 1 - clip_low must stay positive, or the low clip would never bind.
        checks.number("grpo.clip_low", self.clip_low, "in [0, 1)", lambda v: 0 <= v < 1)
        checks.number("grpo.clip_high", self.clip_high, ">= 0", lambda v: v >= 0)
        # A cap below 1 would down-weight tokens on which rollout and trainer agree exactly.
        checks.number("grpo.tis_cap", self.tis_cap, ">= 1", lambda v: v >= 1)
        checks.number("grpo.mask_low", self.mask_low, "in (0, 1]", lambda v: 0 < v <= 1)
        checks.number("grpo.mask_high", self.mask_high, ">= 1", lambda v: v >= 1)
        checks.number("grpo.geo_mask_low", self.geo_mask_low, "in (0, 1]", lambda v: 0 < v <= 1)
        checks.number("grpo.geo_mask_high", self.geo_mask_high, ">= 1", lambda v: v >= 1)
        checks.number("grpo.kl_coef", self.kl_coef, ">= 0", lambda v: v >= 0)
        checks.integer("grpo.mini_batches", self.mini_batches, 1)
        floats = ("clip_low", "clip_high", "tis_cap", "mask_low", "mask_high", "geo_mask_low",
                  "geo_mask_high", "kl_coef")  # fmt: skip
        for key in floats:
            object.__setattr__(self, key, float(getattr(self, key)))


def group_advantages(
    rewards_GS: torch.Tensor,
    *,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages ``[G, S]`` (FP32) of each sample against its group, and ``zero_var_G`` (bool):
    the groups whose rewards are all equal, whose advantages are exactly 0.

    ``A = r - mean(r)``; with ``leave_one_out`` the baseline excludes the sample itself,
    ``r_i - mean_{j != i} r_j = S / (S - 1) * (r_i - mean(r))``; with ``normalize_std`` the
    result is divided by ``std(r) + eps`` (the unbiased std of the group's rewards).
    """
    if rewards_GS.ndim != 2 or rewards_GS.shape[1] < 2:
        raise ValueError(f"rewards must be [prompts, samples >= 2], got {tuple(rewards_GS.shape)}")
    if not rewards_GS.dtype.is_floating_point or not torch.isfinite(rewards_GS).all():
        raise ValueError("rewards must be finite floating-point values")
    # FP64 so that a group of equal rewards centres to exactly zero before the cast.
    r_GS = rewards_GS.double()
    num_samples = r_GS.shape[1]
    adv_GS = r_GS - r_GS.mean(dim=1, keepdim=True)
    if leave_one_out:
        adv_GS = adv_GS * (num_samples / (num_samples - 1))
    if normalize_std:
        adv_GS = adv_GS / (r_GS.std(dim=1, keepdim=True) + eps)
    zero_var_G = (r_GS == r_GS[:, :1]).all(dim=1)
    adv_GS = torch.where(zero_var_G[:, None], 0.0, adv_GS)
    return adv_GS.float(), zero_var_G


def _check_tokens(logp_new_N: torch.Tensor, seq_index_N: torch.Tensor, **others) -> None:
    if logp_new_N.ndim != 1 or not logp_new_N.dtype.is_floating_point:
        raise ValueError(f"logp_new_N must be 1-D floating point, got {logp_new_N.shape}")
    if seq_index_N.dtype != torch.long or seq_index_N.shape != logp_new_N.shape:
        raise ValueError(
            f"seq_index_N must be long {tuple(logp_new_N.shape)}, "
            f"got {seq_index_N.dtype} {tuple(seq_index_N.shape)}"
        )
    for name, t in others.items():
        if t is not None and t.shape != logp_new_N.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logp_new_N {logp_new_N.shape}")


def grpo_loss(
    logp_new_N: torch.Tensor,
    *,
    logp_rollout_N: torch.Tensor,
    advantages_N: torch.Tensor,
    seq_index_N: torch.Tensor,
    num_seqs: int,
    config: GrpoConfig,
    logp_prox_N: torch.Tensor | None = None,
    logp_ref_N: torch.Tensor | None = None,
    entropy_N: torch.Tensor | None = None,
    total_tokens: int | None = None,
    total_seqs: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one (micro-)batch and its metrics (detached 0-d FP32 tensors, so that
    reading them costs no device sync until the caller logs them).

    ``seq_index_N`` in ``[0, num_seqs)`` names each token's completion; ``advantages_N`` is the
    completion's advantage repeated over its tokens. ``total_tokens`` / ``total_seqs`` are the
    counts of the whole batch when this call sees one micro-batch of it: the sum of the
    micro-batch losses is then the whole-batch loss, however the batch was split (seq_mean
    needs each completion whole inside one micro-batch). They default to this call's counts.
    A completion with no tokens here adds 0 to the seq_mean sum but still counts in
    ``total_seqs``. The sequence corrections take a completion's ratio from its tokens in this
    call, so they too need each completion whole inside one micro-batch. Metrics are means over
    this call's tokens: weight them by its token count to combine micro-batches.
    """
    _check_tokens(
        logp_new_N, seq_index_N, logp_rollout_N=logp_rollout_N, advantages_N=advantages_N,
        logp_prox_N=logp_prox_N, logp_ref_N=logp_ref_N, entropy_N=entropy_N,
    )  # fmt: skip
    num_tokens = logp_new_N.shape[0]
    total_tokens = num_tokens if total_tokens is None else total_tokens
    total_seqs = num_seqs if total_seqs is None else total_seqs
    if total_tokens < num_tokens or total_seqs < num_seqs:
        raise ValueError(
            f"total_tokens={total_tokens}, total_seqs={total_seqs} count fewer than this call's "
            f"{num_tokens} tokens / {num_seqs} completions"
        )
    if config.kl_coef > 0 and logp_ref_N is None:
        raise ValueError(f"grpo.kl_coef={config.kl_coef} needs logp_ref_N")
    f32 = torch.float32
    logp_new_N = logp_new_N.to(f32)
    adv_N = advantages_N.to(f32)
    logp_prox_N = logp_new_N.detach() if logp_prox_N is None else logp_prox_N.to(f32)

    def per_seq(x_N: torch.Tensor) -> torch.Tensor:
        """The sum of ``x_N`` over each completion's tokens in this call, ``[num_seqs]``."""
        return torch.zeros(num_seqs, dtype=f32, device=x_N.device).index_add(0, seq_index_N, x_N)

    ratio_N = torch.exp(logp_new_N - logp_prox_N)
    clipped_N = ratio_N.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    surrogate_N = -torch.minimum(ratio_N * adv_N, clipped_N * adv_N)

    with torch.no_grad():
        log_rho_N = logp_prox_N - logp_rollout_N.to(f32)
        rho_N = torch.exp(log_rho_N)
        # The ratio each token is weighted by: its own, or its completion's (on each of its
        # tokens: the sum of their log-ratios, exp'd; +inf past FP32's range, which caps to
        # tis_cap and is masked like any ratio above mask_high).
        weighted_N = rho_N
        if config.correction in SEQUENCE_CORRECTIONS:
            log_rho_Q = per_seq(log_rho_N)
            if config.correction == "geo_mask":  # the mean over the completion's tokens here
                log_rho_Q = log_rho_Q / per_seq(torch.ones_like(log_rho_N)).clamp(min=1.0)
            weighted_N = torch.exp(log_rho_Q)[seq_index_N]
        if config.correction in ("tis", "seq_tis"):
            weight_N = weighted_N.clamp(max=config.tis_cap)
            touched_N = weighted_N > config.tis_cap
        elif config.correction in ("mask", "seq_mask", "geo_mask"):
            geo = config.correction == "geo_mask"
            low = config.geo_mask_low if geo else config.mask_low
            high = config.geo_mask_high if geo else config.mask_high
            touched_N = (weighted_N < low) | (weighted_N > high)
            weight_N = (~touched_N).to(f32)
        else:
            weight_N = torch.ones_like(rho_N)
            touched_N = torch.zeros_like(rho_N, dtype=torch.bool)
    loss_N = weight_N * surrogate_N

    kl_N = None
    if logp_ref_N is not None:
        # k3 = exp(d) - d - 1 with d = log pi_ref - log pi: unbiased for KL(pi || pi_ref) under
        # samples of pi, never negative. Not importance-weighted: it regularizes, not estimates.
        d_N = logp_ref_N.to(f32) - logp_new_N
        kl_N = torch.exp(d_N) - d_N - 1.0
        loss_N = loss_N + config.kl_coef * kl_N

    if config.aggregation == "token_mean":
        loss = loss_N.sum() / max(total_tokens, 1)
    else:
        len_Q = per_seq(torch.ones_like(loss_N))
        loss = (per_seq(loss_N) / len_Q.clamp(min=1.0)).sum() / max(total_seqs, 1)

    with torch.no_grad():

        def mean(x_N: torch.Tensor) -> torch.Tensor:
            return x_N.to(f32).sum() / max(num_tokens, 1)

        metrics = {
            "clip_frac_low": mean((adv_N < 0) & (ratio_N < 1.0 - config.clip_low)),
            "clip_frac_high": mean((adv_N > 0) & (ratio_N > 1.0 + config.clip_high)),
            "correction_frac": mean(touched_N),
            "ratio_mean": mean(ratio_N),
            "is_ratio_mean": mean(rho_N),
            "is_weight_mean": mean(weight_N),
            # The rollout/trainer gap: mean over tokens of exp(|logp_train - logp_rollout|).
            "token_mult_prob_error": mean(torch.exp(log_rho_N.abs())),
        }
        if kl_N is not None:
            metrics["kl"] = mean(kl_N)
        if entropy_N is not None:
            metrics["entropy"] = mean(entropy_N)
    return loss, metrics
