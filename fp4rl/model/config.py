"""The decoder's shape: ``ModelConfig``, and its mapping to and from a Hugging Face config.json.

Owns what fp4rl reads from config.json (Qwen3-MoE and Qwen2-MoE) and refuses what it does not
implement (RoPE scaling, sliding-window attention, quantized checkpoints) instead of silently
building a different model. Does not own precision (``precision.py``) or tensor names
(``checkpoint.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HF_CLASS = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}

_POSITIVE = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "num_experts", "num_experts_per_tok", "decoder_sparse_step",
)  # fmt: skip
# Sizes read from config.json without a default: guessing one would build a different model.
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_experts_per_tok",
)  # fmt: skip
_FLAGS = ("norm_topk_prob", "qk_norm", "attention_bias", "tie_word_embeddings")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    architecture: str  # "qwen3_moe" | "qwen2_moe" (the HF model_type)
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense-MLP layers
    moe_intermediate_size: int  # one routed expert
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool  # renormalize the top-k router probabilities to sum to 1
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    shared_expert_intermediate_size: int  # 0: no shared expert
    qk_norm: bool  # RMSNorm on q and k per head (qwen3_moe only)
    attention_bias: bool  # bias on q, k, v (never on o)
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        if self.architecture not in HF_CLASS:
            raise ValueError(
                f"unknown architecture {self.architecture!r}; fp4rl supports {', '.join(HF_CLASS)}"
            )
        for key in _POSITIVE:
            value = getattr(self, key)
            if type(value) is not int or value <= 0:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        for key in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, key)
            if type(value) not in (int, float) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{key} must be a positive finite number, got {value!r}")
            object.__setattr__(self, key, float(value))
        for key in _FLAGS:
            if type(getattr(self, key)) is not bool:
                raise ValueError(f"{key} must be a bool, got {getattr(self, key)!r}")
        self._check_layers()
        self._check_architecture()

    def _check_layers(self) -> None:
        n, layers = self.num_hidden_layers, tuple(self.mlp_only_layers)
        in_range = all(type(i) is int and 0 <= i < n for i in layers)
        if not in_range or len(set(layers)) < len(layers):
            raise ValueError(
                f"mlp_only_layers must be distinct layer indices in [0, {n}), got {layers!r}"
            )
        object.__setattr__(self, "mlp_only_layers", layers)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                f"num_experts ({self.num_experts})"
            )
        shared = self.shared_expert_intermediate_size
        if type(shared) is not int or shared < 0:
            raise ValueError(f"shared_expert_intermediate_size must be an int >= 0, got {shared!r}")

    def _check_architecture(self) -> None:
        # These three follow from the architecture in HF; a mismatch would build a model that no
        # HF class can load, so it is a mistake rather than a variant.
        qwen3 = self.architecture == "qwen3_moe"
        if self.qk_norm != qwen3:
            raise ValueError(f"qk_norm={self.qk_norm} does not match {self.architecture}")
        if qwen3 and self.shared_expert_intermediate_size:
            raise ValueError(
                "shared_expert_intermediate_size="
                f"{self.shared_expert_intermediate_size}: qwen3_moe has no shared expert"
            )
        if not qwen3 and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_intermediate_size=0: qwen2_moe always has one")
        if qwen3 and self.attention_bias:
            # HF's Qwen3-MoE puts attention_bias on o_proj as well; fp4rl biases q, k, v only.
            raise ValueError("attention_bias=True is not supported for qwen3_moe (o_proj bias)")

    def is_moe_layer(self, i: int) -> bool:
        """HF's rule: routed experts unless listed dense or off the ``decoder_sparse_step``."""
        if not 0 <= i < self.num_hidden_layers:
            raise ValueError(f"layer {i} out of range [0, {self.num_hidden_layers})")
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelConfig:
        """The config.json of a local checkpoint directory; every refusal names that file."""
        file = Path(path) / "config.json"
        try:
            d = json.loads(file.read_text())  # ValueError also covers bytes that are not UTF-8
        except ValueError as err:
            raise ValueError(f"{file}: not valid JSON: {err}") from err
        if not isinstance(d, dict):
            raise ValueError(f"{file}: holds a JSON {type(d).__name__}, not an object")
        try:
            return cls.from_hf_dict(d)
        except ValueError as err:
            raise ValueError(f"{file}: {err}") from err

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        arch = d.get("model_type")
        if arch not in HF_CLASS:
            raise ValueError(f"unknown architecture {arch!r}; fp4rl supports {', '.join(HF_CLASS)}")
        _reject_unsupported(d)
        qwen3 = arch == "qwen3_moe"
        required = _REQUIRED + (() if qwen3 else ("shared_expert_intermediate_size",))
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"{arch} config.json lacks {', '.join(missing)}")
        return cls(
            architecture=arch,
            **{k: d[k] for k in _REQUIRED},
            head_dim=_head_dim(d),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(d),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            num_experts=_num_experts(d),
            norm_topk_prob=d.get("norm_topk_prob", False),
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=0 if qwen3 else d["shared_expert_intermediate_size"],
            qk_norm=qwen3,
            # Qwen2-MoE always had q/k/v bias; transformers v5 added `qkv_bias` to turn it off.
            attention_bias=d.get("attention_bias", False) if qwen3 else d.get("qkv_bias", True),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
        )

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """config.json in the hub's spelling (``rope_theta``, ``num_experts``): transformers v5
        converts it to its own ``rope_parameters``, while v4 would silently ignore that key."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key in ("architecture", "qk_norm", "attention_bias", "mlp_only_layers"):
            del fields[key]
        qwen3 = self.architecture == "qwen3_moe"
        if qwen3:
            del fields["shared_expert_intermediate_size"]
        bias_key = "attention_bias" if qwen3 else "qkv_bias"
        return {
            "architectures": [HF_CLASS[self.architecture]],
            "model_type": self.architecture,
            **fields,
            bias_key: self.attention_bias,
            "mlp_only_layers": list(self.mlp_only_layers),
            "hidden_act": "silu",
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
            "attention_dropout": 0.0,
            "dtype": dtype,
        }


def _reject_unsupported(d: Mapping[str, Any]) -> None:
    """Raise for config.json features that change the computation and fp4rl does not build."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported; fp4rl uses silu")
    if d.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported; fp4rl has full attention only")
    layer_types = set(d.get("layer_types") or ()) - {"full_attention"}
    if layer_types:
        raise ValueError(f"layer_types {sorted(layer_types)} are not supported")
    if d.get("attention_dropout", 0.0):
        raise ValueError(f"attention_dropout={d['attention_dropout']} is not supported")
    if d.get("quantization_config") is not None:
        raise ValueError("quantized checkpoints (quantization_config) are not supported")


def _rope_theta(d: Mapping[str, Any]) -> float:
    # Hub configs spell plain RoPE as rope_theta + rope_scaling=null; transformers v5 writes
    # rope_parameters={"rope_theta", "rope_type": "default"}. Anything else rescales positions.
    rope = {**(d.get("rope_scaling") or {}), **(d.get("rope_parameters") or {})}
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    if rope_type != "default" or rope:
        scaling = d.get("rope_scaling") or d.get("rope_parameters")
        raise ValueError(f"rope_scaling={scaling!r} is not supported; fp4rl implements plain RoPE")
    return theta


def _num_experts(d: Mapping[str, Any]) -> int:
    # transformers 5.x writes Qwen3-MoE's count as num_local_experts; the hub as num_experts.
    names = [k for k in ("num_experts", "num_local_experts") if k in d]
    if not names:
        raise ValueError(f"{d['model_type']} config.json lacks num_experts")
    if len(names) == 2 and d["num_experts"] != d["num_local_experts"]:
        raise ValueError(
            f"num_experts={d['num_experts']} != num_local_experts={d['num_local_experts']}"
        )
    return d[names[0]]


def _head_dim(d: Mapping[str, Any]) -> int:
    if d.get("head_dim"):
        return d["head_dim"]
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    if type(heads) is not int or heads <= 0 or hidden % heads:
        raise ValueError(
            f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads}) "
            "when config.json gives no head_dim"
        )
    return hidden // heads
