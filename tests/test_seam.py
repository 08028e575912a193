"""The rollout -> trainer seam: completions from the NVFP4 engine, packed by `collate`, scored by
`policy_logprobs` with router replay and guidance, as the training loop will do it.

Claims (FP32 on the CPU, tiny model with FP4 experts and NVFP4 KV in layers 1-2):
- full guidance: the trainer recomputes every code the rollout recorded at every captured site
  (bitwise, up to the sign of zero: `assertions.assert_matches_rollout`) and every logprob to
  LOGPROB_ATOL (only summation order differs: paged decode against a packed full-sequence
  forward);
- compact guidance: the kept layers' mantissa bits bitwise, logprobs to LOGPROB_ATOL;
- packing changes nothing: scoring the batch at once equals scoring each completion alone.
"""

import pytest
import torch
from assertions import assert_matches_rollout
from tiny_models import engine_config, rollout_model

from fp4rl.fp4 import CompactCodes, NVFP4Tensor, compact
from fp4rl.model.sites import SiteRecords
from fp4rl.records import Completion, collate, record_rows
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.train.policy import policy_logprobs

LOGPROB_ATOL = 1e-5  # FP32; observed ~2e-6
PROMPTS = [[5, 9, 14, 2, 77, 3, 3], [101, 4], [8, 8, 8, 61, 12, 90, 33, 1, 0, 7, 19]]


@pytest.fixture(scope="module")
def models():
    return rollout_model("nvfp4", "nvfp4", seed=3)


def generate(packed, guidance: str, n: int = 3, **sampling):
    config = engine_config(capture_routing=True, guidance=guidance)
    # A stop set of a tenth of the vocabulary ends samples at different lengths.
    stop = tuple(range(0, 128, 10))
    params = SamplingParams(n=n, max_tokens=14, seed=21, stop_token_ids=stop, **sampling)
    return Engine(packed, config).generate(PROMPTS, params)


@torch.no_grad()
def test_full_guidance_recomputes_every_code_and_logprob_of_a_packed_batch(models):
    packed, qat = models
    out = generate(packed, "full")
    assert len(out) == 9 and len({len(c.completion_ids) for c in out}) > 1  # lengths differ
    batch = collate(out)
    assert batch.num_seqs == 9 and batch.tokens_T.shape[0] == sum(batch.seq_lens)
    rec, stats = SiteRecords(), {}
    got_N = policy_logprobs(qat, batch, capture=rec, stats=stats)
    assert stats["replay_fallback_tokens"] == 0
    torch.testing.assert_close(got_N, batch.rollout_logprobs_N, rtol=0, atol=LOGPROB_ATOL)
    assert rec.sites.keys() == batch.guidance.keys() == qat.plan.guided_keys()
    for key, rollout in batch.guidance.items():
        assert isinstance(rollout, NVFP4Tensor)
        assert_matches_rollout(rec.sites[key], rollout, str(key))
    for i, layer in enumerate(qat.moe_layers):
        assert torch.equal(rec.routing[layer], batch.routing[i])

    # Packing changes nothing: each completion alone gives the same logprobs.
    alone = torch.cat([policy_logprobs(qat, collate([c])) for c in out])
    torch.testing.assert_close(got_N, alone, rtol=0, atol=LOGPROB_ATOL)


@torch.no_grad()
def test_compact_guidance_recomputes_the_kept_mantissa_bits(models):
    packed, qat = models
    batch = collate(generate(packed, "compact"))
    rec = SiteRecords()
    got_N = policy_logprobs(qat, batch, capture=rec)
    torch.testing.assert_close(got_N, batch.rollout_logprobs_N, rtol=0, atol=LOGPROB_ATOL)
    kept = {key: r for key, r in batch.guidance.items() if r is not None}
    assert {layer for layer, _ in kept} == {2}  # the latter half of FP4 layers 1, 2
    assert {layer for layer, _ in set(batch.guidance) - set(kept)} == {1}
    for key, r in kept.items():
        assert isinstance(r, CompactCodes)
        assert torch.equal(compact(rec.sites[key]).mantissa_bits, r.mantissa_bits), key


def test_collate_aligns_rows_targets_and_records(models):
    packed, _ = models
    out = generate(packed, "full", n=2)
    batch = collate(out)
    start, target = 0, 0
    for b, c in enumerate(out):
        fed = list(c.prompt_ids + c.completion_ids)[:-1]
        assert batch.tokens_T[start : start + len(fed)].tolist() == fed
        n = len(c.completion_ids)
        # Row P-1+i of the sequence scores completion token i.
        assert batch.rows_N[target : target + n].tolist() == list(
            range(start + len(c.prompt_ids) - 1, start + len(fed))
        )
        assert batch.targets_N[target : target + n].tolist() == list(c.completion_ids)
        assert (batch.seq_index_N[target : target + n] == b).all()
        assert torch.equal(batch.rollout_logprobs_N[target : target + n], c.raw_logprobs)
        assert torch.equal(batch.sampling_logprobs_N[target : target + n], c.logprobs)
        assert torch.equal(batch.routing[:, start : start + len(fed)], c.routing)
        for key, r in c.guidance.items():
            assert record_rows(batch.guidance[key], start, start + len(fed)).equal(r)
        start, target = start + len(fed), target + n
    assert batch.prompt_index == (0, 0, 1, 1, 2, 2) and batch.sample_index == (0, 1) * 3
    # The two samples of a prompt repeat its records: identical prompt rows.
    P = len(PROMPTS[0])
    a, b = (
        record_rows(batch.guidance[(1, "expert_input")], s, s + P)
        for s in (0, out[0].num_fed_tokens)
    )
    assert a.equal(b)


def completion(prompt=(1, 2, 3), tokens=(4, 5), **fields):
    return Completion(
        prompt_index=0,
        sample_index=0,
        prompt_ids=prompt,
        completion_ids=tokens,
        finish_reason="length",
        policy_version=0,
        **fields,
    )


def test_collate_refuses_inconsistent_completions():
    with pytest.raises(ValueError, match="at least one completion"):
        collate([])
    with pytest.raises(ValueError, match=r"\(prompt 0, sample 0\) has 3 prompt and 0 completion"):
        collate([completion(tokens=())])
    with pytest.raises(
        ValueError, match=r"routing has shape \(2, 3, 2\), expected \(L_moe, 4, k\)"
    ):
        collate([completion(routing=torch.zeros(2, 3, 2, dtype=torch.int32))])
    with pytest.raises(ValueError, match="has no routing while others in the batch do"):
        collate([completion(routing=torch.zeros(2, 4, 2, dtype=torch.int32)), completion()])
    with pytest.raises(ValueError, match=r"logprobs has shape \(3,\), expected \(2,\)"):
        collate([completion(logprobs=torch.zeros(3))])


def test_policy_logprobs_fails_closed_on_what_the_batch_lacks(models):
    _, qat = models
    batch = collate([completion()])
    with pytest.raises(ValueError, match="replay=True but the batch has no routing record"):
        policy_logprobs(qat, batch, guided=False)
    with pytest.raises(ValueError, match="guided=True but the batch has no guidance"):
        policy_logprobs(qat, batch, replay=False)
    with pytest.raises(ValueError, match=r"token id 300 outside the vocabulary \[0, 128\)"):
        policy_logprobs(qat, collate([completion(tokens=(300, 4))]), replay=False, guided=False)
    routing = torch.full((3, 4, 2), 8, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"expert id 8 outside \[0, num_experts=8\)"):
        policy_logprobs(qat, collate([completion(routing=routing)]), guided=False)
