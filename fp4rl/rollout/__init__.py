"""The rollout engine: continuous batching over a paged BF16 / NVFP4 KV cache, with capture of
routing and FP4 codes for the trainer. See `fp4rl.rollout.engine` for the step loop."""

from fp4rl.records import Completion
from fp4rl.rollout.config import EngineConfig, SamplingParams
from fp4rl.rollout.engine import Engine

__all__ = ["Completion", "Engine", "EngineConfig", "SamplingParams"]
