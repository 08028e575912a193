"""Loading and saving fail closed: a bad file or weight is refused, named, and changes nothing.

Each refusal is held to the exact name it must give: the file for an unreadable checkpoint,
the tensor (and for routed experts the expert ids) for a non-finite weight.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from fp4rl.model.checkpoint import INDEX_FILE, MODEL_FILE, load_state_dict, save_checkpoint
from fp4rl.model.config import ModelConfig

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
