"""The one name table between Hugging Face checkpoints and fp4rl state dicts.

Owns fp4rl's parameter names and shapes for a config (``parameter_shapes``), the hub name of each
piece of them (``hf_to_fp4rl_names``, ``Slot``: a whole tensor, one expert of a stacked tensor,
or a row range of one), the hub view of an fp4rl state dict (``fp4rl_to_hf``), the checkpoint
file names, what in a state dict is not finite (``non_finite``), and the one-error report of
everything wrong (``_Problems``). Reads and writes no file: ``reader`` and ``writer`` do, both
through this table. Does not own the model.

Legend: E experts, I moe_intermediate_size, H hidden_size, V vocab_size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch

from fp4rl.model.config import ModelConfig

MODEL_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_ROUTED_EXPERTS = re.compile(r"layers\.\d+\.mlp\.experts\.(w13|w2)")  # [E, 2I, H], [E, H, I]
_MAX_LISTED = 20  # per kind of problem; a wrong config can make every name missing


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one hub tensor lives in an fp4rl parameter: all of it (``expert`` None), one expert
    of a stacked tensor, or a row range of one expert (w13: gate [0, I), up [I, 2I))."""

    name: str
    expert: int | None = None
    rows: tuple[int, int] | None = None

    @property
    def index(self) -> tuple:
        if self.expert is None:
            return ()
        return (self.expert,) if self.rows is None else (self.expert, slice(*self.rows))

    def shape(self, param_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.expert is None:
            return param_shape
        if self.rows is None:
            return param_shape[1:]
        return (self.rows[1] - self.rows[0], *param_shape[2:])


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every fp4rl parameter name and shape, in model order: the model's ``state_dict()``."""
    c = config
    H, V, D = c.hidden_size, c.vocab_size, c.head_dim
    shapes = {"embed_tokens.weight": (V, H)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, H)
            if c.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (H, q)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (D,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        if c.is_moe_layer(i):
            E, I, S = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
            shapes[p + "mlp.router.weight"] = (E, H)
            shapes[p + "mlp.experts.w13"] = (E, 2 * I, H)
            shapes[p + "mlp.experts.w2"] = (E, H, I)
            if S:
                shapes.update(_mlp_shapes(p + "mlp.shared_expert.", H, S))
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, H)
        else:
            shapes.update(_mlp_shapes(p + "mlp.", H, c.intermediate_size))
    shapes["norm.weight"] = (H,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


def hf_to_fp4rl_names(config: ModelConfig) -> dict[str, Slot]:
    """Every hub tensor name (per-expert layout) -> its place in an fp4rl parameter.

    The one name table: loading reads through it, saving (``fp4rl_to_hf``) writes through it.
    HF prefixes everything but lm_head with ``model.`` and calls the router ``mlp.gate``.
    """
    table = {}
    for name, shape in parameter_shapes(config).items():
        layer, _, leaf = name.rpartition(".mlp.experts.")
        experts = f"model.{layer}.mlp.experts"
        if leaf == "w13":
            inter = shape[1] // 2
            for j in range(shape[0]):
                table[f"{experts}.{j}.gate_proj.weight"] = Slot(name, j, (0, inter))
                table[f"{experts}.{j}.up_proj.weight"] = Slot(name, j, (inter, 2 * inter))
        elif leaf == "w2":
            for j in range(shape[0]):
                table[f"{experts}.{j}.down_proj.weight"] = Slot(name, j)
        elif name == "lm_head.weight":
            table[name] = Slot(name)
        else:
            table["model." + name.replace(".mlp.router.", ".mlp.gate.")] = Slot(name)
    return table


def fp4rl_to_hf(
    state_dict: Mapping[str, torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """The hub-named tensors of an fp4rl state dict, as views (no copies) in model order.

    A tied ``lm_head.weight`` (``nn.Module.state_dict`` lists it beside ``embed_tokens``) is
    accepted and left out, as the hub does, if it equals the embedding.
    """
    problems, shapes = _Problems(), parameter_shapes(config)
    names = set(state_dict)
    if config.tie_word_embeddings and "lm_head.weight" in names:
        names.discard("lm_head.weight")
        head, embed = state_dict["lm_head.weight"], state_dict.get("embed_tokens.weight")
        if embed is not None and not torch.equal(head, embed):
            problems.tied.append("lm_head.weight differs from embed_tokens.weight")
    problems.missing += [n for n in shapes if n not in names]
    problems.unexpected += sorted(names - shapes.keys())
    for name in (n for n in shapes if n in names):
        t = state_dict[name]
        if tuple(t.shape) != shapes[name]:
            problems.shape.append(
                f"{name}: has {list(t.shape)}, config expects {list(shapes[name])}"
            )
        if not t.is_floating_point():
            problems.dtype.append(f"{name}: {t.dtype} is not a floating-point dtype")
    problems.raise_if_any(f"state dict does not match its {config.architecture} config")
    return {hf: _piece(state_dict[s.name], s) for hf, s in hf_to_fp4rl_names(config).items()}


def _piece(param: torch.Tensor, slot: Slot) -> torch.Tensor:
    return param[slot.index] if slot.index else param


def non_finite(
    state_dict: Mapping[str, torch.Tensor], cast_to: Mapping[str, torch.dtype] | None = None
) -> list[str]:
    """One line per tensor of ``state_dict`` that holds NaN or infinity, in its own dtype or in
    ``cast_to[name]`` (a finite FP32 value can overflow BF16); routed-expert tensors
    (``layers.N.mlp.experts.w13`` [E, 2I, H], ``.w2`` [E, H, I]) name the experts holding them.

    Cheap when all is well: one ``aminmax`` per tensor, which propagates NaN and allocates
    nothing the size of the tensor (``isfinite().all()`` would). Rounding is monotonic, so the
    two extremes stay finite in a narrower dtype iff every value does. Only a bad tensor is
    read again, to say where.
    """
    found = []
    for name, t in state_dict.items():
        dtype = (cast_to or {}).get(name, t.dtype)
        if not t.is_floating_point() or t.numel() == 0:
            continue
        # float8 has no aminmax or isfinite: look at it in FP32 (exact), and at any value as it
        # is held in `dtype` by a round trip back into the wide dtype (inf and NaN survive it).
        wide = t if t.itemsize > 1 else t.float()
        if torch.isfinite(torch.stack(torch.aminmax(wide)).to(dtype).to(wide.dtype)).all():
            continue
        bad = ~torch.isfinite(wide.to(dtype).to(wide.dtype))
        where = f" (as {dtype})" if dtype != t.dtype else ""
        if _ROUTED_EXPERTS.fullmatch(name) and t.dim() == 3:
            experts = bad.flatten(1).any(1).nonzero().flatten().tolist()
            found.append(f"{name}: non-finite values{where} in experts {experts}")
        else:
            found.append(f"{name}: {int(bad.sum())} non-finite values{where} of {t.numel()}")
    return found


@dataclass(slots=True)
class _Problems:
    """Everything wrong with a checkpoint, gathered so that one error lists it all."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    duplicate: list[str] = field(default_factory=list)
    shape: list[str] = field(default_factory=list)
    dtype: list[str] = field(default_factory=list)
    index: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)

    def raise_if_any(self, what: str) -> None:
        lines = []
        for f in fields(self):
            items = getattr(self, f.name)
            if items:
                lines.append(f"  {f.name} ({len(items)}):")
                lines += [f"    {item}" for item in items[:_MAX_LISTED]]
                if len(items) > _MAX_LISTED:
                    lines.append(f"    ... and {len(items) - _MAX_LISTED} more")
        if lines:
            raise ValueError(f"{what}; nothing was loaded or written:\n" + "\n".join(lines))
