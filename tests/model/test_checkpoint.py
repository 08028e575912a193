"""The checkpoint mapping against checkpoints transformers itself wrote.

Loading is held to bitwise equality with the tensors on disk; saving to the hub per-expert
layout bitwise; transformers reloading what fp4rl saved to identical FP32 logits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp4rl.model.checkpoint import (
    INDEX_FILE,
    MODEL_FILE,
    fp4rl_to_hf,
    hf_to_fp4rl_names,
    load_state_dict,
    parameter_shapes,
    save_checkpoint,
    writer,
)
from fp4rl.model.config import ModelConfig

# v5: experts fused in memory (gate_up_proj), save_original_format, rope_parameters.
transformers = pytest.importorskip("transformers", minversion="5.0")


def read_file(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(file, framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def read_dir(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor in every safetensors file of ``directory``, by name."""
    return {
        n: t for file in sorted(directory.glob("*.safetensors")) for n, t in read_file(file).items()
    }


def write_shards(directory: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    """A hand-made sharded checkpoint; a name in several shards is indexed to the first."""
    directory.mkdir()
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / file, metadata={"format": "pt"})
        weight_map.update({name: file for name in shard if name not in weight_map})
    (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.fixture
def loaded(hf_checkpoint):
    model, saved = hf_checkpoint
    config = ModelConfig.from_pretrained_dir(saved)
    return model, saved, config, load_state_dict(saved, config)


def test_transformers_saves_the_per_expert_hub_layout(hf_checkpoint):
    # transformers v5 fuses experts in memory but reverts to per-expert names on save.
    model, saved = hf_checkpoint
    config = ModelConfig.from_pretrained_dir(saved)
    assert os.listdir(saved).count(MODEL_FILE) == 1
    assert read_dir(saved).keys() == hf_to_fp4rl_names(config).keys()
    assert hasattr(model.model.layers[1].mlp.experts, "gate_up_proj")


def test_load_equals_the_tensors_on_disk(loaded):
    _, saved, config, state = loaded
    assert {name: tuple(t.shape) for name, t in state.items()} == parameter_shapes(config)
    on_disk = read_dir(saved)
    for hf_name, slot in hf_to_fp4rl_names(config).items():
        assert torch.equal(state[slot.name][slot.index], on_disk[hf_name]), hf_name


def test_load_equals_the_transformers_modules(loaded):
    # Looked up by module attribute, not through the name table: a table that swapped two
    # same-shaped tensors (q_norm / k_norm, gate / up rows) would pass a save-load round trip.
    model, _, _, state = loaded
    for name, tensor in state.items():
        hf_name = (
            name.replace("mlp.router.", "mlp.gate.")
            .replace("experts.w13", "experts.gate_up_proj")  # [E, 2I, H], gate rows first
            .replace("experts.w2", "experts.down_proj")
        )
        hf = model.get_parameter(hf_name if name == "lm_head.weight" else "model." + hf_name)
        assert torch.equal(tensor, hf), name


def test_load_fused_expert_layout(loaded, tmp_path):
    model, _, config, state = loaded
    model.save_pretrained(tmp_path, save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in read_dir(tmp_path)
    assert_same(load_state_dict(tmp_path, config), state)


def test_load_sharded_transformers_checkpoint(loaded, tmp_path):
    model, _, config, state = loaded
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert_same(load_state_dict(tmp_path, config), state)


def test_save_round_trip_is_bitwise(loaded, tmp_path):
    _, saved, config, state = loaded
    out = tmp_path / "ckpt"
    save_checkpoint(state, config, out)
    assert sorted(os.listdir(out)) == ["config.json", MODEL_FILE]
    (tmp_path / "plain").mkdir()  # permissions as any new directory, not a private temp dir
    assert out.stat().st_mode == (tmp_path / "plain").stat().st_mode
    assert_same(read_dir(out), read_dir(saved))
    assert ModelConfig.from_pretrained_dir(out) == config
    assert_same(load_state_dict(out, config), state)


def test_sharded_save_round_trip(loaded, tmp_path):
    _, saved, config, state = loaded
    out, max_shard_bytes = tmp_path / "ckpt", 40_000
    save_checkpoint(state, config, out, max_shard_bytes=max_shard_bytes)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == [f.name for f in shards]
    assert len(shards) > 1 and not (out / MODEL_FILE).exists()
    for shard in shards:
        tensors = read_file(shard)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert nbytes <= max_shard_bytes or len(tensors) == 1, shard.name
        assert all(index["weight_map"][name] == shard.name for name in tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    assert_same(read_dir(out), read_dir(saved))
    assert_same(load_state_dict(out, config), state)


@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 40_000])
def test_transformers_loads_what_fp4rl_saved(loaded, tmp_path, max_shard_bytes):
    model, _, config, state = loaded
    save_checkpoint(state, config, tmp_path / "ckpt", max_shard_bytes=max_shard_bytes)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float32
    ).eval()
    tokens = torch.randint(
        0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected, actual = model(tokens).logits, reloaded(tokens).logits
    # Same weights through the same transformers code and CPU kernels: bitwise, not "close".
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=oct)
def test_checkpoint_files_take_the_umask(loaded, tmp_path, umask):
    # As any file created by open(): safetensors' own writer made the weights 0600.
    _, _, config, state = loaded
    out = tmp_path / "ckpt"
    before = os.umask(umask)
    try:
        save_checkpoint(state, config, out, max_shard_bytes=40_000)
    finally:
        os.umask(before)
    modes = {file.name: stat.S_IMODE(file.stat().st_mode) for file in out.iterdir()}
    assert INDEX_FILE in modes and "config.json" in modes and len(modes) > 3
    assert modes == dict.fromkeys(modes, 0o666 & ~umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask


def test_saved_files_are_safetensors_that_mix_dtypes(loaded, tmp_path):
    _, _, config, state = loaded
    dtypes = (torch.float16, torch.float64, torch.bfloat16, torch.float32)
    mixed = {name: t.to(dtypes[k % 4]) for k, (name, t) in enumerate(state.items())}
    save_checkpoint(mixed, config, tmp_path / "ckpt")
    file = tmp_path / "ckpt" / MODEL_FILE
    # safetensors' own reader: checks the header, and that the offsets tile the data exactly.
    expected = {n: t.contiguous() for n, t in fp4rl_to_hf(mixed, config).items()}
    assert_same(load_file(file), expected)
    with safe_open(file, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    raw = file.read_bytes()
    header_bytes = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_bytes])
    assert header_bytes % 8 == 0
    for name, info in header.items():  # each tensor aligned to its element size
        if name != "__metadata__":
            assert info["data_offsets"][0] % expected[name].element_size() == 0, name
    assert_same(load_state_dict(tmp_path / "ckpt", config), mixed)


def test_save_failure_leaves_nothing(loaded, tmp_path, monkeypatch):
    _, _, config, state = loaded
    written = []

    write_safetensors = writer._write_safetensors

    def fail_on_second_shard(file, tensors):
        if written:
            raise OSError("disk full")
        written.append(file)
        write_safetensors(file, tensors)

    monkeypatch.setattr(writer, "_write_safetensors", fail_on_second_shard)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(state, config, tmp_path / "ckpt", max_shard_bytes=40_000)
    assert written and os.listdir(tmp_path) == []


def test_save_never_overwrites(loaded, tmp_path):
    _, _, config, state = loaded
    out = tmp_path / "ckpt"
    out.mkdir()
    save_checkpoint(state, config, out)  # an empty directory is taken
    with pytest.raises(FileExistsError, match="not an empty directory"):
        save_checkpoint(state, config, out)
    assert_same(load_state_dict(out, config), state)


def test_save_reports_a_mismatched_state_dict(loaded, tmp_path):
    _, _, config, state = loaded
    state = dict(state)
    del state["layers.1.mlp.experts.w2"]
    state["layers.1.mlp.experts.w3"] = torch.zeros(1)
    state["norm.weight"] = torch.zeros(63)
    state["embed_tokens.weight"] = state["embed_tokens.weight"].to(torch.int32)
    with pytest.raises(ValueError) as err:
        save_checkpoint(state, config, tmp_path / "ckpt")
    message = str(err.value)
    assert "missing (1):\n    layers.1.mlp.experts.w2\n" in message
    assert "unexpected (1):\n    layers.1.mlp.experts.w3\n" in message
    assert "norm.weight: has [63], config expects [64]" in message
    assert "embed_tokens.weight: torch.int32 is not a floating-point dtype" in message
    assert os.listdir(tmp_path) == []


def test_load_reports_missing_unexpected_and_duplicate_together(loaded, tmp_path):
    _, saved, config, _ = loaded
    tensors = read_dir(saved)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]  # an expert without its up_proj
    tensors["model.layers.1.mlp.experts.3.bias"] = torch.zeros(3)
    twice = "model.layers.3.mlp.experts.5.down_proj.weight"
    names = sorted(tensors)
    first = {n: tensors[n] for n in names[: len(names) // 2]} | {twice: tensors[twice]}
    second = {n: tensors[n] for n in names[len(names) // 2 :]} | {twice: tensors[twice]}
    write_shards(tmp_path / "bad", [first, second])
    with pytest.raises(ValueError, match="nothing was loaded") as err:
        load_state_dict(tmp_path / "bad", config)
    message = str(err.value)
    assert "missing (1):\n    model.layers.1.mlp.experts.3.up_proj.weight\n" in message
    assert "unexpected (1):\n    model.layers.1.mlp.experts.3.bias\n" in message
    shards = "model-00001-of-00002.safetensors, model-00002-of-00002.safetensors"
    assert f"duplicate (1):\n    {twice} is in {shards}" in message


def test_load_refuses_a_shared_expert_stored_among_the_routed_ones(loaded, tmp_path):
    _, saved, config, _ = loaded
    tensors = read_dir(saved)
    for proj in ("gate_proj", "up_proj", "down_proj"):  # a 9th "expert" in an 8-expert layer
        tensors[f"model.layers.1.mlp.experts.8.{proj}.weight"] = tensors[
            f"model.layers.1.mlp.experts.0.{proj}.weight"
        ].clone()
    write_shards(tmp_path / "bad", [tensors])
    with pytest.raises(ValueError, match="unexpected \\(3\\)") as err:
        load_state_dict(tmp_path / "bad", config)
    assert "model.layers.1.mlp.experts.8.gate_proj.weight (expert 8 >= num_experts=8" in str(
        err.value
    )


def test_load_reports_an_expert_given_twice(loaded, tmp_path):
    model, saved, config, _ = loaded
    tensors = read_dir(saved)  # per-expert layer 1, plus the fused copy of the same experts
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = model.model.layers[
        1
    ].mlp.experts.gate_up_proj
    write_shards(tmp_path / "bad", [{n: t.detach().clone() for n, t in tensors.items()}])
    with pytest.raises(ValueError) as err:
        load_state_dict(tmp_path / "bad", config)
    message = str(err.value)
    expert = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert f"{expert} is given by {expert} and model.layers.1.mlp.experts.gate_up_proj" in message
    assert "duplicate (16):" in message  # gate and up rows of all 8 experts


def test_load_reports_shapes_and_dtypes(loaded, tmp_path):
    _, saved, config, _ = loaded
    tensors = read_dir(saved)
    tensors["model.embed_tokens.weight"] = torch.zeros(100, 64)
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int64)
    tensors["model.layers.1.mlp.experts.2.down_proj.weight"] = torch.zeros(64, 32).bfloat16()
    write_shards(tmp_path / "bad", [tensors])
    with pytest.raises(ValueError) as err:
        load_state_dict(tmp_path / "bad", config)
    message = str(err.value)
    assert "model.embed_tokens.weight: has [100, 64], config expects [128, 64]" in message
    assert "model.norm.weight: dtype I64; fp4rl loads F64, F32, F16 or BF16" in message
    assert "layers.1.mlp.experts.w2: pieces mix ['BF16', 'F32']" in message


def test_load_with_the_wrong_config_lists_a_bounded_report(loaded):
    _, saved, config, _ = loaded
    with pytest.raises(ValueError, match=r"missing \(48\):\n(    .*\n){20}    \.\.\. and 28 more"):
        load_state_dict(saved, dataclasses.replace(config, num_experts=16))


def test_tied_embeddings(make_hf_checkpoint, tmp_path):
    model, saved = make_hf_checkpoint("qwen3_moe", tie_word_embeddings=True)
    config = ModelConfig.from_pretrained_dir(saved)
    assert config.tie_word_embeddings and "lm_head.weight" not in read_dir(saved)
    state = load_state_dict(saved, config)
    assert "lm_head.weight" not in state
    # nn.Module.state_dict() lists a tied weight under both names; saving accepts that.
    save_checkpoint(
        {**state, "lm_head.weight": state["embed_tokens.weight"]}, config, tmp_path / "a"
    )
    assert_same(read_dir(tmp_path / "a"), read_dir(saved))
    with pytest.raises(ValueError, match="lm_head.weight differs from embed_tokens.weight"):
        fp4rl_to_hf({**state, "lm_head.weight": torch.zeros(128, 64)}, config)
    # Some writers store the tied head anyway: accepted when it is the embedding, else refused.
    embed = read_dir(saved)["model.embed_tokens.weight"]
    write_shards(tmp_path / "b", [{**read_dir(saved), "lm_head.weight": embed.clone()}])
    assert_same(load_state_dict(tmp_path / "b", config), state)
    write_shards(tmp_path / "c", [{**read_dir(saved), "lm_head.weight": embed + 1}])
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_state_dict(tmp_path / "c", config)


def test_fp4rl_to_hf_returns_views(loaded):
    _, _, config, state = loaded
    hf = fp4rl_to_hf(state, config)
    gate = hf["model.layers.1.mlp.experts.4.gate_proj.weight"]
    assert gate.data_ptr() == state["layers.1.mlp.experts.w13"][4].data_ptr()
    assert hf["model.layers.1.mlp.gate.weight"] is state["layers.1.mlp.router.weight"]
    assert hf.keys() == hf_to_fp4rl_names(config).keys()
