"""The one MoE transformer (Qwen3-MoE, and Qwen2-MoE with its shared expert).

`build_model` reads the precision plan once and picks each layer's expert class; ``forward``
never looks at precision. Routing records, guidance, captures and the attention backend (which
owns the KV) are arguments of the forward.

Legend: T tokens (sequences flattened), H hidden, V vocab, L decoder layers, k experts per token.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fp4rl.model.attention import Attention, AttentionBackend
from fp4rl.model.experts import Experts, PackedExperts, QatExperts, QatWeightExperts
from fp4rl.model.inputs import check_inputs
from fp4rl.model.layers import MLP, RMSNorm, RopeTables
from fp4rl.model.moe import SparseMoeBlock
from fp4rl.model.precision import LayerPlan, PrecisionConfig, PrecisionPlan, resolve_plan
from fp4rl.model.sites import Capture
from fp4rl.records import GuidanceMap

EXPERT_CLASSES = {"qat": QatExperts, "qat_weights": QatWeightExperts, "packed": PackedExperts}


class DecoderLayer(nn.Module):
    def __init__(self, config, p: LayerPlan, guided_sites: tuple[str, ...], mlp: nn.Module):
        super().__init__()
        self.layer = p.index
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, p.index, kv_format=p.kv_cache, guided_sites=guided_sites)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x_TH, pending_TH, backend, *, rope, replay_Tk, guidance, capture, stats):
        """``(x_TH, pending_TH)`` in, the same out: the residual stream is ``x_TH + pending_TH``
        (``x_TH`` where pending_TH is None), its last add left to the norm that reads it next
        (`RMSNorm.sum_and_norm`: on the GPU the add and the norm in one launch). Returns the
        stream after attention and the MLP's output, pending.

        Where the routed experts' input site rounds to nearest, the post-attention norm's
        kernel also makes the site's values and, where the capture keeps it, its record
        (`RMSNorm.sum_norm_and_quantize`), which the experts then take as they are."""
        if pending_TH is None:
            h_TH = self.input_layernorm(x_TH)
        else:
            x_TH, h_TH = self.input_layernorm.sum_and_norm(x_TH, pending_TH)
        attn_TH = self.self_attn(h_TH, backend, rope, guidance, capture)
        norm = self.post_attention_layernorm
        if not isinstance(self.mlp, SparseMoeBlock):
            x_TH, h_TH = norm.sum_and_norm(x_TH, attn_TH)
            return x_TH, self.mlp(h_TH)
        # The experts' input site's values of h_TH (and record), where the norm made them, their
        # rows stored as the experts' GEMM reads them.
        site_TH = record = step = None
        form = self.mlp.input_on_the_way(guidance, capture)
        if form is not None:
            step = self.mlp.input_rows_step(attn_TH)
            x_TH, h_TH, site_TH, record = norm.sum_norm_and_quantize(
                x_TH, attn_TH, form or None, step
            )
        else:
            x_TH, h_TH = norm.sum_and_norm(x_TH, attn_TH)
        h_TH = self.mlp(
            h_TH,
            x_site_TH=site_TH,
            x_site_record=record,
            x_site_permuted_by=None if site_TH is None else step,
            replay_Tk=replay_Tk,
            guidance=guidance,
            capture=capture,
            stats=stats,
        )
        return x_TH, h_TH


class MoETransformer(nn.Module):
    def __init__(self, config, plan: PrecisionPlan, fp4_experts: str = "qat") -> None:
        """``fp4_experts``: how FP4 layers hold their experts: "qat" (the trainer, W4A4 fake
        quantization), "packed" (the rollout), or "qat_weights" (a W4A16 trainer: weights fake-
        quantized, expert activations and K/V left in BF16 -- the asymmetric baseline)."""
        super().__init__()
        if fp4_experts not in EXPERT_CLASSES:
            raise ValueError(
                f"fp4_experts must be one of {tuple(EXPERT_CLASSES)}, got {fp4_experts!r}"
            )
        activations = fp4_experts != "qat_weights"
        # The (layer, site) pairs whose rounding follows guidance: none without FP4 activations.
        self.guided_keys = plan.guided_keys() if activations else frozenset()
        self.config, self.plan = config, plan
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                p if activations else dataclasses.replace(p, kv_cache="bf16"),
                plan.guided_sites,
                self._mlp(config, plan, p, fp4_experts),
            )
            for p in plan.layers
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.moe_layers = tuple(p.index for p in plan.layers if p.moe)

    @staticmethod
    def _mlp(config, plan, p, fp4_experts):
        if not p.moe:
            return MLP(config.hidden_size, config.intermediate_size)
        args = (config.num_experts, config.hidden_size, config.moe_intermediate_size, p.index)
        if not p.fp4:
            return SparseMoeBlock(config, Experts(*args))
        experts = EXPERT_CLASSES[fp4_experts](*args, guided_sites=plan.guided_sites)
        return SparseMoeBlock(config, experts)

    def hidden_states(
        self,
        tokens_T: torch.Tensor,
        attn: AttentionBackend,
        *,
        routing: torch.Tensor | None = None,
        guidance: GuidanceMap | None = None,
        capture: Capture | None = None,
        stats: dict | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, H]``.

        ``routing``: replayed top-k ids, int ``[num_moe_layers, T, k]`` (-1 = no record), in
        the order of ``self.moe_layers``. ``guidance``: the rollout's records of every guided
        site of the plan (`PrecisionPlan.guided_keys`), rows aligned with ``tokens_T``.
        ``stats`` (optional dict) receives counters such as ``replay_fallback_tokens``.
        Shapes and keys are checked here (no device sync); the values of token and routing ids
        are the caller's to check (`check_ids`), once per batch rather than once per step.
        """
        check_inputs(self, tokens_T, attn, routing, guidance)
        replay = dict(zip(self.moe_layers, routing, strict=True)) if routing is not None else {}
        x_TH = self.embed_tokens(tokens_T)
        # One set of RoPE tables for every layer: they depend on the positions alone.
        c = self.config
        rope = RopeTables(attn.positions, c.head_dim, c.rope_theta, x_TH.dtype)
        pending_TH = None  # each layer's MLP output, added by the next norm
        for layer in self.layers:
            x_TH, pending_TH = layer(
                x_TH,
                pending_TH,
                attn,
                rope=rope,
                replay_Tk=replay.get(layer.layer),
                guidance=guidance,
                capture=capture,
                stats=stats,
            )
        if pending_TH is None:
            return self.norm(x_TH)
        return self.norm.sum_and_norm(x_TH, pending_TH)[1]

    def logits(self, h_NH: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Logits ``[N, V]`` of the given rows in ``dtype``; None keeps the lm_head's own (BF16
        in a BF16 model: what the rollout engine samples from, `fp4rl.rollout.sampler`)."""
        logits_NV = self.lm_head(h_NH)
        return logits_NV if dtype is None else logits_NV.to(dtype)

    def forward(self, tokens_T, attn, **kwargs) -> torch.Tensor:
        return self.logits(self.hidden_states(tokens_T, attn, **kwargs))


def build_model(
    config,
    precision: PrecisionConfig | None = None,
    *,
    fp4_experts: str = "qat",
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> MoETransformer:
    """Construct the model, parameters uninitialized (load a checkpoint or `init_weights`)."""
    plan = resolve_plan(config, precision or PrecisionConfig())
    # Built in ``dtype`` directly: building in FP32 and casting would need twice the memory of
    # the model at its peak (a 48-layer Qwen3-30B-A3B shape: 122 GB before the cast).
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MoETransformer(config, plan, fp4_experts)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype)


@torch.no_grad()
def init_weights(model: MoETransformer, *, std: float = 0.02, seed: int = 0) -> None:
    """Random init (tests, benchmarks): normal(0, std) matrices, unit norms, zero biases."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * std)
