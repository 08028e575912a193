"""The decoder layer's previous formulations, which `test_fewer_kernels.py` holds the current
ones to bitwise: RMSNorm with its cast after the multiply, RoPE tables computed by every layer
and applied with a negation, the router's weights cast after their normalization, the paged
attention's gather and scatter of decode rows, the stable argsort of the MoE dispatch, each
residual add on its own before the norm that reads it. `install` runs the model with them."""

import torch
import torch.nn.functional as F

from fp4rl import ops
from fp4rl.model import experts
from fp4rl.model.attention import Attention, NewKV, attend_fp32
from fp4rl.model.inputs import check_inputs
from fp4rl.model.layers import RMSNorm, RopeTables, rope_cos_sin
from fp4rl.model.moe import SparseMoeBlock
from fp4rl.model.transformer import MoETransformer
from fp4rl.rollout.attention import PagedAttention


def reference_rmsnorm(self, x):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * x32.to(x.dtype)


def reference_apply_rope(x_THD, cos_TD, sin_TD):
    half = x_THD.shape[-1] // 2
    rotated = torch.cat((-x_THD[..., half:], x_THD[..., :half]), dim=-1)
    return x_THD * cos_TD[:, None, :] + rotated * sin_TD[:, None, :]


def reference_attention(self, x_TH, backend, rope, guidance=None, capture=None):
    """Every layer computing its own tables from the positions, RoPE with a negation."""
    T = x_TH.shape[0]
    q = self.q_norm(self.q_proj(x_TH).view(T, self.num_heads, self.head_dim))
    k = self.k_norm(self.k_proj(x_TH).view(T, self.num_kv_heads, self.head_dim))
    v = self.v_proj(x_TH).view(T, self.num_kv_heads, self.head_dim)
    cos, sin = rope_cos_sin(backend.positions, self.head_dim, self.rope_theta, x_TH.dtype)
    kv = NewKV(reference_apply_rope(k, cos, sin), v, self.kv_format, guidance, capture)
    o = backend.attend(self.layer, reference_apply_rope(q, cos, sin), kv)
    return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


def reference_paged_attend(self, layer, q_THD, kv):
    """Decode rows gathered from the queries and scattered into the output, in every step."""
    m = self.meta
    kv.packed()  # the sites' records, where a capture keeps them
    self.cache.write(layer, m.slots_T, kv.k_TKD, kv.v_TKD)
    o_THD = torch.empty_like(q_THD)
    fused = None
    if m.decode_rows_B.numel():
        fused = ops.paged_decode_attention(
            q_THD[m.decode_rows_B],
            *self.cache.pages(layer),
            m.decode_table_BN,
            m.decode_context_B.to(torch.int32),
        )
    if fused is not None:
        o_THD[m.decode_rows_B] = fused
    elif m.decode_rows_B.numel():
        k_BCKD, v_BCKD = self.cache.read(layer, m.decode_slots_BC, q_THD.dtype)
        o = attend_fp32(
            q_THD[m.decode_rows_B][:, None],
            k_BCKD,
            v_BCKD,
            m.positions_T[m.decode_rows_B][:, None],
            m.decode_context_B.long(),
        )
        o_THD[m.decode_rows_B] = o[:, 0].to(q_THD.dtype)
    for row, num, slots_C in m.prefills:
        k_CKD, v_CKD = self.cache.read(layer, slots_C, q_THD.dtype)
        o = attend_fp32(
            q_THD[None, row : row + num],
            k_CKD[None],
            v_CKD[None],
            m.positions_T[None, row : row + num],
            torch.tensor([slots_C.numel()], device=q_THD.device),
        )
        o_THD[row : row + num] = o[0].to(q_THD.dtype)
    return o_THD


def reference_router(self, x_TH, replay_Tk=None):
    """FP32 weights, normalized in FP32; the block casts them for the experts."""
    probs_TE = torch.softmax(torch.nn.functional.linear(x_TH.float(), self.weight.float()), -1)
    live_w, live_ids = torch.topk(probs_TE, self.top_k, dim=-1)
    if replay_Tk is None:
        ids, weights, fallback = live_ids, live_w, x_TH.shape[0]
    else:
        missing_T = (replay_Tk < 0).any(-1)
        ids = torch.where(missing_T[:, None], live_ids, replay_Tk.long())
        weights = probs_TE.gather(1, ids)
        fallback = missing_T.sum()
    if self.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids, fallback


def reference_sort_by_expert(topk_ids_Tk, num_experts):
    return torch.argsort(topk_ids_Tk.flatten(), stable=True)


def reference_moe_block(self, x_TH, *, replay_Tk=None, guidance=None, capture=None, stats=None):
    weights_Tk, ids_Tk, fallback = reference_router(self.router, x_TH, replay_Tk)
    if capture is not None:
        capture.record_routing(self.experts.layer, ids_Tk.to(torch.int32))
    if stats is not None and replay_Tk is not None:
        stats["replay_fallback_tokens"] = stats.get("replay_fallback_tokens", 0) + fallback
    y_TH = self.experts(x_TH, ids_Tk, weights_Tk.to(x_TH.dtype), guidance, capture)
    if self.shared_expert is not None:
        y_TH = y_TH + torch.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
    return y_TH


def reference_experts_forward(
    self, x_TH, topk_ids_Tk, topk_weights_Tk, guidance=None, capture=None
):
    """The gather before the first GEMM, SwiGLU as two ops and the intermediate site after it,
    the inverse permutation by a scatter; the combine as today (on the GPU its kernel sums in
    its own order, which `tests/kernels/test_kernel_moe_combine.py` bounds)."""
    T, k = topk_ids_Tk.shape
    w13, w2 = self.weights()
    x_TH = self.input_site(x_TH, guidance, capture)
    order_A = experts.sort_by_expert(topk_ids_Tk, self.num_experts)
    counts_E = experts.expert_counts(topk_ids_Tk, self.num_experts)
    gate_up_A2I = experts.grouped_mm(x_TH[order_A // k], w13, counts_E)
    h_AI = F.silu(gate_up_A2I[:, : self.intermediate]) * gate_up_A2I[:, self.intermediate :]
    row_order_Tk = (
        torch.empty_like(order_A)
        .scatter_(0, order_A, torch.arange(T * k, device=order_A.device))
        .view(T, k)
    )
    h_AI = self.hidden_site(h_AI, row_order_Tk, guidance, capture)
    y_AH = experts.grouped_mm(h_AI, w2, counts_E)
    return experts.combine(y_AH, row_order_Tk, topk_weights_Tk)


def reference_decoder_layer(self, x_TH, backend, *, rope, replay_Tk, guidance, capture, stats):
    """Each residual add on its own, before the norm that reads it."""
    x_TH = x_TH + self.self_attn(self.input_layernorm(x_TH), backend, rope, guidance, capture)
    h_TH = self.post_attention_layernorm(x_TH)
    if isinstance(self.mlp, SparseMoeBlock):
        h_TH = self.mlp(h_TH, replay_Tk=replay_Tk, guidance=guidance, capture=capture, stats=stats)
    else:
        h_TH = self.mlp(h_TH)
    return x_TH + h_TH


def reference_hidden_states(
    self, tokens_T, attn, *, routing=None, guidance=None, capture=None, stats=None
):
    """The layers in a loop, each adding its MLP output to the residual stream itself."""
    check_inputs(self, tokens_T, attn, routing, guidance)
    replay = dict(zip(self.moe_layers, routing, strict=True)) if routing is not None else {}
    x_TH = self.embed_tokens(tokens_T)
    c = self.config
    rope = RopeTables(attn.positions, c.head_dim, c.rope_theta, x_TH.dtype)
    for layer in self.layers:
        x_TH = reference_decoder_layer(
            layer,
            x_TH,
            attn,
            rope=rope,
            replay_Tk=replay.get(layer.layer),
            guidance=guidance,
            capture=capture,
            stats=stats,
        )
    return self.norm(x_TH)


def install(monkeypatch) -> None:
    """Run the model with the previous formulations (until ``monkeypatch`` undoes it)."""
    monkeypatch.setattr(MoETransformer, "hidden_states", reference_hidden_states)
    monkeypatch.setattr(RMSNorm, "forward", reference_rmsnorm)
    monkeypatch.setattr(Attention, "forward", reference_attention)
    monkeypatch.setattr(PagedAttention, "attend", reference_paged_attend)
    monkeypatch.setattr(SparseMoeBlock, "forward", reference_moe_block)
    monkeypatch.setattr(experts, "sort_by_expert", reference_sort_by_expert)
    monkeypatch.setattr(experts.RoutedExperts, "forward", reference_experts_forward)
