"""Putting BF16 weights into a built model: checkpoints at start-up, and every refit.

`load_weights` is the one path by which weights enter a model. It checks the whole state dict
against the model before touching anything (names, shapes, dtypes, and that every tensor is
finite in the dtype the model will hold it in), quantizes the routed experts of `PackedExperts`
layers, and only then copies into the existing storage. A bad state dict raises with every
problem named and leaves the model exactly as it was: no half-applied weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fp4rl.model.checkpoint import load_state_dict, non_finite
from fp4rl.model.config import ModelConfig
from fp4rl.model.experts import PackedExperts
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.transformer import MoETransformer, build_model


def expected_shapes(model: MoETransformer) -> dict[str, tuple[int, ...]]:
    """Every weight the model takes, packed experts included (as their BF16 shapes)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, PackedExperts):
            E, I, H = module.num_experts, module.intermediate, model.config.hidden_size
            shapes[f"{name}.w13"] = (E, 2 * I, H)
            shapes[f"{name}.w2"] = (E, H, I)
    return shapes


@torch.no_grad()
def load_weights(model: MoETransformer, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy ``state_dict`` into ``model``; all-or-nothing."""
    shapes = expected_shapes(model)
    tied = model.config.tie_word_embeddings
    problems = []
    missing = sorted(set(shapes) - set(state_dict) - ({"lm_head.weight"} if tied else set()))
    unexpected = sorted(set(state_dict) - set(shapes))
    if missing:
        problems.append(f"missing: {missing}")
    if unexpected:
        problems.append(f"unexpected: {unexpected}")
    for name, tensor in state_dict.items():
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, model has {shapes[name]}")
        elif name in shapes and not tensor.is_floating_point():
            problems.append(f"{name}: dtype {tensor.dtype} is not floating point")
    # Packed experts are quantized from the values in the model's own dtype (below).
    reference, params = model.embed_tokens.weight, dict(model.named_parameters())
    cast_to = {n: params[n].dtype if n in params else reference.dtype for n in shapes}
    problems += non_finite({n: t for n, t in state_dict.items() if n in shapes}, cast_to)
    if problems:
        raise ValueError("refusing to load weights:\n  " + "\n  ".join(problems))

    # Quantize every packed layer before writing anything, so a failure changes nothing.
    # Experts are quantized from the values the trainer holds in the model's own dtype.
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
