"""ModelConfig against transformers' own configs: the fields it reads, the layers it calls MoE,
the config.json it writes, and the mistakes and unsupported features it refuses."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fp4rl.model.config import ModelConfig

# A config.json in the style of the hub's Qwen1.5-MoE-A2.7B: v4 spelling, no head_dim, no qkv_bias.
HUB_QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_act": "silu",
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "decoder_sparse_step": 1,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_dropout": 0.0,
}  # fmt: skip


UNKNOWN = "unknown architecture 'llama'; fp4rl supports qwen3_moe, qwen2_moe"
TRANSFORMERS_KEYS = (
    "num_experts", "rope_parameters", "norm_topk_prob", "mlp_only_layers",
    "decoder_sparse_step", "rms_norm_eps", "tie_word_embeddings", "sliding_window",
    "shared_expert_intermediate_size", "qkv_bias", "attention_bias", "dtype",
)  # fmt: skip


def qwen3(**overrides) -> ModelConfig:
    fields = dict(
        architecture="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=256, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=(0, 2), shared_expert_intermediate_size=0,
        qk_norm=True, attention_bias=False, tie_word_embeddings=False,
    )  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


def test_reads_what_transformers_saved(hf_checkpoint):
    model, saved = hf_checkpoint
    config = ModelConfig.from_pretrained_dir(saved)
    if config.architecture == "qwen3_moe":
        assert config == qwen3()
    else:
        expected = qwen3(
            architecture="qwen2_moe", mlp_only_layers=(), decoder_sparse_step=2,
            norm_topk_prob=False, shared_expert_intermediate_size=48, qk_norm=False,
            attention_bias=True,
        )  # fmt: skip
        assert config == expected
    # HF's own structure decides which layers are MoE; fp4rl's rule must agree.
    is_moe = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in model.model.layers]
    assert [config.is_moe_layer(i) for i in range(config.num_hidden_layers)] == is_moe
    assert config.moe_layers() == (1, 3)


def test_reads_the_hub_spelling():
    config = ModelConfig.from_hf_dict(HUB_QWEN2_MOE)
    assert config.num_experts == 60 and config.rope_theta == 1e6 and config.head_dim == 128
    assert config.attention_bias and not config.norm_topk_prob and not config.qk_norm
    assert config.moe_layers() == tuple(range(24))


def test_to_hf_dict_round_trips_through_fp4rl_and_transformers(hf_checkpoint):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    _, saved = hf_checkpoint
    config = ModelConfig.from_pretrained_dir(saved)
    written = config.to_hf_dict(dtype="float32")
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(written))) == config
    ours = transformers.AutoConfig.for_model(**written)
    theirs = transformers.AutoConfig.from_pretrained(saved)
    for key in TRANSFORMERS_KEYS:
        assert getattr(ours, key, None) == getattr(theirs, key, None), key
    # fp4rl always writes head_dim; transformers' Qwen2-MoE derives it when absent.
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 64 // 4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"architecture": "llama"}, UNKNOWN),
        ({"hidden_size": 0}, "hidden_size must be a positive int, got 0"),
        ({"num_experts": 8.0}, "num_experts must be a positive int, got 8.0"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_k"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds num_experts \(8\)"),
        ({"mlp_only_layers": (0, 4)}, r"mlp_only_layers .* in \[0, 4\), got \(0, 4\)"),
        ({"mlp_only_layers": (1, 1)}, "mlp_only_layers must be distinct"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a positive finite number, got 0.0"),
        ({"rope_theta": float("inf")}, "rope_theta must be a positive finite number, got inf"),
        ({"norm_topk_prob": 1}, "norm_topk_prob must be a bool, got 1"),
        ({"qk_norm": False}, "qk_norm=False does not match qwen3_moe"),
        ({"shared_expert_intermediate_size": 48}, "shared_expert_int.*=48: qwen3_moe has no"),
        ({"attention_bias": True}, "attention_bias=True is not supported for qwen3_moe"),
        ({"architecture": "qwen2_moe", "qk_norm": False}, "shared_expert_int.*=0: qwen2_moe"),
    ],
)  # fmt: skip
def test_rejects_nonsense(overrides, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        qwen3(**overrides)


def test_config_is_frozen_and_normalizes_sequences():
    config = qwen3(mlp_only_layers=[0, 2], rope_theta=1000000)
    assert config.mlp_only_layers == (0, 2) and type(config.rope_theta) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 32


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"model_type": "llama"}, UNKNOWN),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling=.*yarn.* is not"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling=.*linear"),
        ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
        ({"layer_types": ["sliding_attention"] * 24}, r"layer_types \['sliding_attention'\]"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoints"),
        ({"num_local_experts": 64}, "num_experts=60 != num_local_experts=64"),
        ({"hidden_size": 2050}, r"hidden_size \(2050\) must be a multiple of num_attention_he"),
        ({"hidden_size": None}, "qwen2_moe config.json lacks hidden_size"),
        ({"shared_expert_intermediate_size": None}, "lacks shared_expert_intermediate_size"),
    ],
)  # fmt: skip
def test_rejects_unsupported_config_json(edit, message):
    d = {k: v for k, v in {**HUB_QWEN2_MOE, **edit}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


def test_accepts_default_rope_in_either_spelling():
    v5 = {**HUB_QWEN2_MOE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    del v5["rope_theta"]
    assert ModelConfig.from_hf_dict(v5).rope_theta == 5e5
    assert ModelConfig.from_hf_dict({**HUB_QWEN2_MOE, "rope_scaling": {"type": "default"}})


def test_qwen3_attention_bias_is_refused_from_config_json():
    d = {**qwen3().to_hf_dict(), "attention_bias": True}
    with pytest.raises(ValueError, match="o_proj bias"):
        ModelConfig.from_hf_dict(d)
