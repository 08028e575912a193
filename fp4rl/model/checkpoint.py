"""Hugging Face safetensors checkpoints <-> fp4rl state dicts.

Owns the one mapping between hub tensor names and fp4rl parameter names (``hf_to_fp4rl_names``,
used in both directions), reading a local checkpoint and writing one. Reads a single
``model.safetensors`` or shards with ``model.safetensors.index.json``, with routed experts either
per expert (``mlp.experts.{j}.gate_proj.weight``: the hub layout, and what transformers'
``save_pretrained`` writes by default) or fused (``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I]: transformers v5 with ``save_original_format=False``).
Always writes the per-expert hub layout. Does not own the model or the refit stream.

Legend: E experts, I moe_intermediate_size, H hidden_size, V vocab_size.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp4rl.model.config import ModelConfig

MODEL_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors spellings fp4rl loads
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
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


@dataclass(frozen=True, slots=True)
class _Source:
    hf_name: str
    file: str
    slot: Slot


def load_state_dict(path: str | Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """fp4rl parameters (CPU, the checkpoint's dtypes) from a local HF checkpoint directory.

    Every tensor header is checked before any data is read: missing, unexpected and duplicate
    names, shapes and dtypes are reported together in one ValueError. Experts are copied into
    their stacked parameter one at a time, so the peak is the result plus one hub tensor.
    """
    path = Path(path)
    files, weight_map = _checkpoint_files(path)
    headers = _read_headers(path, files)
    sources, tied_head = _plan(headers, weight_map, config, path)
    shapes, params, by_file = parameter_shapes(config), {}, defaultdict(list)
    for src in sources:
        by_file[src.file].append(src)
    for file, file_sources in by_file.items():
        with safe_open(path / file, framework="pt") as f:
            for src in file_sources:
                tensor, slot = f.get_tensor(src.hf_name), src.slot
                if slot.expert is None:
                    params[slot.name] = tensor
                    continue
                if slot.name not in params:
                    params[slot.name] = torch.empty(shapes[slot.name], dtype=tensor.dtype)
                params[slot.name][slot.index].copy_(tensor)
    if tied_head is not None:
        with safe_open(path / tied_head, framework="pt") as f:
            if not torch.equal(f.get_tensor("lm_head.weight"), params["embed_tokens.weight"]):
                raise ValueError(
                    f"{path}: tie_word_embeddings=True but lm_head.weight differs from "
                    "model.embed_tokens.weight"
                )
    return {name: params[name] for name in shapes}


def _checkpoint_files(path: Path) -> tuple[list[str], dict[str, str] | None]:
    single, index = path / MODEL_FILE, path / INDEX_FILE
    if single.exists() and index.exists():
        raise ValueError(f"{path} holds both {MODEL_FILE} and {INDEX_FILE}; remove the stale one")
    if single.exists():
        return [MODEL_FILE], None
    if not index.exists():
        raise FileNotFoundError(f"no {MODEL_FILE} or {INDEX_FILE} in {path}")
    weight_map = json.loads(index.read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    for file in files:
        if not (path / file).is_file():
            raise FileNotFoundError(f"{INDEX_FILE} names {file}, which is not in {path}")
    return files, weight_map


_Header = tuple[str, list[int], str]  # (file, shape, safetensors dtype) of one stored tensor


def _read_headers(path: Path, files: list[str]) -> dict[str, list[_Header]]:
    """Every stored tensor name -> each file holding it (more than one is a duplicate)."""
    headers = defaultdict(list)
    for file in files:
        with safe_open(path / file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                piece = f.get_slice(name)
                headers[name].append((file, piece.get_shape(), piece.get_dtype()))
    return headers


def _plan(
    headers: dict[str, list[_Header]],
    weight_map: dict[str, str] | None,
    config: ModelConfig,
    path: Path,
) -> tuple[list[_Source], str | None]:
    """Which hub tensor fills which slot, from the headers alone; raises on any problem."""
    table, shapes = hf_to_fp4rl_names(config), parameter_shapes(config)
    pieces_of: dict[str, list[Slot]] = defaultdict(list)
    for slot in table.values():
        pieces_of[slot.name].append(slot)
    problems, sources, tied_head = _Problems(), [], None
    given_by: dict[Slot, list[str]] = defaultdict(list)
    dtypes_of: dict[str, set[str]] = defaultdict(set)
    for name, holders in headers.items():
        file, shape, dtype = holders[0]
        if len(holders) > 1:
            problems.duplicate.append(f"{name} is in {', '.join(h[0] for h in holders)}")
        if weight_map is not None and weight_map.get(name) not in [h[0] for h in holders]:
            problems.index.append(f"{INDEX_FILE} maps {name} to {weight_map.get(name)}, not {file}")
        if config.tie_word_embeddings and name == "lm_head.weight":
            tied_head = file  # checked against the embedding once that is read
            continue
        slot = table.get(name) or _fused_slot(name, config)
        if slot is None:
            problems.unexpected.append(name + _expert_hint(name, config))
            continue
        # A fused tensor fills every piece of its parameter; overlaps are duplicates.
        for piece in pieces_of[slot.name] if slot.expert is None else [slot]:
            given_by[piece].append(name)
        expected = slot.shape(shapes[slot.name])
        if tuple(shape) != expected:
            problems.shape.append(f"{name}: has {shape}, config expects {list(expected)}")
        if dtype not in _FLOAT_DTYPES:
            problems.dtype.append(f"{name}: dtype {dtype}; fp4rl loads F64, F32, F16 or BF16")
        dtypes_of[slot.name].add(dtype)
        sources.append(_Source(name, file, slot))
    if weight_map is not None:
        problems.index += [
            f"{INDEX_FILE} lists {n}, which no shard holds"
            for n in weight_map.keys() - headers.keys()
        ]
    for hf, slot in table.items():
        if not given_by[slot]:
            problems.missing.append(hf)
        elif len(given_by[slot]) > 1:
            problems.duplicate.append(f"{hf} is given by {' and '.join(given_by[slot])}")
    problems.dtype += [f"{n}: pieces mix {sorted(d)}" for n, d in dtypes_of.items() if len(d) > 1]
    problems.raise_if_any(f"checkpoint {path} does not match its {config.architecture} config")
    return sources, tied_head


def _expert_hint(name: str, config: ModelConfig) -> str:
    """Why an expert name outside the routed-expert range is refused."""
    match = re.search(r"\.mlp\.experts\.(\d+)\.", name)
    if match is None or int(match.group(1)) < config.num_experts:
        return ""
    return (
        f" (expert {match.group(1)} >= num_experts={config.num_experts}: a shared expert fused "
        "into the routed experts? fp4rl keeps the shared expert separate and BF16)"
    )


def _fused_slot(name: str, config: ModelConfig) -> Slot | None:
    m = _FUSED_EXPERTS.fullmatch(name)
    if m is None or int(m[1]) not in config.moe_layers():
        return None
    return Slot(f"layers.{m[1]}.mlp.experts.{'w13' if m[2] == 'gate_up_proj' else 'w2'}")


def save_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    config: ModelConfig,
    path: str | Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> None:
    """Write config.json and the hub per-expert safetensors layout (sharded with an index when
    larger than ``max_shard_bytes``) to the new directory ``path``.

    Atomic: everything is written and fsynced in a temporary sibling directory that is then
    renamed to ``path``, so a crash or error never leaves a partial checkpoint. An existing
    non-empty ``path`` is never overwritten.
    """
    if type(max_shard_bytes) is not int or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    path = Path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise FileExistsError(f"{path} exists and is not an empty directory; not overwriting it")
    tensors = fp4rl_to_hf(state_dict, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    # mkdir rather than tempfile.mkdtemp: that makes the directory 0700, unreadable by others.
    tmp = path.parent / f".{path.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        _write(tmp, tensors, config, max_shard_bytes)
        _fsync(tmp)  # the file names inside it, before they become visible under `path`
        os.rename(tmp, path)
        _fsync(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write(
    directory: Path, tensors: dict[str, torch.Tensor], config: ModelConfig, max_shard_bytes: int
) -> None:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():  # model order keeps a layer's tensors together
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    n = len(shards)
    files = (
        [MODEL_FILE]
        if n == 1
        else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    )
    for file, shard in zip(files, shards, strict=True):
        # safetensors refuses tensors that share storage (w13's gate and up views of one expert),
        # so each shard is copied out; the copies last one shard.
        shard_tensors = {name: tensors[name].detach().to("cpu", copy=True) for name in shard}
        save_file(shard_tensors, directory / file, metadata={"format": "pt"})
        _fsync(directory / file)
    if n > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {
            name: file for file, shard in zip(files, shards, strict=True) for name in shard
        }
        _write_json(
            directory / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
    dtype = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    _write_json(directory / "config.json", config.to_hf_dict(dtype=dtype))


def _write_json(file: Path, obj: object) -> None:
    file.write_text(json.dumps(obj, indent=2) + "\n")
    _fsync(file)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
