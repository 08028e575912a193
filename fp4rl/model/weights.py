"""Putting BF16 weights into a built model: checkpoints at start-up, and every refit.

`load_weights` puts a whole state dict in at once. It checks the state dict against the model
before touching anything (names, shapes, dtypes, and that every tensor is finite in the dtype the
model will hold it in), quantizes the routed experts of `PackedExperts` layers, and only then
copies into the existing storage. A bad state dict raises with every problem named and leaves
the model exactly as it was: no half-applied weights. The refit receiver (`fp4rl.refit`) streams
weights in instead, tensor by tensor; both take the model's inventory from `weight_specs` and
check each tensor with `check_weight`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fp4rl.model.checkpoint import load_state_dict, non_finite
from fp4rl.model.config import ModelConfig
from fp4rl.model.experts import PackedExperts
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.transformer import MoETransformer, build_model


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """What a model takes under one name: the shape it arrives in (packed experts: their BF16
    shape), the dtype it is held in (packed experts: the dtype they are quantized from), and
    whether it is held packed as NVFP4 (quantized when loaded)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    packed: bool = False


def weight_specs(model: MoETransformer) -> dict[str, WeightSpec]:
    """Every weight the model takes, in model order (a tied lm_head is the embedding's)."""
    reference = model.embed_tokens.weight
    specs = {name: WeightSpec(tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, PackedExperts):
            E, I, H = module.num_experts, module.intermediate, model.config.hidden_size
            specs[f"{name}.w13"] = WeightSpec((E, 2 * I, H), reference.dtype, packed=True)
            specs[f"{name}.w2"] = WeightSpec((E, H, I), reference.dtype, packed=True)
    return specs


def check_weight(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> str | None:
    """What is wrong with one incoming tensor's shape or dtype, or None; reads no values.

    The one such check: `load_weights` runs it over a state dict, the refit receiver
    (`fp4rl.refit`) over each tensor of a stream as it arrives (``shape`` then is the piece's,
    for a hub per-expert tensor). Finiteness is checked in the dtype the model holds.
    """
    if tuple(tensor.shape) != shape:
        return f"{name}: shape {tuple(tensor.shape)}, model has {shape}"
    if not tensor.is_floating_point():
        return f"{name}: dtype {tensor.dtype} is not floating point"
    return None


@torch.no_grad()
def load_weights(model: MoETransformer, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``model``; all-or-nothing."""
    specs = weight_specs(model)
    tied = model.config.tie_word_embeddings
    problems = []
    missing = sorted(set(specs) - set(state_dict) - ({"lm_head.weight"} if tied else set()))
    unexpected = sorted(set(state_dict) - set(specs))
    if missing:
        problems.append(f"missing: {missing}")
    if unexpected:
        problems.append(f"unexpected: {unexpected}")
    for name, tensor in state_dict.items():
        problem = check_weight(name, tensor, specs[name].shape) if name in specs else None
        if problem:
            problems.append(problem)
    # Finite in the dtype the model holds: packed experts are quantized from those values.
    cast_to = {name: spec.dtype for name, spec in specs.items()}
    problems += non_finite({n: t for n, t in state_dict.items() if n in specs}, cast_to)
    if problems:
        raise ValueError("refusing to load weights:\n  " + "\n  ".join(problems))

    # Quantize every packed layer before writing anything, so a failure changes nothing.
    # Experts are quantized from the values the trainer holds in the model's own dtype.
    reference, params = model.embed_tokens.weight, dict(model.named_parameters())
    packed = {}
    for name, module in model.named_modules():
        if isinstance(module, PackedExperts):
            w13, w2 = (
                state_dict[f"{name}.{w}"].to(reference.device, reference.dtype)
                for w in ("w13", "w2")
            )
            packed[name] = module.quantized(w13, w2)
    for name, tensor in state_dict.items():
        if name in params:
            params[name].copy_(tensor)
    for name, (w13, w2) in packed.items():
        model.get_submodule(name).install(w13, w2, reference.dtype)


def load_pretrained(
    path: str | Path,
    precision: PrecisionConfig | None = None,
    *,
    fp4_experts: str = "qat",
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> MoETransformer:
    """Build the model a local HF checkpoint directory describes and load its weights."""
    config = ModelConfig.from_pretrained_dir(path)
    model = build_model(config, precision, fp4_experts=fp4_experts, dtype=dtype, device=device)
    load_weights(model, load_state_dict(path, config))
    return model
