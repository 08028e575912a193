"""Exporting a policy for serving: routed experts as packed NVFP4 in the compressed-tensors
``nvfp4-pack-quantized`` layout (what vLLM loads), or the plain BF16 checkpoint.

Owns `export` (a checkpoint directory, or a run directory's latest complete checkpoint, to a new
directory), the hub names and the scale convention of the NVFP4 layout, and the
``quantization_config`` that declares it. The experts are
quantized by the rollout engine's own call (`PackedExperts.quantized`), from the weights in the
dtype the engine holds them in (the run's ``model.dtype``) and in the layers its precision plan
makes FP4, so codes and block scales are the engine's bytes. Files go through
`fp4rl.model.checkpoint`'s atomic writer. Does not own the recipe (`fp4rl.fp4`) or a run's
checkpoints (`fp4rl.checkpoints`: which one is the latest complete one, the files of a model).

The NVFP4 layout, for routed expert ``j`` of an FP4 layer ``L`` and each projection ``P`` of
``gate_proj`` (W1: rows [0, I) of fp4rl's ``w13``), ``up_proj`` (W3: rows [I, 2I)) and
``down_proj`` (W2), under ``model.layers.L.mlp.experts.j.P.``:

- ``weight_packed``        U8       ``[out, in/2]``   E2M1 codes, element 2k in the low nibble
- ``weight_scale``         F8_E4M3  ``[out, in/16]``  one block scale per 16 values along ``in``
- ``weight_global_scale``  F32      ``[1]``           ``1 / s`` rounded to FP32

fp4rl multiplies by its global scale (``value = e2m1 * sf * s``); the format divides by its own
(``e2m1 * sf / weight_global_scale``), so the file holds the reciprocal, as compressed-tensors'
converter of ModelOpt checkpoints writes it from ModelOpt's ``weight_scale_2 = s``. gate_proj
and up_proj hold the same value (fp4rl's W1+W3 group per expert). Every other tensor is BF16
under its usual name, and its module is listed in ``ignore``. The scheme declared is weight-only
(NVFP4A16): docs/numerics.md says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fp4rl import checkpoints, checks
from fp4rl.config import RunConfig, load, parse_override
from fp4rl.fp4 import BLOCK_SIZE, NVFP4Tensor
from fp4rl.model.checkpoint import (
    fp4rl_to_hf,
    hf_to_fp4rl_names,
    load_state_dict,
    non_finite,
    save_checkpoint,
)
from fp4rl.model.checkpoint.writer import write_checkpoint
from fp4rl.model.config import ModelConfig
from fp4rl.model.experts import PackedExperts
from fp4rl.model.precision import PrecisionPlan, resolve_plan

FORMATS = ("nvfp4", "bf16")
DEVICES = ("cpu", "cuda")
COMPRESSION_FORMAT = "nvfp4-pack-quantized"
# The NVFP4 weight scheme (compressed-tensors' NVFP4A16 preset), in the fields every version of
# its QuantizationArgs reads (it refuses fields it does not know).
WEIGHT_SCHEME = {
    "num_bits": 4,
    "type": "float",
    "symmetric": True,
    "group_size": BLOCK_SIZE,
    "strategy": "tensor_group",
    "dynamic": False,
}


@dataclass(frozen=True, slots=True)
class Exported:
    checkpoint: Path  # the checkpoint directory that was read
    out: Path
    format: str
    fp4_layers: tuple[int, ...]  # decoder layers whose routed experts were written as NVFP4
    nbytes: int  # bytes of the tensors written

    def __str__(self) -> str:
        what = "every tensor BF16"
        if self.fp4_layers:
            what = f"routed experts of layers {list(self.fp4_layers)} NVFP4, the rest BF16"
        return (
            f"wrote {self.out} ({self.format}: {what}; {self.nbytes / 2**20:.1f} MiB of "
            f"tensors) from {self.checkpoint}"
        )


def export(
    source: str | Path,
    out: str | Path,
    *,
    format: str = "nvfp4",
    overrides: Sequence[str] = (),
    device: str = "cpu",
    max_shard_bytes: int = 5 * 2**30,
) -> Exported:
    """Write the policy of ``source`` (an HF checkpoint directory, or a run directory: its
    latest complete checkpoint) to the new directory ``out``, in ``format``.

    ``nvfp4``: the routed experts of the FP4 layers of the precision plan packed as the rollout
    engine packs them, everything else BF16. The plan and the engine's dtype come from the run's
    config.toml (a run directory) or the defaults (a checkpoint directory), with ``overrides``
    (``precision.KEY=VALUE``, ``model.dtype=...``) on top. ``bf16``: every tensor BF16.
    Tokenizer files and generation_config.json are copied. Bad input raises ValueError or
    FileNotFoundError naming it, before anything is written; the directory appears whole or not
    at all.
    """
    checks.choice("--format", format, FORMATS)
    checks.choice("--device", device, DEVICES)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but no CUDA device is available")
    source, out = Path(source), Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; export writes a new one")
    checkpoint, run_dir = resolve_source(source)
    config = ModelConfig.from_pretrained_dir(checkpoint)
    # What a servable checkpoint needs beside its weights: tokenizer, chat template, EOS ids.
    names = checkpoints.MODEL_FILES
    files = {n: (checkpoint / n).read_bytes() for n in names if (checkpoint / n).is_file()}
    if format == "bf16":
        if overrides:
            raise ValueError(
                f"--set {overrides[0]!r}: the precision matters to --format nvfp4 only"
            )
        state = cast_state_dict(checkpoint, config, {})
        save_checkpoint(state, config, out, files=files, max_shard_bytes=max_shard_bytes)
        return Exported(checkpoint, out, format, (), _nbytes(state.values()))
    run = run_config(run_dir, overrides)
    plan = resolve_plan(config, run.precision)
    if not plan.fp4_layers:
        raise ValueError(
            "--format nvfp4: the precision plan has no NVFP4 layer (precision.experts='bf16'); "
            "set precision.experts=nvfp4, or export --format bf16"
        )
    # The engine quantizes its experts from the weights in the run's dtype (float32 for the
    # demo); the export packs the same values, so its bytes are the engine's.
    engine_dtype = getattr(torch, run.model.dtype)
    experts = [f"layers.{i}.mlp.experts.{w}" for i in plan.fp4_layers for w in ("w13", "w2")]
    state = cast_state_dict(checkpoint, config, dict.fromkeys(experts, engine_dtype))
    tensors = nvfp4_tensors(state, config, plan, device)
    config_json = config.to_hf_dict(dtype="bfloat16")
    config_json["quantization_config"] = quantization_config(tensors)
    write_checkpoint(out, tensors, config_json, files=files, max_shard_bytes=max_shard_bytes)
    return Exported(checkpoint, out, format, plan.fp4_layers, _nbytes(tensors.values()))


def resolve_source(source: Path) -> tuple[Path, Path | None]:
    """``(checkpoint directory, run directory or None)`` for a checkpoint or a run directory."""
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is not a directory (a checkpoint or a run directory)")
    if (source / "config.json").is_file():
        return source, None
    if not (source / checkpoints.FOLDER).is_dir():
        raise ValueError(
            f"{source} is neither a checkpoint directory (no config.json) nor a run directory "
            f"(no {checkpoints.FOLDER}/)"
        )
    # The latest complete checkpoint: one still being written has another name until its
    # rename, and is never read.
    latest = checkpoints.latest_checkpoint(source)
    if latest is None:
        raise ValueError(f"{source / checkpoints.FOLDER} holds no complete checkpoint")
    if not (latest / "model" / "config.json").is_file():
        raise ValueError(f"{latest} is complete but has no model/config.json")
    return latest / "model", source


def run_config(run_dir: Path | None, overrides: Sequence[str]) -> RunConfig:
    """The run's config.toml (or the defaults, without a run) with ``overrides`` applied; the
    export reads its ``[precision]`` and ``model.dtype``."""
    for text in overrides:
        if parse_override(text)[0] not in ("precision", "model"):
            raise ValueError(f"--set {text!r}: export takes precision.KEY=VALUE and model.dtype")
    toml = None
    if run_dir is not None:
        toml = run_dir / "config.toml"
        if not toml.is_file():
            raise FileNotFoundError(f"run directory {run_dir} has no config.toml (its precision)")
    return load(toml, list(overrides))


def cast_state_dict(
    checkpoint: Path, config: ModelConfig, dtypes: Mapping[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters, each cast to ``dtypes[name]`` (default BF16); a value that
    is not finite in its dtype (a NaN, or an FP32 value past BF16's range) is refused, naming
    the tensor."""
    state = load_state_dict(checkpoint, config)
    dtypes = {name: dtypes.get(name, torch.bfloat16) for name in state}
    bad = non_finite(state, dtypes)
    if bad:
        raise ValueError(f"refusing to export {checkpoint}:\n  " + "\n  ".join(bad))
    return {name: t.to(dtypes[name]) for name, t in state.items()}


def nvfp4_tensors(
    state: Mapping[str, torch.Tensor], config: ModelConfig, plan: PrecisionPlan, device: str
) -> dict[str, torch.Tensor]:
    """The hub-named tensors of the NVFP4 export, in model order: the routed experts of the FP4
    layers quantized from ``state`` and packed (the layout in the module docstring), every other
    tensor of ``state`` as it is."""
    packed = {}
    for i in plan.fp4_layers:
        prefix = f"layers.{i}.mlp.experts"
        experts = PackedExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size, i
        )
        w13, w2 = experts.quantized(
            state[prefix + ".w13"].to(device), state[prefix + ".w2"].to(device)
        )
        packed[prefix + ".w13"], packed[prefix + ".w2"] = (
            w.map(torch.Tensor.cpu) for w in (w13, w2)
        )
    table, tensors = hf_to_fp4rl_names(config), {}
    for hf_name, t in fp4rl_to_hf(state, config).items():
        slot = table[hf_name]
        if slot.name not in packed:
            tensors[hf_name] = t
            continue
        q, module = packed[slot.name], hf_name.removesuffix(".weight")
        tensors[module + ".weight_packed"] = q.codes[slot.index]
        tensors[module + ".weight_scale"] = q.block_scale[slot.index]
        tensors[module + ".weight_global_scale"] = format_global_scale(q, slot.expert)
    return tensors


def format_global_scale(q: NVFP4Tensor, expert: int) -> torch.Tensor:
    """The format's ``weight_global_scale [1]`` for one expert of ``q`` (global scales
    ``[E, 1, 1]``): the FP32 reciprocal of fp4rl's ``s``. A group that quantized to zero
    (``s == 0``: zero codes and block scales) gets 1: every value dequantizes it to zero, and
    its reciprocal would be infinite."""
    s = q.global_scale[expert].reshape(1)
    return torch.where(s > 0, 1.0 / s, torch.ones_like(s))


def quantization_config(tensors: Mapping[str, torch.Tensor]) -> dict:
    """config.json's ``quantization_config`` for the hub-named ``tensors`` of an NVFP4 export:
    every Linear is NVFP4 (weights only) but the modules in ``ignore``, which lists the module
    of every BF16 tensor (attention, routers, shared experts, dense MLPs, the routed experts of
    the BF16 layers, embeddings, norms) and lm_head."""
    modules = (name.rpartition(".") for name in tensors)
    ignore = list(dict.fromkeys(m for m, _, leaf in modules if leaf in ("weight", "bias")))
    if "lm_head" not in ignore:  # tied to the embedding: no tensor of its own, still BF16
        ignore.append("lm_head")
    return {
        "quant_method": "compressed-tensors",
        "format": COMPRESSION_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": dict(WEIGHT_SCHEME),
                # fp4rl's rollout scales expert inputs per token; the format's activation scale
                # is one static number per module, so the export declares weights only.
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
