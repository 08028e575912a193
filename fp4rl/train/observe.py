"""The mismatch observatory: how far the trainer's recompute is from what the rollout computed.

`observe(policy, batch, ...)` runs one forward of the trainer without gradient, the way the
update runs it (replay and rounding as configured), capturing the trainer's FP4 site records
and routing, and compares them with the rollout's records in the batch:

- code agreement at the captured sites (overall, per layer, per site kind) against the
  rollout's full records, and the share of disagreements that are adjacent codewords on the
  signed E2M1 grid (+0 and -0 count as one codeword), and the share of block scales that are
  bitwise equal (below 1 only when the trainer rounds with its own scales); against compact
  records, agreement of the mantissa bit in the layers compact guidance keeps; against sparse
  records, agreement of the mantissa bit at the recorded values and the share of values
  recorded (overall agreement needs the rollout's full codes: `benchmarks/guidance.py`
  measures it for sparse records by generating the same completions twice);
- the logprob gap on the sampled tokens of the observed batch: ``observed_token_mult_prob_error``
  = mean exp(|d|), ``observed_kl``, the KL of the rollout's token distribution to the trainer's
  estimated on the sampled tokens (the k3 estimator, exp(d) - d - 1 with d = logp_train -
  logp_rollout), and ``observed_max_abs_dlogp`` = max |d|. Prefixed, because the update
  reports its own ``token_mult_prob_error`` (over the tokens it trains on) and ``kl`` (to the
  reference policy) into the same step's metrics;
- the same gap per completion, the sum D of its tokens' d (D = log of the ratio pi_train(y|x) /
  mu(y|x) that `grpo.correction`'s sequence forms weight by): ``observed_seq_abs_dlogp`` =
  mean |D| over the completions, ``observed_seq_max_abs_dlogp`` = max |D|, and
  ``observed_seq_past_2x``, the share of completions whose ratio lies outside [1/2, 2];
- without replay: per layer, the share of tokens whose trainer top-k expert set equals the
  rollout's.

Every metric is a ratio of sums over the batch (or, for ``observed_max_abs_dlogp``, a
maximum): `observe_counts` returns those sums and maxima (`Observed`), which add up over
batches (the shares of several ranks), and `observed_metrics` turns them into the metrics.
`observe` is the two in one.

It does not own the metrics of the update itself (`fp4rl.train.grpo`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fp4rl.fp4 import CompactCodes, NVFP4Tensor, SparseCodes, compact
from fp4rl.fp4.reference import unpack_e2m1
from fp4rl.fp4.rounding import unpack_bits
from fp4rl.model.sites import SiteRecords
from fp4rl.records import TrainBatch, record_to
from fp4rl.train.policy import policy_logprobs


def signed_index(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes as positions on the signed grid, -7..7 (both zeros at 0)."""
    magnitude = (codes & 7).to(torch.int8)
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


@dataclass
class Observed:
    """What the metrics of `observe` are made of: ``sums`` (counts, and sums of per-token
    terms, as floats), added up over batches, and ``maxima``, whose largest is kept. Keys are
    ``"<metric> <part>"``."""

    sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)


def observe(
    policy,
    batch: TrainBatch,
    *,
    replay: bool,
    guided: bool,
    temperature: float = 1.0,
    forward: str = "packed",
) -> dict[str, float]:
    """Mismatch metrics of ``batch`` (see the module docstring); keys are flat for JSONL:
    ``code_agreement``, ``code_agreement/<site>``, ``code_agreement/layer<i>``,
    ``adjacent_share``, ``block_scale_agreement``, ``mantissa_agreement``,
    ``sparse_bit_agreement``, ``sparse_recorded_share``, ``observed_token_mult_prob_error``,
    ``observed_kl``, ``observed_max_abs_dlogp``, ``observed_seq_abs_dlogp``,
    ``observed_seq_max_abs_dlogp``, ``observed_seq_past_2x``, ``router_agreement/layer<i>``.
    ``forward``: the trainer's attention, as the update runs it (`policy_logprobs`)."""
    counts = observe_counts(
        policy, batch, replay=replay, guided=guided, temperature=temperature, forward=forward
    )
    return observed_metrics(counts)


@torch.no_grad()
def observe_counts(
    policy,
    batch: TrainBatch,
    *,
    replay: bool,
    guided: bool,
    temperature: float = 1.0,
    forward: str = "packed",
) -> Observed:
    """The sums and maxima the metrics of `observe` are computed from (its arguments)."""
    rec = SiteRecords()
    logp_N = policy_logprobs(
        policy,
        batch,
        replay=replay,
        guided=guided,
        capture=rec,
        temperature=temperature,
        forward=forward,
    )
    out = Observed()
    if batch.sampling_logprobs_N is not None:
        d_N = logp_N.cpu() - batch.sampling_logprobs_N
        # Each token's term in FP32, their sums in FP64: any grouping of the tokens adds up to
        # the same sums but for the last FP64 bits.
        out.sums["gap tokens"] = float(d_N.numel())
        out.sums["gap exp_abs_sum"] = float(d_N.abs().exp().double().sum())
        out.sums["gap k3_sum"] = float((d_N.exp() - d_N - 1).double().sum())
        out.maxima["gap max_abs"] = float(d_N.abs().max())
        seq_d = torch.zeros(batch.num_seqs, dtype=torch.float64)
        seq_d = seq_d.index_add(0, batch.seq_index_N.cpu(), d_N.double()).abs()
        out.sums["gap seqs"] = float(batch.num_seqs)
        out.sums["gap seq_abs_sum"] = float(seq_d.sum())
        out.sums["gap seq_past_2x"] = float((seq_d > math.log(2)).sum())
        out.maxima["gap seq_max_abs"] = float(seq_d.max())
    out.sums.update(_codes(rec, batch))
    if not replay and batch.routing is not None:
        for i, layer in enumerate(policy.moe_layers):
            ours = rec.routing[layer].sort(-1).values.cpu()
            theirs = batch.routing[i].sort(-1).values.cpu().to(ours.dtype)
            key = f"router_agreement/layer{layer}"
            out.sums[f"{key} agree"] = float((ours == theirs).all(-1).sum())
            out.sums[f"{key} total"] = float(ours.shape[0])
    return out


def observed_metrics(counts: Observed) -> dict[str, float]:
    """The metrics of `observe` from its sums and maxima (of one batch or of several)."""
    s, out = counts.sums, {}
    if s.get("gap tokens"):
        out["observed_token_mult_prob_error"] = s["gap exp_abs_sum"] / s["gap tokens"]
        out["observed_kl"] = s["gap k3_sum"] / s["gap tokens"]
        out["observed_max_abs_dlogp"] = counts.maxima["gap max_abs"]
        out["observed_seq_abs_dlogp"] = s["gap seq_abs_sum"] / s["gap seqs"]
        out["observed_seq_max_abs_dlogp"] = counts.maxima["gap seq_max_abs"]
        out["observed_seq_past_2x"] = s["gap seq_past_2x"] / s["gap seqs"]
    for key, total in s.items():
        metric, part = key.rsplit(" ", 1)
        if part != "total" or not total:
            continue
        agree = s[f"{metric} agree"]
        if metric == "sparse_bit_agreement":
            recorded = s[f"{metric} recorded"]
            out[metric] = agree / recorded if recorded else 1.0
            out["sparse_recorded_share"] = recorded / total
        else:
            out[metric] = agree / total
        if metric == "code_agreement":
            adjacent = s["code_agreement adjacent"]
            out["adjacent_share"] = adjacent / (total - agree) if total > agree else 1.0
    return out


def _codes(rec: SiteRecords, batch: TrainBatch) -> dict[str, float]:
    """The counts of the code, scale and bit agreements at the captured sites."""
    counts: dict[str, list[int]] = {}  # key -> [agree, total, adjacent disagreements]
    bits, sparse_bits, scales = [0, 0], [0, 0, 0], [0, 0]
    for (layer, site), rollout in (batch.guidance or {}).items():
        mine = rec.sites.get((layer, site))
        if rollout is None or mine is None:
            continue
        if isinstance(rollout, CompactCodes):
            a = unpack_bits(compact(mine).mantissa_bits.cpu())
            b = unpack_bits(rollout.mantissa_bits.cpu())
            bits[0] += int((a == b).sum())
            bits[1] += a.numel()
            continue
        if isinstance(rollout, SparseCodes):
            recorded, bit = record_to(rollout, "cpu").expand()
            mine_bit = unpack_e2m1(mine.codes.cpu()) & 1
            sparse_bits[0] += int((mine_bit[recorded] == bit[recorded]).sum())
            sparse_bits[1] += int(recorded.sum())
            sparse_bits[2] += recorded.numel()
            continue
        assert isinstance(rollout, NVFP4Tensor)
        theirs = rollout.block_scale.cpu().view(torch.uint8)
        scales[0] += int((mine.block_scale.cpu().view(torch.uint8) == theirs).sum())
        scales[1] += theirs.numel()
        a = signed_index(unpack_e2m1(mine.codes.cpu()))
        b = signed_index(unpack_e2m1(rollout.codes.cpu()))
        agree, total = int((a == b).sum()), a.numel()
        adjacent = int(((a.to(torch.int16) - b.to(torch.int16)).abs() == 1).sum())
        for key in ("", f"/{site}", f"/layer{layer}"):
            c = counts.setdefault(key, [0, 0, 0])
            c[0], c[1], c[2] = c[0] + agree, c[1] + total, c[2] + adjacent
    out: dict[str, float] = {}
    for key, (agree, total, adjacent) in counts.items():
        out[f"code_agreement{key} agree"] = float(agree)
        out[f"code_agreement{key} total"] = float(total)
        if not key:
            out["code_agreement adjacent"] = float(adjacent)
    if scales[1]:
        out["block_scale_agreement agree"] = float(scales[0])
        out["block_scale_agreement total"] = float(scales[1])
    if bits[1]:
        out["mantissa_agreement agree"] = float(bits[0])
        out["mantissa_agreement total"] = float(bits[1])
    if sparse_bits[2]:
        for part, value in zip(("agree", "recorded", "total"), sparse_bits, strict=True):
            out[f"sparse_bit_agreement {part}"] = float(value)
    return out
