"""The engine on the GPU in BF16: the rollout's packed FP4 model against the trainer's QAT twin.

On CUDA every quantization runs the Triton kernels (rollout: quantize at load, per-token
activations, NVFP4 KV pages; trainer: fake quantization and guided rounding), so this is the
seam test of the kernels, not of the reference. The trainer takes the whole batch through
`collate` + `policy_logprobs`, as the training loop does. Tolerances as in the CPU BF16 test.
"""

import dataclasses

import pytest
import torch
from assertions import assert_matches_rollout
from tiny_models import (
    FP4_EVERYWHERE,
    engine_config,
    packed_twin,
    qat_model,
    rollout_model,
    tiny_config,
)

from fp4rl.model.sites import SiteRecords
from fp4rl.records import collate, record_members, record_rows
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.rollout.attention import AttentionMetadata, PagedAttention, Segment
from fp4rl.train.policy import policy_logprobs

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7] * 20, [3], [90, 12, 55, 4, 4, 4, 100]]


@torch.no_grad()
def test_guided_trainer_on_gpu_recomputes_the_rollout_codes_and_logprobs():
    packed, qat = rollout_model("nvfp4", "nvfp4", dtype=torch.bfloat16, device="cuda")
    config = engine_config(block_size=16, capture_routing=True, guidance="full")
    out = Engine(packed, config).generate(PROMPTS, SamplingParams(n=2, max_tokens=16, seed=1))
    assert len(out) == 2 * len(PROMPTS)
    batch = collate(out)
    rec = SiteRecords()
    got = policy_logprobs(qat, batch, capture=rec)
    torch.testing.assert_close(got.cpu(), batch.rollout_logprobs_N, rtol=0, atol=0.03)
    assert rec.sites.keys() == batch.guidance.keys()
    for key, t in batch.guidance.items():
        assert_matches_rollout(rec.sites[key], t, str(key))
    # Each completion's own records are the packed batch's rows: nothing shifted in packing.
    start = 0
    for c in out:
        for key, t in c.guidance.items():
            assert record_rows(batch.guidance[key], start, start + c.num_fed_tokens).equal(t)
        start += c.num_fed_tokens


@torch.no_grad()
def test_a_calls_records_outlive_the_calls_after_it():
    """Completions keep their records in the pinned rows their call landed them in
    (`RowRecords`): the engine hands those rows over, so the calls after it, with their own
    records, write elsewhere. The first call's records, read after two more calls, equal those
    read at once from a twin completion set."""
    packed, _ = rollout_model("nvfp4", "nvfp4", dtype=torch.bfloat16, device="cuda")
    config = engine_config(block_size=16, capture_routing=True, guidance="compact")
    engine = Engine(packed, config)
    params = SamplingParams(n=2, max_tokens=12, seed=3)
    first = engine.generate(PROMPTS, params)
    at_once = {
        (c.prompt_index, c.sample_index): dict(c.guidance) for c in engine.generate(PROMPTS, params)
    }
    engine.generate(PROMPTS[::-1], dataclasses.replace(params, seed=4))
    assert first[0].guidance.rows.is_pinned()
    for c in first:
        want = at_once[c.prompt_index, c.sample_index]
        assert list(c.guidance) == list(want)
        for key, record in c.guidance.items():
            if record is None:
                assert want[key] is None
                continue
            for a, b in zip(record_members(record), record_members(want[key]), strict=True):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key


@pytest.mark.parametrize("kv_cache", ["bf16", "nvfp4"])
@torch.no_grad()
def test_a_decode_step_never_waits_for_the_gpu(kv_cache):
    """A decode step's forward (every layer FP4, packed experts through the fused GEMM, pages
    read by the paged kernel) enqueues its work without one device sync, so the host can run
    ahead of the GPU; head dim 32, the paged kernel's smallest for BF16 queries over NVFP4."""
    precision = dataclasses.replace(FP4_EVERYWHERE, kv_cache=kv_cache)
    qat = qat_model(precision, config=tiny_config(head_dim=32), dtype=torch.bfloat16, device="cuda")
    packed = packed_twin(qat, precision)
    engine = Engine(packed, engine_config(block_size=16))
    segments = [Segment([0, 1], 20, 1), Segment([2], 5, 1), Segment([3], 0, 1)]
    meta = AttentionMetadata.build(segments, 16, "cuda")
    tokens_T = torch.tensor([3, 4, 5], device="cuda")

    def step():
        return packed.logits(packed.hidden_states(tokens_T, PagedAttention(engine.cache, meta)))

    want = step()  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
