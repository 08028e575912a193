"""Tiny real models for the rollout tests, and the trainer-side full-sequence forward.

`rollout_model` builds the rollout's configuration: routed experts of the FP4 layers held packed
(`PackedExperts`, quantized at load time), everything else BF16 modules in FP32 on the CPU, and
its QAT twin with the same weights and fake-quantized experts: what the trainer runs.
`trainer_logprobs` is the trainer's full-sequence forward (`CausalAttention`, optional router
replay and guidance) that the rollout's cached decode is compared with.
"""

from __future__ import annotations

import torch

from fp4rl.model.attention import CausalAttention
from fp4rl.model.config import ModelConfig
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import tiny_qwen3_moe
from fp4rl.model.transformer import build_model, init_weights
from fp4rl.model.weights import load_weights


def tiny_config(**overrides) -> ModelConfig:
    return tiny_qwen3_moe(**{"rope_theta": 1e4, **overrides})


def tiny_precision(kv_cache: str = "bf16", experts: str = "nvfp4") -> PrecisionConfig:
    # Four layers: layer 0 dense, 1-3 MoE; with one BF16 boundary layer at each end the FP4
    # layers are 1 and 2, so the cache mixes BF16 and NVFP4 layers.
    return PrecisionConfig(
        experts=experts, kv_cache=kv_cache, bf16_first_layers=1, bf16_last_layers=1
    )


def qat_model(precision: PrecisionConfig, *, seed: int = 0, dtype=torch.float32, config=None):
    model = build_model(config or tiny_config(), precision, fp4_experts="qat", dtype=dtype)
    init_weights(model, std=0.1, seed=seed)
    return model.eval()


def packed_twin(qat, precision: PrecisionConfig):
    """The rollout's model with ``qat``'s weights: FP4 experts quantized once, at load."""
    dtype = qat.embed_tokens.weight.dtype
    packed = build_model(qat.config, precision, fp4_experts="packed", dtype=dtype)
    load_weights(packed, qat.state_dict())
    return packed.eval()


def rollout_model(kv_cache: str = "bf16", experts: str = "nvfp4", *, seed: int = 0, dtype=None):
    """``(packed, qat)``: the rollout's model and the trainer's, with the same weights."""
    precision = tiny_precision(kv_cache, experts)
    qat = qat_model(precision, seed=seed, dtype=dtype or torch.float32)
    return packed_twin(qat, precision), qat


def nvfp4_kv_layers(model) -> tuple[int, ...]:
    return tuple(p.index for p in model.plan.layers if p.kv_cache == "nvfp4")


@torch.no_grad()
def trainer_logprobs(model, completion, *, replay: bool = False, guidance=None, capture=None):
    """The trainer's full-sequence forward over the ``T`` fed tokens of ``completion``.

    Returns FP32 log-probabilities ``[len(completion_ids), V]``: row ``i`` is the distribution
    that predicted ``completion_ids[i]``. ``replay`` feeds the rollout's routing record;
    ``guidance`` its FP4 codes.
    """
    tokens = list(completion.prompt_ids) + list(completion.completion_ids)
    fed_T = torch.tensor(tokens[:-1])
    attn = CausalAttention(
        [len(fed_T)], nvfp4_kv_layers=nvfp4_kv_layers(model), guidance=guidance, capture=capture
    )
    h_TH = model.hidden_states(
        fed_T,
        attn,
        routing=completion.routing if replay else None,
        guidance=guidance,
        capture=capture,
    )
    start = len(completion.prompt_ids) - 1
    return torch.log_softmax(model.logits(h_TH[start:]), dim=-1)


def picked(logprobs_NV, completion):
    """``logprobs_NV[i, completion_ids[i]]``."""
    return logprobs_NV.gather(1, torch.tensor(completion.completion_ids)[:, None])[:, 0]
