"""The one tiny model of the test suite, in its trainer (QAT) and rollout (packed) forms.

A 4-layer Qwen3-MoE (layer 0 dense, 1-3 MoE, hidden 64, 8 experts top-2, head dim 16, vocab
128) with random weights. `rollout_model` returns the rollout's configuration -- routed experts
of the FP4 layers held packed (`PackedExperts`, quantized at load time), everything else plain
modules -- and its QAT twin with the same weights and fake-quantized experts: what the trainer
runs. `trainer_logprobs` is the trainer's full-sequence forward of one completion through the
same entry point the training loop uses (`collate` + `policy_logprobs`).
"""

from __future__ import annotations

import pytest
import torch

from fp4rl.model.attention import CausalAttention
from fp4rl.model.config import ModelConfig
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import tiny_qwen3_moe
from fp4rl.model.transformer import build_model, init_weights
from fp4rl.model.weights import load_weights
from fp4rl.records import collate
from fp4rl.rollout import EngineConfig
from fp4rl.train.policy import policy_logprobs

# What a test parametrized over devices runs on: the CPU, and the GPU where there is one (the
# case marked gpu, so that CI's CPU-only run skips it by its mark).
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]

# Every MoE layer FP4, NVFP4 KV: the most sites per forward.
FP4_EVERYWHERE = PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0, kv_cache="nvfp4")


def tiny_config(**overrides) -> ModelConfig:
    return tiny_qwen3_moe(**{"rope_theta": 1e4, **overrides})


def tiny_precision(kv_cache: str = "bf16", experts: str = "nvfp4") -> PrecisionConfig:
    # Four layers: layer 0 dense, 1-3 MoE; with one BF16 boundary layer at each end the FP4
    # layers are 1 and 2, so the cache mixes BF16 and NVFP4 layers.
    return PrecisionConfig(
        experts=experts, kv_cache=kv_cache, bf16_first_layers=1, bf16_last_layers=1
    )


def engine_config(**overrides) -> EngineConfig:
    """A small engine for the tiny model: blocks of 4 tokens, 1 MiB of KV, sequences of up to
    64 tokens, 16 at a time."""
    fields = dict(
        block_size=4,
        kv_memory_bytes=1 << 20,
        max_model_len=64,
        max_num_seqs=16,
        max_num_batched_tokens=128,
    )
    return EngineConfig(**{**fields, **overrides})


def qat_model(
    precision: PrecisionConfig = FP4_EVERYWHERE,
    *,
    seed: int = 0,
    dtype=torch.float32,
    config=None,
    device="cpu",
    fp4_experts="qat",
):
    """The trainer's model: BF16-layout parameters in ``dtype``, experts fake-quantized."""
    model = build_model(
        config or tiny_config(), precision, fp4_experts=fp4_experts, dtype=dtype, device=device
    )
    init_weights(model, std=0.1, seed=seed)
    return model.eval()


def packed_twin(qat, precision: PrecisionConfig):
    """The rollout's model with ``qat``'s weights: FP4 experts quantized once, at load."""
    w = qat.embed_tokens.weight
    packed = build_model(
        qat.config, precision, fp4_experts="packed", dtype=w.dtype, device=w.device
    )
    load_weights(packed, qat.state_dict())
    return packed.eval()


def rollout_model(
    kv_cache: str = "bf16", experts: str = "nvfp4", *, seed: int = 0, dtype=None, device="cpu"
):
    """``(packed, qat)``: the rollout's model and the trainer's, with the same weights."""
    precision = tiny_precision(kv_cache, experts)
    qat = qat_model(precision, seed=seed, dtype=dtype or torch.float32, device=device)
    return packed_twin(qat, precision), qat


@torch.no_grad()
def trainer_logprobs(
    model, completion, *, replay: bool = False, guided: bool = False, capture=None
):
    """The trainer's log-probability of each of ``completion``'s tokens, FP32 ``[C]``, from
    one full-sequence forward; ``replay`` feeds the rollout's routing record, ``guided`` its
    FP4 codes."""
    return policy_logprobs(
        model, collate([completion]), replay=replay, guided=guided, capture=capture
    )


@torch.no_grad()
def trainer_distribution(model, completion) -> torch.Tensor:
    """FP32 log-probabilities ``[C, V]``: row ``i`` is the trainer's distribution (live routing,
    nearest rounding) that predicted ``completion_ids[i]``."""
    batch = collate([completion])
    h_TH = model.hidden_states(batch.tokens_T, CausalAttention(batch.seq_lens))
    return torch.log_softmax(model.logits(h_TH[batch.rows_N]), dim=-1)
