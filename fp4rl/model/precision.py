"""The precision policy: which modules run NVFP4, resolved once into a per-layer plan.

Routed experts are the only FP4 compute (W4A4, per-token activation scaling); attention, the
router (FP32 logits), shared experts, embeddings, norms and lm_head stay BF16, and so does every
module of the first ``bf16_first_layers`` and last ``bf16_last_layers`` decoder layers. The KV
cache is ``bf16`` or ``nvfp4`` (per token-head global scale, K stored after RoPE) in the layers
whose experts are FP4. The plan is data: the model builder reads it to choose module classes,
nothing reads it inside ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

EXPERT_SITES = ("expert_input", "expert_hidden")
KV_SITES = ("k", "v")
SITES = EXPERT_SITES + KV_SITES
Format = Literal["bf16", "nvfp4"]
_FORMATS = KV_FORMATS = get_args(Format)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrecisionConfig:
    """Which modules run NVFP4. The one place the KV format is stated: the rollout engine's
    cache and the trainer's attention both take it from the plan resolved from this."""

    experts: Format = "nvfp4"  # routed-expert weights and activations
    kv_cache: Format = "bf16"  # K/V of the FP4 layers
    bf16_first_layers: int = 2
    bf16_last_layers: int = 4
    # Sites that round toward the rollout's codes when the forward is given guidance for them.
    guided_sites: tuple[str, ...] = SITES

    def __post_init__(self) -> None:
        for key in ("experts", "kv_cache"):
            if getattr(self, key) not in _FORMATS:
                raise ValueError(
                    f"precision.{key} must be one of {_FORMATS}, got {getattr(self, key)!r}"
                )
        for key in ("bf16_first_layers", "bf16_last_layers"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"precision.{key} must be a non-negative int, got {value!r}")
        if not isinstance(self.guided_sites, tuple):
            raise ValueError(f"precision.guided_sites must be a tuple, got {self.guided_sites!r}")
        unknown = [s for s in self.guided_sites if s not in SITES]
        if unknown:
            raise ValueError(f"precision.guided_sites has unknown sites {unknown}; known: {SITES}")


@dataclass(frozen=True, slots=True)
class LayerPlan:
    index: int
    moe: bool  # routed experts present
    experts: Literal["bf16", "nvfp4", "-"]  # "-" for a dense layer
    kv_cache: Format

    @property
    def fp4(self) -> bool:
        return self.experts == "nvfp4"

    def sites(self) -> tuple[str, ...]:
        """This layer's FP4 activation sites."""
        return (EXPERT_SITES if self.fp4 else ()) + (KV_SITES if self.kv_cache == "nvfp4" else ())


@dataclass(frozen=True, slots=True)
class PrecisionPlan:
    layers: tuple[LayerPlan, ...]
    guided_sites: tuple[str, ...]

    @property
    def fp4_layers(self) -> tuple[int, ...]:
        return tuple(p.index for p in self.layers if p.fp4)

    @property
    def kv_formats(self) -> tuple[Format, ...]:
        return tuple(p.kv_cache for p in self.layers)

    def guided_keys(self) -> frozenset[tuple[int, str]]:
        """Every (layer, site) whose rounding follows the rollout when guidance is given: the
        keys a guidance map for this model must hold, and the only ones it may hold."""
        return frozenset(
            (p.index, site) for p in self.layers for site in p.sites() if site in self.guided_sites
        )

    def __str__(self) -> str:
        rows = ["layer  mlp    experts  kv_cache"]
        for p in self.layers:
            rows.append(
                f"{p.index:>5}  {'moe' if p.moe else 'dense':<5}  {p.experts:<7}  {p.kv_cache}"
            )
        return "\n".join(rows)


def resolve_plan(model_config, precision: PrecisionConfig) -> PrecisionPlan:
    """Decide each layer's formats; raise when FP4 is asked of a model that cannot take it."""
    n = model_config.num_hidden_layers
    moe_layers = set(model_config.moe_layers())
    if precision.experts == "nvfp4" and not moe_layers:
        raise ValueError(
            "precision.experts='nvfp4' needs routed experts, but this "
            f"{model_config.architecture} model has none (num_experts={model_config.num_experts})"
        )
    layers = []
    for i in range(n):
        boundary = i < precision.bf16_first_layers or i >= n - precision.bf16_last_layers
        fp4 = precision.experts == "nvfp4" and i in moe_layers and not boundary
        layers.append(
            LayerPlan(
                index=i,
                moe=i in moe_layers,
                experts=("nvfp4" if fp4 else "bf16") if i in moe_layers else "-",
                kv_cache=precision.kv_cache if fp4 else "bf16",
            )
        )
    plan = PrecisionPlan(layers=tuple(layers), guided_sites=precision.guided_sites)
    _check_not_empty(model_config, precision, plan)
    _check_fp4_dims(model_config, plan)
    return plan


def _check_not_empty(model_config, precision: PrecisionConfig, plan: PrecisionPlan) -> None:
    """NVFP4 that was asked for and resolves to no layer at all is a silent no-op; refuse it."""
    asked = [k for k in ("experts", "kv_cache") if getattr(precision, k) == "nvfp4"]
    if not asked or plan.fp4_layers:
        return
    n, moe = model_config.num_hidden_layers, model_config.moe_layers()
    first, last = precision.bf16_first_layers, precision.bf16_last_layers
    if precision.experts == "bf16":
        raise ValueError(
            "precision.kv_cache='nvfp4' applies to the layers whose experts are NVFP4, and "
            "precision.experts='bf16' leaves none; set precision.experts='nvfp4' or "
            "precision.kv_cache='bf16'"
        )
    raise ValueError(
        f"precision.experts='nvfp4' leaves no FP4 layer: of the {n} decoder layers, MoE layers "
        f"{list(moe)} all fall in the BF16 boundary (bf16_first_layers={first}, "
        f"bf16_last_layers={last}); lower precision.bf16_first_layers / "
        "precision.bf16_last_layers, or set precision.experts='bf16' to run without FP4"
    )


def _check_fp4_dims(model_config, plan: PrecisionPlan) -> None:
    """FP4 sites quantize 1x16 blocks along their reduction dimension; a model with no FP4
    layer has no such requirement."""
    dims = {}
    if plan.fp4_layers:
        dims["hidden_size"] = model_config.hidden_size
        dims["moe_intermediate_size"] = model_config.moe_intermediate_size
    if any(p.kv_cache == "nvfp4" for p in plan.layers):
        dims["head_dim"] = model_config.head_dim
    for name, value in dims.items():
        if value % 16:
            layer = plan.fp4_layers[0] if plan.fp4_layers else 0
            raise ValueError(
                f"layers.{layer}: NVFP4 needs {name} to be a multiple of 16, got {value}"
            )
