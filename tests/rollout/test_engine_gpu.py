"""The engine on the GPU in BF16: the rollout's packed FP4 model against the trainer's QAT twin.

On CUDA every quantization runs the Triton kernels (rollout: quantize at load, per-token
activations, NVFP4 KV pages; trainer: fake quantization and guided rounding), so this is the
seam test of the kernels, not of the reference. Tolerances as in the CPU BF16 test.
"""

import pytest
import torch
from rollout_models import tiny_config, tiny_precision

from fp4rl.fp4.reference import unpack_e2m1
from fp4rl.model.attention import CausalAttention
from fp4rl.model.sites import SiteRecords
from fp4rl.model.transformer import build_model, init_weights
from fp4rl.model.weights import load_weights
from fp4rl.rollout import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7] * 20, [3], [90, 12, 55, 4, 4, 4, 100]]


def models():
    precision = tiny_precision("nvfp4", "nvfp4")
    qat = build_model(tiny_config(), precision, dtype=torch.bfloat16, device="cuda")
    init_weights(qat, std=0.1, seed=0)
    packed = build_model(
        qat.config, precision, fp4_experts="packed", dtype=torch.bfloat16, device="cuda"
    )
    load_weights(packed, qat.state_dict())
    return packed.eval(), qat.eval()


@torch.no_grad()
def trainer_logprobs(model, c, capture):
    fed = torch.tensor(list(c.prompt_ids) + list(c.completion_ids)[:-1], device="cuda")
    kv_layers = tuple(p.index for p in model.plan.layers if p.kv_cache == "nvfp4")
    attn = CausalAttention(
        [len(fed)], device="cuda", nvfp4_kv_layers=kv_layers, guidance=c.guidance, capture=capture
    )
    h = model.hidden_states(fed, attn, routing=c.routing, guidance=c.guidance, capture=capture)
    logprobs = torch.log_softmax(model.logits(h[len(c.prompt_ids) - 1 :]), -1)
    return logprobs.gather(1, torch.tensor(c.completion_ids, device="cuda")[:, None])[:, 0]


def test_guided_trainer_on_gpu_recomputes_the_rollout_codes_and_logprobs():
    packed, qat = models()
    config = EngineConfig(
        kv_format="nvfp4",
        block_size=16,
        kv_memory_bytes=1 << 24,
        max_model_len=64,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        capture_routing=True,
        guidance="full",
    )
    out = Engine(packed, config).generate(PROMPTS, SamplingParams(n=2, max_tokens=16, seed=1))
    assert len(out) == 2 * len(PROMPTS)
    for c in out:
        rec = SiteRecords()
        got = trainer_logprobs(qat, c, rec)
        torch.testing.assert_close(got.cpu(), c.raw_logprobs.cpu(), rtol=0, atol=0.03)
        for key, t in c.guidance.items():
            a, b = rec.sites[key], t
            assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8)), (
                key
            )
            assert torch.equal(a.global_scale, b.global_scale), key
            # Codes equal, up to the sign bit of zero codes (rounding.py: zero takes y's sign).
            ua, ub = unpack_e2m1(a.codes), unpack_e2m1(b.codes)
            nonzero = (ub & 7) != 0
            assert torch.equal(ua & 7, ub & 7) and torch.equal(ua[nonzero], ub[nonzero]), key
