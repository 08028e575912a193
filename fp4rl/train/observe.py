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
- without replay: per layer, the share of tokens whose trainer top-k expert set equals the
  rollout's.

It does not own the metrics of the update itself (`fp4rl.train.grpo`).
"""

from __future__ import annotations

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


@torch.no_grad()
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
    ``observed_kl``, ``observed_max_abs_dlogp``, ``router_agreement/layer<i>``. ``forward``:
    the trainer's attention, as the update runs it (`policy_logprobs`)."""
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
    out: dict[str, float] = {}
    if batch.sampling_logprobs_N is not None:
        d_N = logp_N.cpu() - batch.sampling_logprobs_N
        out["observed_token_mult_prob_error"] = float(d_N.abs().exp().mean())
        out["observed_kl"] = float((d_N.exp() - d_N - 1).mean())
        out["observed_max_abs_dlogp"] = float(d_N.abs().max())
    out.update(_codes(rec, batch))
    if not replay and batch.routing is not None:
        for i, layer in enumerate(policy.moe_layers):
            ours = rec.routing[layer].sort(-1).values.cpu()
            theirs = batch.routing[i].sort(-1).values.cpu().to(ours.dtype)
            out[f"router_agreement/layer{layer}"] = float((ours == theirs).all(-1).float().mean())
    return out


def _codes(rec: SiteRecords, batch: TrainBatch) -> dict[str, float]:
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
    out = {f"code_agreement{key}": agree / total for key, (agree, total, _) in counts.items()}
    if "" in counts:
        agree, total, adjacent = counts[""]
        out["adjacent_share"] = adjacent / (total - agree) if total > agree else 1.0
    if scales[1]:
        out["block_scale_agreement"] = scales[0] / scales[1]
    if bits[1]:
        out["mantissa_agreement"] = bits[0] / bits[1]
    if sparse_bits[2]:
        agree, recorded, total = sparse_bits
        out["sparse_bit_agreement"] = agree / recorded if recorded else 1.0
        out["sparse_recorded_share"] = recorded / total
    return out
