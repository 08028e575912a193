"""Loading and saving fail closed: a bad file or weight is refused, named, and changes nothing.

Each refusal is held to the exact name it must give: the file for an unreadable checkpoint,
the tensor (and for routed experts the expert ids) for a non-finite weight.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from fp4rl.model.checkpoint import INDEX_FILE, MODEL_FILE, load_state_dict, save_checkpoint
from fp4rl.model.config import ModelConfig
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import tiny_qwen3_moe
from fp4rl.model.transformer import build_model, init_weights
from fp4rl.model.weights import load_weights

# Every MoE layer (1, 2, 3 of the tiny preset) in the experts' precision under test.
ALL_LAYERS = dict(bf16_first_layers=0, bf16_last_layers=0)
MODELS = {
    "qat": ("qat", PrecisionConfig(**ALL_LAYERS)),
    "packed": ("packed", PrecisionConfig(**ALL_LAYERS)),
    "bf16": ("qat", PrecisionConfig(experts="bf16", **ALL_LAYERS)),
}


def tiny_model(kind: str, dtype: torch.dtype = torch.float32):
    fp4_experts, precision = MODELS[kind]
    model = build_model(tiny_qwen3_moe(), precision, fp4_experts=fp4_experts, dtype=dtype)
    if fp4_experts == "packed":  # packed experts are not parameters: load them like a refit
        reference = build_model(tiny_qwen3_moe(), precision, fp4_experts="qat", dtype=dtype)
        init_weights(reference, std=0.1)
        load_weights(model, reference.state_dict())
    else:
        init_weights(model, std=0.1)
    return model.eval()


def weights_of(model) -> dict[str, torch.Tensor]:
    """Everything the model holds, packed codes and scales included, as copies."""
    return {name: t.clone() for name, t in model.state_dict().items()} | {
        name: b.clone() for name, b in model.named_buffers()
    }


def full_state_dict(kind: str) -> dict[str, torch.Tensor]:
    """A valid state dict for ``kind``'s model: the QAT twin's (packed takes BF16 experts)."""
    fp4_experts, precision = MODELS[kind]
    model = build_model(tiny_qwen3_moe(), precision, fp4_experts="qat", dtype=torch.float32)
    init_weights(model, std=0.1, seed=1)
    return {name: t.clone() for name, t in model.state_dict().items()}


# --- non-finite weights are refused by load_weights, naming tensors and experts ----------------


@pytest.mark.parametrize("kind", MODELS)
def test_load_weights_refuses_non_finite_tensors_and_names_the_experts(kind):
    model = tiny_model(kind)
    before = weights_of(model)
    sd = full_state_dict(kind)
    sd["layers.2.mlp.experts.w13"][3, 7, 1] = float("nan")
    sd["layers.2.mlp.experts.w13"][5, 0, 0] = float("inf")
    sd["layers.1.mlp.experts.w2"][0, :, 2] = float("-inf")
    sd["layers.3.self_attn.k_norm.weight"][4] = float("nan")
    sd["embed_tokens.weight"][9, :3] = float("nan")
    with pytest.raises(ValueError) as err:
        load_weights(model, sd)
    lines = str(err.value).splitlines()
    assert lines[0] == "refusing to load weights:"
    assert sorted(line.strip() for line in lines[1:]) == [
        "embed_tokens.weight: 3 non-finite values of 8192",
        "layers.1.mlp.experts.w2: non-finite values in experts [0]",
        "layers.2.mlp.experts.w13: non-finite values in experts [3, 5]",
        "layers.3.self_attn.k_norm.weight: 1 non-finite values of 16",
    ]
    after = weights_of(model)  # all-or-nothing: not one value changed
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before), kind


@pytest.mark.parametrize("kind", ["qat", "packed"])
def test_load_weights_refuses_values_that_overflow_the_models_dtype(kind):
    # 3.4e38 is finite in FP32 and rounds to inf in BF16: the model would hold inf.
    model = tiny_model(kind, dtype=torch.bfloat16)
    sd = full_state_dict(kind)
    sd["layers.1.mlp.experts.w13"][6, 0, 0] = 3.4e38
    sd["norm.weight"][0] = -3.4e38
    sd["layers.2.mlp.experts.w2"][1, 0, 0] = 3.3e38  # the largest BF16 is 3.39e38: loads
    with pytest.raises(ValueError) as err:
        load_weights(model, sd)
    assert sorted(str(err.value).splitlines()[1:]) == [
        "  layers.1.mlp.experts.w13: non-finite values (as torch.bfloat16) in experts [6]",
        "  norm.weight: 1 non-finite values (as torch.bfloat16) of 64",
    ]


def test_load_weights_takes_finite_extremes():
    model = tiny_model("packed")
    sd = full_state_dict("packed")
    sd["layers.1.mlp.experts.w13"][2, 0, 0] = torch.finfo(torch.float32).max
    sd["norm.weight"][0] = torch.finfo(torch.float32).min
    load_weights(model, sd)
    assert model.norm.weight[0] == torch.finfo(torch.float32).min


# --- non-finite weights are refused by save_checkpoint, before anything is written -----------


def test_save_refuses_non_finite_tensors(tmp_path):
    sd = full_state_dict("qat")
    sd["layers.1.mlp.experts.w2"][4, 1, 1] = float("nan")
    sd["lm_head.weight"][0, 0] = float("inf")
    out = tmp_path / "parent" / "ckpt"
    with pytest.raises(ValueError) as err:
        save_checkpoint(sd, tiny_qwen3_moe(), out)
    assert str(err.value).splitlines() == [
        f"refusing to save {out}; nothing was written:",
        "  layers.1.mlp.experts.w2: non-finite values in experts [4]",
        "  lm_head.weight: 1 non-finite values of 8192",
    ]
    assert os.listdir(tmp_path) == []


def test_save_refuses_dtypes_it_cannot_load(tmp_path):
    sd = full_state_dict("qat")
    sd["norm.weight"] = sd["norm.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError) as err:
        save_checkpoint(sd, tiny_qwen3_moe(), tmp_path / "ckpt")
    assert str(err.value).splitlines()[1:] == [
        "  norm.weight: dtype torch.float8_e4m3fn; fp4rl writes (as it loads) F64, F32, F16 or BF16"
    ]
    assert os.listdir(tmp_path) == []


# --- unreadable files are refused naming the file ----------------------------------------------


def copy_of(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "copy"))


def sharded(saved: Path, tmp_path: Path) -> Path:
    config = ModelConfig.from_pretrained_dir(saved)
    out = tmp_path / "sharded"
    save_checkpoint(load_state_dict(saved, config), config, out, max_shard_bytes=40_000)
    assert (out / INDEX_FILE).exists()
    return out


@pytest.mark.parametrize("cut", [1, 1000])
def test_truncated_shard_is_refused_naming_the_file(hf_checkpoint, tmp_path, cut):
    _, saved = hf_checkpoint
    config = ModelConfig.from_pretrained_dir(saved)
    for directory in (copy_of(saved, tmp_path), sharded(saved, tmp_path)):
        files = sorted(directory.glob("*.safetensors"))
        file = files[len(files) // 2]
        os.truncate(file, file.stat().st_size - cut)
        with pytest.raises(ValueError) as err:
            load_state_dict(directory, config)
        assert str(err.value).startswith(
            f"{file}: not a readable safetensors file: Error while deserializing header"
        )


def test_truncated_header_is_refused_naming_the_file(hf_checkpoint, tmp_path):
    _, saved = hf_checkpoint
    directory = copy_of(saved, tmp_path)
    os.truncate(directory / MODEL_FILE, 5)
    with pytest.raises(ValueError, match="not a readable safetensors file") as err:
        load_state_dict(directory, ModelConfig.from_pretrained_dir(saved))
    assert str(directory / MODEL_FILE) in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{garbage", "not valid JSON: Expecting property name enclosed in double quotes"),
        ("", "not valid JSON: Expecting value"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"model_type": "llama"}', "unknown architecture 'llama'"),
    ],
)
def test_bad_config_json_is_refused_naming_the_file(hf_checkpoint, tmp_path, text, message):
    _, saved = hf_checkpoint
    directory = copy_of(saved, tmp_path)
    (directory / "config.json").write_text(text)
    with pytest.raises(ValueError) as err:
        ModelConfig.from_pretrained_dir(directory)
    assert str(err.value).startswith(f"{directory / 'config.json'}: {message}")


def test_config_json_that_is_not_utf8_is_refused_naming_the_file(hf_checkpoint, tmp_path):
    _, saved = hf_checkpoint
    directory = copy_of(saved, tmp_path)
    (directory / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="not valid JSON") as err:
        ModelConfig.from_pretrained_dir(directory)
    assert str(directory / "config.json") in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("garbage", "not valid JSON: Expecting value"),
        ('{"metadata": {}}', 'has no "weight_map" object'),
        ('{"weight_map": ["model-00001-of-00002.safetensors"]}', 'has no "weight_map" object'),
    ],
)
def test_bad_index_is_refused_naming_the_file(hf_checkpoint, tmp_path, text, message):
    _, saved = hf_checkpoint
    directory = sharded(saved, tmp_path)
    (directory / INDEX_FILE).write_text(text)
    with pytest.raises(ValueError) as err:
        load_state_dict(directory, ModelConfig.from_pretrained_dir(saved))
    assert str(err.value).startswith(f"{directory / INDEX_FILE}: {message}")
