"""Engine.from_pretrained: the checkpoint's weights, experts packed at load, EOS from the files."""

import json

import pytest
import torch
from tiny_models import rollout_model, tiny_precision

from fp4rl.model.checkpoint import save_checkpoint
from fp4rl.rollout import Engine, EngineConfig, SamplingParams
from fp4rl.rollout.generation_config import eos_token_ids


def test_from_pretrained_generates_what_the_in_memory_model_does(tmp_path):
    packed, qat = rollout_model("nvfp4", "nvfp4", seed=4)
    save_checkpoint(qat.state_dict(), qat.config, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9]}))
    config = EngineConfig(
        kv_memory_bytes=1 << 20, max_model_len=32, max_num_batched_tokens=64,
        max_num_seqs=8,
    )  # fmt: skip
    loaded = Engine.from_pretrained(
        tmp_path / "ckpt", config, precision=tiny_precision("nvfp4"), dtype=torch.float32
    )
    assert loaded.eos_token_ids == (5, 9)
    sampling = SamplingParams(n=2, max_tokens=8, seed=1, ignore_eos=True)
    a = loaded.generate([[1, 2, 3]], sampling)
    b = Engine(packed, config).generate([[1, 2, 3]], sampling)
    for x, y in zip(a, b, strict=True):
        assert x.completion_ids == y.completion_ids and torch.equal(x.logprobs, y.logprobs)


def test_eos_ids_prefer_generation_config(tmp_path):
    assert eos_token_ids(tmp_path) == ()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert eos_token_ids(tmp_path) == (3,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert eos_token_ids(tmp_path) == (1, 2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_token_ids(tmp_path)
