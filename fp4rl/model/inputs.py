"""Checks of what a forward is given, with messages that name the argument and the value.

`check_inputs` runs on every forward and reads only shapes, dtypes and keys (no device sync);
`check_ids` reads the values of token and routing ids (one sync), for callers that check a
batch once rather than every engine step: the trainer's entry point, and the engine's prompt
check for tokens.
"""

from __future__ import annotations

import torch

from fp4rl.records import GuidanceMap, record_num_rows


def check_inputs(model, tokens_T, attn, routing, guidance: GuidanceMap | None) -> None:
    if tokens_T.dim() != 1 or tokens_T.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"tokens_T must be a 1-D int32/int64 tensor, got {tokens_T.dtype} "
            f"{tuple(tokens_T.shape)}"
        )
    T = tokens_T.shape[0]
    if attn.positions.shape != (T,):
        raise ValueError(
            f"the attention backend covers {attn.positions.shape[0]} tokens (its sequence "
            f"lengths' sum) but tokens_T has {T}"
        )
    if routing is not None:
        want = (len(model.moe_layers), T, model.config.num_experts_per_tok)
        if tuple(routing.shape) != want or routing.is_floating_point():
            raise ValueError(
                f"routing must be an int tensor of shape {want} (moe layers, tokens, top_k), "
                f"got {routing.dtype} {tuple(routing.shape)}"
            )
    if guidance is not None:
        _check_guidance(model.plan, model.guided_keys, guidance, T)


def _check_guidance(plan, expected, guidance: GuidanceMap, T: int) -> None:
    for key in sorted(set(guidance) - expected):
        layer, site = key
        where = (
            plan.layers[layer] if isinstance(layer, int) and 0 <= layer < len(plan.layers) else None
        )
        why = (
            "no such layer"
            if where is None
            else f"the precision plan gives it experts={where.experts}, kv_cache={where.kv_cache}"
            f", guided sites {plan.guided_sites}"
        )
        raise ValueError(
            f"guidance has a record for layers.{layer} site '{site}', which this model does "
            f"not round as an FP4 site ({why}); guidance must come from a rollout of the same "
            "precision plan"
        )
    for key in sorted(expected - set(guidance)):
        raise ValueError(
            f"guidance has no entry for layers.{key[0]} site '{key[1]}'; refusing to fall back "
            "to nearest rounding silently (an entry of None asks for nearest on purpose)"
        )
    for (layer, site), record in guidance.items():
        if record is not None and record_num_rows(record) != T:
            raise ValueError(
                f"guidance for layers.{layer} site '{site}' has {record_num_rows(record)} rows "
                f"for {T} tokens"
            )


def check_ids(model, tokens_T: torch.Tensor, routing: torch.Tensor | None = None) -> None:
    """Token ids in ``[0, vocab_size)``; routing ids in ``[-1, num_experts)`` (-1: no record)."""
    vocab = model.config.vocab_size
    if tokens_T.numel():
        lo, hi = int(tokens_T.min()), int(tokens_T.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"tokens_T holds token id {bad} outside the vocabulary [0, {vocab})")
    if routing is not None and routing.numel():
        E = model.config.num_experts
        lo, hi = int(routing.min()), int(routing.max())
        if lo < -1 or hi >= E:
            bad = lo if lo < -1 else hi
            raise ValueError(
                f"routing holds expert id {bad} outside [0, num_experts={E}) (-1 marks a token "
                "without a record)"
            )
