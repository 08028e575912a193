"""The sparse MoE block: an FP32 top-k softmax router with replay, routed experts, shared expert.

Router replay: given the rollout's top-k expert ids per token, the router keeps its own FP32
probabilities but takes the recorded ids, so both sides run the same experts while the gate
weights (and the router's gradient) still come from the trainer's logits. Tokens without a
record (id -1) are routed live and counted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp4rl import ops
from fp4rl.model.layers import MLP, op_to


def eager_route(
    x_TH: torch.Tensor,
    weight_EH: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    replay_Tk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
    """`Router.forward` in torch ops: FP32 logits and softmax, the top k (or the replayed ids,
    whose probabilities are gathered), normalized in FP32 and rounded once to x's dtype."""
    probs_TE = F.softmax(F.linear(x_TH.float(), weight_EH.float()), dim=-1)
    live_w, live_ids = torch.topk(probs_TE, top_k, dim=-1)
    if replay_Tk is None:
        ids, weights, fallback = live_ids, live_w, x_TH.shape[0]
    else:
        if replay_Tk.shape != live_ids.shape:
            raise ValueError(
                f"replayed routing has shape {tuple(replay_Tk.shape)}, expected "
                f"{tuple(live_ids.shape)} (tokens, top_k)"
            )
        missing_T = (replay_Tk < 0).any(-1)
        ids = torch.where(missing_T[:, None], live_ids, replay_Tk.long())
        weights = probs_TE.gather(1, ids)
        fallback = missing_T.sum()
    if norm_topk_prob:  # normalized and rounded in one kernel (`op_to`)
        weights = op_to(torch.div, weights, weights.sum(-1, keepdim=True), x_TH.dtype)
    else:
        weights = weights.to(x_TH.dtype)
    return weights, ids, fallback


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(
        self, x_TH: torch.Tensor, replay_Tk: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
        """Return ``(weights [T, k], ids [T, k] int64, number of tokens routed live)``: the
        weights are FP32 probabilities rounded once to ``x_TH``'s dtype, the experts' dtype.

        ``replay_Tk`` (int, -1 = no record) forces the experts of the tokens it covers; the
        count of the tokens it leaves to live routing is then a 0-dim tensor on the device, so
        counting waits for nothing (its reader makes it a number, once per update).

        Live routing in inference mode (the engine's steps) is, on the GPU, two kernels
        (`ops.route`: the eager arithmetic but for the order of its FP32 sums, which is fixed,
        so a token's routing does not depend on its batch); elsewhere `eager_route`: under
        replay, and in every forward of the trainer, with gradients or without, so that what
        it observes (`fp4rl.train.observe`) is what its update computes.
        """
        if replay_Tk is None and torch.is_inference_mode_enabled():
            routed = ops.route(x_TH, self.weight, self.top_k, self.norm_topk_prob)
            if routed is not None:
                weights, ids = routed
                return weights, ids, x_TH.shape[0]
        return eager_route(x_TH, self.weight, self.top_k, self.norm_topk_prob, replay_Tk)


class SparseMoeBlock(nn.Module):
    def __init__(self, config, experts: nn.Module) -> None:
        super().__init__()
        self.router = Router(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.norm_topk_prob,
        )
        self.experts = experts
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def input_on_the_way(self, guidance, capture) -> str | None:
        """How the caller may make the routed experts' input site on the way
        (`fp4rl.model.experts.RoutedExperts.input_on_the_way`): its values (``x_site_TH``) and
        their record in the form returned, if any (``x_site_record``); None: it may not."""
        return self.experts.input_on_the_way(guidance, capture)

    def input_rows_step(self, x_TH) -> int | None:
        """The K step the routed experts read a caller-made input site's values (``x_site_TH``)
        for tokens like ``x_TH`` permuted in
        (`fp4rl.model.experts.RoutedExperts.input_rows_step`); None: in real order."""
        return self.experts.input_rows_step(x_TH, self.router.top_k)

    def forward(
        self, x_TH, *, x_site_TH=None, x_site_record=None, x_site_permuted_by=None,
        replay_Tk=None, guidance=None, capture=None, stats=None,
    ):  # fmt: skip
        """The routed experts' (and shared expert's) output for ``x_TH``; the router and the
        shared expert read x_TH, the routed experts ``x_site_TH`` where it is given: x_TH
        through their input site, made by the caller with its record ``x_site_record``
        (`input_on_the_way`), its rows permuted in K steps of ``x_site_permuted_by`` where
        given (`input_rows_step`)."""
        weights_Tk, ids_Tk, fallback = self.router(x_TH, replay_Tk)
        if capture is not None:
            capture.record_routing(self.experts.layer, ids_Tk)
        if stats is not None and replay_Tk is not None:
            stats["replay_fallback_tokens"] = stats.get("replay_fallback_tokens", 0) + fallback
        y_TH = self.experts(
            x_TH, ids_Tk, weights_Tk, guidance, capture, x_site_TH=x_site_TH,
            x_site_record=x_site_record, x_site_permuted_by=x_site_permuted_by,
        )  # fmt: skip
        if self.shared_expert is not None:
            y_TH = y_TH + torch.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
        return y_TH
