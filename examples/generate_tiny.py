"""Generate from a tiny random Qwen3-MoE checkpoint, without and with alignment capture.

    python examples/generate_tiny.py

Runs on a CPU in a few seconds. The checkpoint is written by fp4rl in the HF layout, then loaded
the way any local Qwen3-MoE / Qwen2-MoE directory is.
"""

import tempfile

import torch

from fp4rl.model.checkpoint import save_checkpoint
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import tiny_qwen3_moe
from fp4rl.model.transformer import build_model, init_weights
from fp4rl.records import capture_bytes_per_generated_token
from fp4rl.rollout import Engine, EngineConfig, SamplingParams

config = tiny_qwen3_moe(vocab_size=256, max_position_embeddings=512, mlp_only_layers=())
# Layers 1 and 2 run NVFP4 experts and an NVFP4 KV cache; layers 0 and 3 stay BF16. The
# precision plan is the one place that says so: the engine's cache follows it.
precision = PrecisionConfig(kv_cache="nvfp4", bf16_first_layers=1, bf16_last_layers=1)

with tempfile.TemporaryDirectory() as tmp:
    model = build_model(config, precision, dtype=torch.float32)
    init_weights(model, std=0.1)
    save_checkpoint(model.state_dict(), config, f"{tmp}/tiny")

    engine_config = EngineConfig(max_model_len=128, kv_memory_bytes=1 << 22)
    engine = Engine.from_pretrained(
        f"{tmp}/tiny", engine_config, precision=precision, dtype=torch.float32
    )
    print(engine.model.plan)
    prompts = [[1, 2, 3, 4], [10, 20, 30]]
    for c in engine.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=0)):
        print(
            c.prompt_index,
            c.sample_index,
            c.completion_ids,
            c.finish_reason,
            [round(x, 3) for x in c.logprobs.tolist()[:3]],
        )

    # The same generation with the routing record and compact guidance for the trainer.
    capturing = Engine.from_pretrained(
        f"{tmp}/tiny",
        EngineConfig(
            max_model_len=128,
            kv_memory_bytes=1 << 22,
            capture_routing=True,
            guidance="compact",
        ),
        precision=precision,
        dtype=torch.float32,
    )
    out = capturing.generate(prompts, SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=0))
    c = out[0]
    print(
        "routing",
        tuple(c.routing.shape),
        "guided sites",
        sorted(k for k, v in c.guidance.items() if v is not None),
    )
    print("capture bytes per generated token", capture_bytes_per_generated_token(out))
