"""EngineConfig / SamplingParams validation and the KV budget -> blocks arithmetic."""

import pytest
import torch

from fp4rl.rollout.config import EngineConfig, SamplingParams
from fp4rl.rollout.kv_cache import KVCacheSpec, num_blocks_for_budget


@pytest.mark.parametrize(
    "key, value",
    [
        ("block_size", 0),
        ("kv_memory_bytes", 0),
        ("max_num_seqs", 0),
        ("max_model_len", 1),
        ("cuda_graphs", "yes"),
        ("keep_graphs", 1),
        ("chunked_prefill", 0),
        ("overlap_steps", "no"),
        ("max_num_seqs", 10_000),  # > max_num_batched_tokens
        ("guidance", "partial"),
        ("compact_fraction", 0.0),
        ("compact_fraction", 1.5),
        ("capture_routing", 1),
        ("block_size", 16.0),
    ],
)
def test_engine_config_rejects_naming_key_and_value(key, value):
    with pytest.raises(ValueError, match=rf"engine\.{key}.*{value!r}".replace("(", r"\(")):
        EngineConfig(**{key: value})


def test_a_prompt_longer_than_a_step_needs_chunked_prefill():
    assert EngineConfig(max_model_len=100_000).chunked_prefill
    with pytest.raises(ValueError, match=r"max_model_len \(100000\) without chunked prefill"):
        EngineConfig(max_model_len=100_000, chunked_prefill=False)


def test_the_kv_format_is_stated_once_in_the_precision_plan():
    with pytest.raises(TypeError, match="kv_format"):
        EngineConfig(kv_format="nvfp4")


@pytest.mark.parametrize(
    "key, value",
    [
        ("n", 0),
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", 0),
        ("max_tokens", 0),
        ("stop_token_ids", [2]),
        ("stop_token_ids", (-1,)),
        ("seed", -3),
        ("ignore_eos", "yes"),
        ("cdf_order", "sorted"),
    ],
)
def test_sampling_params_rejects_naming_key_and_value(key, value):
    with pytest.raises(ValueError, match=rf"sampling\.{key}"):
        SamplingParams(**{key: value})


@pytest.mark.parametrize("cut", [{"top_k": 50}, {"top_p": 0.9}])
def test_a_token_order_cdf_takes_no_top_k_or_top_p_cut(cut):
    with pytest.raises(ValueError, match=r"sampling\.cdf_order='token' draws from the whole vocab"):
        SamplingParams(cdf_order="token", **cut)
    assert SamplingParams(cdf_order="token", temperature=0).greedy  # greedy walks no CDF


def test_greedy_is_temperature_zero():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_blocks_from_budget_per_format():
    # Layer 0 BF16 (model dtype), layer 1 NVFP4: K and V per token.
    spec = KVCacheSpec(
        layer_formats=("bf16", "nvfp4"), num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
    )
    bf16_bytes = 2 * 2 * 64 * 2  # K and V, 2 heads, 64 values, 2 bytes
    nvfp4_bytes = 2 * 2 * (32 + 4 + 2)  # codes, e4m3 block scales, the row's bf16 amax
    assert spec.bytes_per_token() == bf16_bytes + nvfp4_bytes
    config = EngineConfig(
        block_size=16,
        kv_memory_bytes=10 * 16 * spec.bytes_per_token() + 5,
        max_model_len=160,
        max_num_batched_tokens=256,
    )
    assert num_blocks_for_budget(config, spec) == 10
    # NVFP4 buys 128 / (32 + 4 + 2) = 3.37x the tokens of BF16 at head_dim 64.
    all_bf16 = KVCacheSpec(
        layer_formats=("bf16",) * 2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
    )
    all_fp4 = KVCacheSpec(
        layer_formats=("nvfp4",) * 2, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
    )
    assert all_bf16.bytes_per_token() / all_fp4.bytes_per_token() == pytest.approx(128 / 38)


def test_budget_too_small_for_one_sequence():
    spec = KVCacheSpec(layer_formats=("bf16",), num_kv_heads=1, head_dim=16, dtype=torch.float32)
    config = EngineConfig(
        kv_memory_bytes=1000, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8
    )
    with pytest.raises(ValueError, match="kv_memory_bytes=1000"):
        num_blocks_for_budget(config, spec)


def test_nvfp4_needs_head_dim_multiple_of_16():
    with pytest.raises(ValueError, match="head_dim"):
        KVCacheSpec(layer_formats=("nvfp4",), num_kv_heads=1, head_dim=24, dtype=torch.float32)
