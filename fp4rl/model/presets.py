"""Named model shapes: a tiny Qwen3-MoE for tests and examples, the demo's policy, and
Qwen3-30B-A3B for benchmarks."""

from __future__ import annotations

from fp4rl.model.config import ModelConfig

_QWEN3_MOE = dict(
    architecture="qwen3_moe",
    rms_norm_eps=1e-6,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    shared_expert_intermediate_size=0,
    qk_norm=True,
    attention_bias=False,
    tie_word_embeddings=False,
)


def tiny_qwen3_moe(**overrides) -> ModelConfig:
    """4 layers (layer 0 dense), hidden 64, 8 experts top-2, head dim 16, vocab 128."""
    fields = dict(
        _QWEN3_MOE,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=1e6,
        max_position_embeddings=256,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=(0,),
    )
    return ModelConfig(**{**fields, **overrides})


def demo_qwen3_moe(**overrides) -> ModelConfig:
    """The demo's policy: 4 MoE layers, hidden 64, 8 experts top-2, every dimension a multiple
    of 16 (NVFP4 blocks), the vocabulary the addition task's 15 tokens rounded up to 16."""
    fields = dict(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=(),
    )
    return tiny_qwen3_moe(**{**fields, **overrides})


def qwen3_30b_a3b(**overrides) -> ModelConfig:
    """The Qwen3-30B-A3B decoder shape (48 layers; pass num_hidden_layers to take fewer)."""
    fields = dict(
        _QWEN3_MOE,
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rope_theta=1e6,
        max_position_embeddings=40960,
        num_experts=128,
        num_experts_per_tok=8,
        mlp_only_layers=(),
    )
    return ModelConfig(**{**fields, **overrides})
