"""A run's configuration: one frozen section per component, loaded from TOML, overridden by
``section.key=value`` strings.

Each section is the component's own config class (`PrecisionConfig`, `EngineConfig`,
`GrpoConfig`, `OptimConfig`, the task's: ``[task] kind`` picks one of `fp4rl.tasks.CONFIGS`,
``"arith"`` when absent) or one defined here, and validates itself; this module only maps TOML
tables onto them. An unknown section or key is an error naming it and
the keys allowed; a bad value is the section's own error, which names the key and the value.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

from fp4rl import checks
from fp4rl.model.precision import PrecisionConfig
from fp4rl.rollout.config import CdfOrder, EngineConfig
from fp4rl.tasks import CONFIGS as TASK_CONFIGS
from fp4rl.tasks import JsonlConfig, TaskConfig, TaskSettings
from fp4rl.train.grpo import GrpoConfig
from fp4rl.train.optim import OptimConfig
from fp4rl.train.step import GradientSync

Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["float32", "bfloat16"]


def _text(name: str, value) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSection:
    path: str = ""  # a local Hugging Face checkpoint directory (Qwen3-MoE / Qwen2-MoE)
    dtype: Dtype = "bfloat16"  # of the trainer's parameters and the engine's BF16 modules
    device: Device = "auto"  # "auto": CUDA when present, else the CPU

    def __post_init__(self) -> None:
        _text("model.path", self.path)
        checks.choice("model.dtype", self.dtype, get_args(Dtype))
        checks.choice("model.device", self.device, get_args(Device))


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutSection:
    """How each step's samples are drawn. No top-k / top-p: the trainer scores the tokens under
    ``softmax(logits / temperature)`` and could not reproduce a truncated distribution.
    ``cdf_order`` is `SamplingParams.cdf_order`: "token" draws from the same distribution
    without sorting the vocabulary each step, other tokens for the same seed."""

    prompts_per_step: int = 32
    samples_per_prompt: int = 8  # the GRPO group size, n
    temperature: float = 1.0
    max_tokens: int = 16
    cdf_order: CdfOrder = "probability"

    def __post_init__(self) -> None:
        for key, low in (("prompts_per_step", 1), ("samples_per_prompt", 2), ("max_tokens", 1)):
            checks.integer(f"rollout.{key}", getattr(self, key), low)
        checks.number("rollout.temperature", self.temperature, "> 0", lambda t: t > 0)
        checks.choice("rollout.cdf_order", self.cdf_order, get_args(CdfOrder))


Rounding = Literal["guided", "nearest"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AlignSection:
    """How the trainer aligns with the rollout, and how often the mismatch is measured. What
    the engine records (``engine.capture_routing``, ``engine.guidance``) is what the trainer
    can use, and by default (None) it uses it; setting these chooses otherwise (the variants
    of a study: e.g. the engine records full codes to measure agreement, the trainer rounds to
    nearest)."""

    replay: bool | None = None  # run the rollout's experts; None: iff the engine records them
    rounding: Rounding | None = None  # None: "guided" iff the engine records guidance
    # "bf16": the asymmetric baseline, a W4A16 trainer (weights fake-quantized, expert
    # activations and K/V in BF16) against the W4A4 rollout.
    trainer_activations: Literal["nvfp4", "bf16"] = "nvfp4"
    # The trainer's attention: "packed", one causal attention per whole sequence in the model
    # dtype; "packed_fp32", the same in FP32 with one rounding of the output (the rollout's
    # precision); "engine", the rollout engine's arithmetic row by row (each prompt alone, each
    # completion token one query over its context; CPU only: `EngineOrderAttention`).
    trainer_forward: Literal["packed", "packed_fp32", "engine"] = "packed"
    observe_every: int = 10  # mismatch metrics every this many steps; 0: never

    def __post_init__(self) -> None:
        checks.choice("align.trainer_activations", self.trainer_activations, ("nvfp4", "bf16"))
        checks.choice(
            "align.trainer_forward", self.trainer_forward, ("packed", "packed_fp32", "engine")
        )
        if self.replay is not None:
            checks.boolean("align.replay", self.replay)
        if self.rounding is not None:
            checks.choice("align.rounding", self.rounding, get_args(Rounding))
        checks.integer("align.observe_every", self.observe_every, 0)

    def resolve(self, engine: EngineConfig) -> tuple[bool, bool]:
        """``(replay, guided)`` for the trainer."""
        replay = engine.capture_routing if self.replay is None else self.replay
        rounding = self.rounding or ("guided" if engine.guidance is not None else "nearest")
        return replay, rounding == "guided"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSection:
    steps: int = 100  # GRPO steps (rollout, reward, update, refit)
    seed: int = 0
    out_dir: str = "runs/fp4rl"  # the run directory: resolved config, metrics.jsonl, checkpoints
    eval_every: int = 10  # held-out accuracy every this many steps (and before the first)
    eval_samples: int = 4  # samples per held-out problem for the sampled accuracy
    # The engine that evaluates: "rollout", the rollout engine itself; "bf16", a twin engine
    # with every module BF16 (no FP4 experts or KV), refit from the trainer before each
    # evaluation: one evaluator for runs of any rollout precision.
    eval_precision: Literal["rollout", "bf16"] = "rollout"
    micro_batch_seqs: int = 64  # completions per forward/backward; the update is independent
    # Several ranks (torchrun) only, memory against communication (docs/scaling.md). When the
    # sharded trainer reduce-scatters its gradients: "update", once, in the update's last
    # micro-batch, the ones before it summing theirs unsharded in FP32 (4 bytes per parameter
    # of the whole model on every rank: the 48-layer Qwen3-30B-A3B shape cannot); "micro_batch",
    # in every micro-batch, the default: on two H200s at 8 layers "update" trained 4 % faster
    # (BENCHMARKS.md), not worth a default that the full model cannot run.
    gradient_sync: GradientSync = "micro_batch"
    # Several ranks only: keep each layer's BF16 parameters gathered from the update's first
    # forward to its last backward (one all-gather per update instead of two per micro-batch;
    # 2 bytes per parameter of the whole model on every rank).
    keep_gathered: bool = False
    # Keep the rollout engine's KV pages while the trainer runs, their memory held through the
    # update (docs/scaling.md): no unmap and map of the pages around each update. The engine's
    # CUDA graphs outlive a release anyway (`engine.keep_graphs`); with that off, this is what
    # spares every rollout capturing its graphs again (about 2 s at 48 layers on one H200).
    keep_kv: bool = False
    threads: int = 0  # CPU threads for torch; 0: leave torch's default
    tensorboard: bool = False  # also every numeric metric as scalars in <out_dir>/tensorboard
    checkpoint_every: int = 0  # a checkpoint every this many steps; 0: only after the last step
    keep_checkpoints: int = 2  # the newest this many are kept, older ones deleted

    def __post_init__(self) -> None:
        checks.boolean("run.tensorboard", self.tensorboard)
        checks.choice("run.eval_precision", self.eval_precision, ("rollout", "bf16"))
        checks.choice("run.gradient_sync", self.gradient_sync, get_args(GradientSync))
        checks.boolean("run.keep_gathered", self.keep_gathered)
        checks.boolean("run.keep_kv", self.keep_kv)
        for key, low in (
            ("steps", 1),
            ("seed", 0),
            ("eval_every", 1),
            ("eval_samples", 1),
            ("micro_batch_seqs", 1),
            ("threads", 0),
            ("checkpoint_every", 0),
            ("keep_checkpoints", 1),
        ):
            checks.integer(f"run.{key}", getattr(self, key), low)
        _text("run.out_dir", self.out_dir)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    task: TaskSettings = field(default_factory=TaskConfig)
    align: AlignSection = field(default_factory=AlignSection)
    run: RunSection = field(default_factory=RunSection)

    def __post_init__(self) -> None:
        replay, guided = self.align.resolve(self.engine)
        if replay and not self.engine.capture_routing:
            raise ValueError(
                "align.replay=true needs the rollout's routing record: set "
                "engine.capture_routing=true, or align.replay=false to route live"
            )
        if guided and self.engine.guidance is None:
            raise ValueError(
                "align.rounding='guided' needs the rollout's codes: set engine.guidance to "
                "'full', 'compact' or 'sparse', or align.rounding='nearest'"
            )
        if guided and self.align.trainer_activations == "bf16":
            raise ValueError(
                "align.trainer_activations='bf16' has no FP4 activations to guide: set "
                "align.rounding='nearest'"
            )
        if self.align.trainer_forward == "engine" and self.engine.chunked_prefill:
            # The engine-order attention reproduces each prompt prefilled whole, alone.
            raise ValueError(
                "align.trainer_forward='engine' follows prompts prefilled whole: set "
                "engine.chunked_prefill=false (a prompt then waits for a step it fits in)"
            )
        if isinstance(self.task, JsonlConfig) and (
            self.task.max_prompt_tokens >= self.engine.max_model_len
        ):
            raise ValueError(
                f"task.max_prompt_tokens={self.task.max_prompt_tokens} leaves no room to generate "
                f"within engine.max_model_len={self.engine.max_model_len}"
            )
        if self.grpo.mini_batches > self.rollout.prompts_per_step:
            raise ValueError(
                f"grpo.mini_batches={self.grpo.mini_batches} is more than the step's "
                f"rollout.prompts_per_step={self.rollout.prompts_per_step}: a mini-batch takes "
                "whole prompts' samples"
            )
        if guided and not replay:
            # The expert intermediate's records belong to the rollout's experts; the trainer's
            # own experts would follow codes of other rows.
            raise ValueError(
                "align.rounding='guided' needs router replay (align.replay and "
                "engine.capture_routing true)"
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The resolved config as TOML-ready tables (None values left out, as TOML has none)."""
        out = {}
        for f in fields(self):
            section = dataclasses.asdict(getattr(self, f.name))
            out[f.name] = {
                k: list(v) if isinstance(v, tuple) else v
                for k, v in section.items()
                if v is not None
            }
        return out


def _section(cls, name: str, table: Any):
    if not isinstance(table, dict):
        raise ValueError(f"[{name}] must be a table of keys, got {table!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        kind = f" with kind = {known['kind'].default!r}" if "kind" in known else ""
        raise ValueError(
            f"{name}.{unknown[0]} is not a setting; [{name}]{kind} takes {', '.join(sorted(known))}"
        )
    values = {}
    for key, value in table.items():
        # TOML has arrays, the configs tuples.
        if isinstance(value, list) and _wants_tuple(known[key]):
            value = tuple(value)
        # TOML has no null: "none" spells None for the settings whose default is None.
        if value == "none" and known[key].default is None:
            value = None
        values[key] = value
    return cls(**values)


def _task_class(table: Any):
    """The settings class of ``[task]``'s ``kind`` (each kind takes its own keys)."""
    kind = table.get("kind", "arith") if isinstance(table, dict) else "arith"
    checks.choice("task.kind", kind, tuple(TASK_CONFIGS))
    return TASK_CONFIGS[kind]


def _wants_tuple(f) -> bool:
    return "tuple" in str(f.type)  # annotations are strings here (postponed evaluation)


def from_dict(data: dict[str, Any]) -> RunConfig:
    """A `RunConfig` from nested tables (a parsed TOML file); absent sections take defaults."""
    sections = {f.name: f for f in fields(RunConfig)}
    unknown = sorted(set(data) - set(sections))
    if unknown:
        raise ValueError(f"[{unknown[0]}] is not a config section; sections: {', '.join(sections)}")
    built = {}
    for name, f in sections.items():
        table = data.get(name, {})
        cls = _task_class(table) if name == "task" else f.default_factory().__class__
        built[name] = _section(cls, name, table)
    return RunConfig(**built)


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"section.key=value"`` -> (section, key, value); the value is read as a TOML value
    (``3``, ``1e-5``, ``true``, ``"bf16"``, ``[1, 2]``), and as a plain string when it is
    not one, so ``precision.kv_cache=nvfp4`` needs no quotes."""
    target, sep, raw = text.partition("=")
    section, dot, key = target.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ValueError(f"--set takes section.key=value, got {text!r}")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section, key, value


def load(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML file (or start from the defaults) and apply ``section.key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"{path}: not valid TOML: {err}") from None
    for text in overrides:
        section, key, value = parse_override(text)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ValueError(f"--set {text!r}: [{section}] is not a table")
        table[key] = value
    return from_dict(data)


def to_toml(config: RunConfig) -> str:
    """The resolved config as TOML text (the run directory's ``config.toml``)."""
    lines = []
    for name, table in config.to_dict().items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
        lines.append("")
    return "\n".join(lines)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"cannot write {value} to TOML")
    return repr(value)
