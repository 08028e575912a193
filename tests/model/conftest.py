"""Tiny random Qwen3-MoE / Qwen2-MoE models built and saved by transformers itself.

``save_tiny_hf_model`` returns ``(hf_model, saved_dir)`` for any test that compares fp4rl with
transformers (checkpoint mapping here, full-model parity elsewhere). Every parameter is drawn
from a seeded generator, norms included, so that two tensors swapped by a mapping bug differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ARCHITECTURES = ("qwen3_moe", "qwen2_moe")

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
)
# The two exercise the two ways a layer stays dense: qwen3_moe lists layers 0 and 2 in
# mlp_only_layers (MoE layers 1, 3); qwen2_moe uses decoder_sparse_step=2 (MoE layers 1, 3).
TINY = {
    "qwen3_moe": dict(
        _COMMON, num_hidden_layers=4, head_dim=16, mlp_only_layers=[0, 2], norm_topk_prob=True
    ),
    "qwen2_moe": dict(
        _COMMON, num_hidden_layers=4, decoder_sparse_step=2, shared_expert_intermediate_size=48
    ),
}


def tiny_hf_config(architecture: str, **overrides):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig}
    return cls[architecture](**{**TINY[architecture], **overrides})


def build_tiny_hf_model(architecture: str, *, seed: int = 0, **overrides):
    """An FP32 transformers model in eval mode with every parameter random."""
    transformers = pytest.importorskip("transformers", minversion="5.0")
    config = tiny_hf_config(architecture, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model


def save_tiny_hf_model(
    architecture: str, directory: Path, *, seed: int = 0, **overrides
) -> tuple[torch.nn.Module, Path]:
    """``(hf_model, saved_dir)``: the model and its ``save_pretrained`` output in ``directory``."""
    model = build_tiny_hf_model(architecture, seed=seed, **overrides)
    model.save_pretrained(directory)
    return model, Path(directory)


@pytest.fixture(scope="session", params=ARCHITECTURES)
def hf_checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """One saved tiny model per architecture, shared by the session: copy before editing."""
    return save_tiny_hf_model(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture
def make_hf_checkpoint(tmp_path):
    """``make(architecture, *, seed=0, **config_overrides) -> (hf_model, saved_dir)``."""
    made = []

    def make(architecture: str, *, seed: int = 0, **overrides):
        made.append(architecture)
        directory = tmp_path / f"hf-{len(made)}-{architecture}"
        return save_tiny_hf_model(architecture, directory, seed=seed, **overrides)

    return make
