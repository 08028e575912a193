"""fp4rl's model against transformers on tiny random checkpoints, both directions."""

import pytest
import torch

from fp4rl.model.attention import CausalAttention
from fp4rl.model.checkpoint import save_checkpoint
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.weights import load_pretrained, load_weights

transformers = pytest.importorskip("transformers", minversion="5.0")
BF16 = PrecisionConfig(experts="bf16")


def hf_logits(hf_model, tokens_BS):
    with torch.no_grad():
        return hf_model(input_ids=tokens_BS).logits.float()


def fp4rl_logits(model, tokens_BS):
    B, S = tokens_BS.shape
    with torch.no_grad():
        return model(tokens_BS.flatten(), CausalAttention([S] * B)).view(B, S, -1)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("architecture", ["qwen3_moe", "qwen2_moe"])
def test_logits_match_transformers_and_back(architecture, make_hf_checkpoint, tmp_path):
    hf_model, path = make_hf_checkpoint(architecture, seed=3)
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    model = load_pretrained(path, BF16, dtype=torch.float32)
    want = hf_logits(hf_model, tokens)
    assert rel_err(fp4rl_logits(model, tokens), want) < 1e-4  # FP32 on CPU: summation order only
    # The reverse: fp4rl saves, transformers loads, same logits.
    save_checkpoint(model.state_dict(), model.config, tmp_path / "saved")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "saved", dtype=torch.float32
    )
    assert rel_err(hf_logits(reloaded.eval(), tokens), want) < 1e-4


def test_qat_and_packed_models_load_the_same_checkpoint_to_the_same_function(make_hf_checkpoint):
    _, path = make_hf_checkpoint("qwen3_moe", seed=4)
    fp4 = PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0, kv_cache="nvfp4")
    qat = load_pretrained(path, fp4, dtype=torch.float32)
    packed = load_pretrained(path, fp4, fp4_experts="packed", dtype=torch.float32)
    tokens = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    # Same dequantized weights and the same activation sites: identical GEMM inputs and logits.
    assert torch.equal(fp4rl_logits(qat, tokens), fp4rl_logits(packed, tokens))
    layer = packed.layers[1].mlp.experts
    assert layer.w13_packed.nbytes < layer.w13_packed.shape.numel() * 0.6  # 4.5 bits per weight


def test_bad_weights_are_refused_and_nothing_changes(make_hf_checkpoint):
    _, path = make_hf_checkpoint("qwen3_moe", seed=5)
    fp4 = PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0)
    model = load_pretrained(path, fp4, fp4_experts="packed", dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    codes_before = model.layers[1].mlp.experts.w13_packed.codes.clone()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for name, m in model.named_modules():
        if hasattr(m, "w13_packed"):
            sd[f"{name}.w13"] = torch.randn(8, 64, 64)
            sd[f"{name}.w2"] = torch.randn(8, 64, 32)
    sd["layers.3.mlp.experts.w2"][5, 0, 0] = float("nan")
    sd["embed_tokens.weight"] = torch.zeros(128, 64)
    with pytest.raises(
        ValueError, match=r"layers.3.mlp.experts.w2: non-finite values in experts \[5\]"
    ):
        load_weights(model, sd)
    del sd["norm.weight"]
    sd["layers.0.bogus"] = torch.zeros(1)
    with pytest.raises(
        ValueError, match=r"missing: \['norm.weight'\]\n  unexpected: \['layers.0.bogus'\]"
    ):
        load_weights(model, sd)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert torch.equal(model.layers[1].mlp.experts.w13_packed.codes, codes_before)
