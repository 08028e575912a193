"""Reading a local Hugging Face safetensors checkpoint into an fp4rl state dict.

Owns ``load_state_dict``: finding the files (one ``model.safetensors``, or shards with
``model.safetensors.index.json``), checking every tensor header against the config before any
data is read, and filling fp4rl parameters from routed experts stored either per expert
(``mlp.experts.{j}.gate_proj.weight``: the hub layout, and what transformers' ``save_pretrained``
writes by default) or fused (``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj``
[E, H, I]: transformers v5 with ``save_original_format=False``). Does not own the name table
(``names``), writing (``writer``) or putting weights into a model (``fp4rl.model.weights``).

Legend: E experts, I moe_intermediate_size, H hidden_size.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fp4rl.model.checkpoint.names import (
    INDEX_FILE,
    MODEL_FILE,
    Slot,
    _Problems,
    hf_to_fp4rl_names,
    parameter_shapes,
)
from fp4rl.model.config import ModelConfig

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors spellings fp4rl loads
_FUSED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


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
        with _open(path / file) as f:
            for src in file_sources:
                tensor, slot = f.get_tensor(src.hf_name), src.slot
                if slot.expert is None:
                    params[slot.name] = tensor
                    continue
                if slot.name not in params:
                    params[slot.name] = torch.empty(shapes[slot.name], dtype=tensor.dtype)
                params[slot.name][slot.index].copy_(tensor)
    if tied_head is not None:
        with _open(path / tied_head) as f:
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
    weight_map = _read_index(index)
    files = sorted(set(weight_map.values()))
    for file in files:
        if not (path / file).is_file():
            raise FileNotFoundError(f"{INDEX_FILE} names {file}, which is not in {path}")
    return files, weight_map


def _read_index(index: Path) -> dict[str, str]:
    try:
        d = json.loads(index.read_text())  # ValueError also covers bytes that are not UTF-8
    except ValueError as err:
        raise ValueError(f"{index}: not valid JSON: {err}") from err
    weight_map = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f'{index}: has no "weight_map" object of tensor name -> file name')
    return weight_map


@contextmanager
def _open(file: Path) -> Iterator:
    """``safe_open``, with safetensors' errors (a truncated or corrupt file) naming the file."""
    try:
        with safe_open(file, framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise ValueError(f"{file}: not a readable safetensors file: {err}") from err


_Header = tuple[str, list[int], str]  # (file, shape, safetensors dtype) of one stored tensor


def _read_headers(path: Path, files: list[str]) -> dict[str, list[_Header]]:
    """Every stored tensor name -> each file holding it (more than one is a duplicate)."""
    headers = defaultdict(list)
    for file in files:
        with _open(path / file) as f:
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
