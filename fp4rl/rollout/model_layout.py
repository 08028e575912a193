"""The few facts about the model that the rollout engine depends on, read in one place.

The engine works with `fp4rl.model.transformer.MoETransformer`: its ``config`` (a
`fp4rl.model.config.ModelConfig`), its precision ``plan`` (per-layer KV format, FP4 layers,
guided sites) and ``moe_layers`` (the order of the routing record). Anything else that quacks
the same (a test double) works too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4rl.rollout.kv_cache import KVCacheSpec


@dataclass(frozen=True, slots=True)
class ModelLayout:
    """The few facts about the model the engine depends on, read in one place."""

    vocab_size: int
    top_k: int
    moe_layers: tuple[int, ...]
    fp4_layers: tuple[int, ...]
    guided_keys: frozenset[tuple[int, str]]  # (layer, site) the trainer follows guidance for
    kv: KVCacheSpec
    device: torch.device

    @staticmethod
    def of(model) -> ModelLayout:
        c, plan = model.config, model.plan
        weight = model.embed_tokens.weight
        return ModelLayout(
            vocab_size=c.vocab_size,
            top_k=c.num_experts_per_tok,
            moe_layers=tuple(model.moe_layers),
            fp4_layers=tuple(plan.fp4_layers),
            guided_keys=plan.guided_keys(),
            kv=KVCacheSpec(
                layer_formats=plan.kv_formats,
                num_kv_heads=c.num_key_value_heads,
                head_dim=c.head_dim,
                dtype=weight.dtype,
            ),
            device=weight.device,
        )
