"""The model's glue with a kernel on the GPU: each op returns None where its kernel does not run
(off the GPU, or for shapes and dtypes it does not take), and the caller then runs its eager
formulation. Callers name them through `fp4rl.ops` (``ops.swiglu``), which finds the kernels.

`apply_rope`, `sort_by_expert` (with the inverse permutation and the counts per expert) and
`swiglu` (with, optionally, the intermediate site's fake quantization; `swiglu_site` also its
record), bitwise the eager results; `rms_norm` and `moe_combine`, the eager arithmetic but for
the order of one FP32 sum per output; `route` (the router's live routing: FP32 logits, softmax,
top-k, in two launches), the eager arithmetic but for the order of its FP32 sums, so that
near-tied experts may be picked the other way (docs/numerics.md, "What is bitwise");
`norm_rope` composes the RMSNorm and RoPE kernels in one launch, with their bits; `add_rms_norm`
so composes the residual add and the RMSNorm kernel after it, and `add_rms_norm_quantize` those
two and the routed experts' input site (`fake_quantize` of the norm, per row, with the site's
record where asked). Those that make a site's values on the way (`add_rms_norm_quantize`,
`swiglu_site`, and `fp4rl.ops.quantize_into_pair`) store its record (full or compact) from the
same launch: a captured site then costs no launch more. `project` multiplies a decode step's
few rows by up to three weights of one input (q, k and v) in one launch, batch-invariant (None
where the kernel does not run: the caller uses cuBLAS). The sampler's token-order draw
(`draw_in_token_order`) is one more, with float64 sums in an order of its own, and its sorted
draw's values and token (`sort_values`, `token_at_rank`) by counting, bitwise the sort's.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fp4rl.ops import SiteRecord


def _kernels(x: torch.Tensor):
    """`fp4rl.ops._kernels`, looked up at each call (tests send CPU tensors to the kernels by
    replacing it there)."""
    return sys.modules["fp4rl.ops"]._kernels(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of the rows of ``x`` in one kernel on the GPU (`fp4rl.kernels.rms_norm`: a fixed
    FP32 summation order, the same bits whatever the batch), for x and weight of one float
    dtype; None elsewhere, where the caller runs the eager formulation."""
    kernels = _kernels(x)
    if kernels is None or weight.dtype != x.dtype or x.dtype not in kernels.rms_norm.DTYPES:
        return None
    return kernels.rms_norm_rows(x.contiguous(), weight.contiguous(), eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(s, rms_norm(s, weight, eps))`` with ``s = x + delta``: the residual add and the
    RMSNorm after it in one kernel on the GPU (`fp4rl.kernels.rms_norm.launch_add`: s rounded
    as torch's add rounds it, and the RMSNorm kernel's bits of that s), for x, delta and
    weight of one float dtype and delta of x's shape; None elsewhere, where the caller adds,
    then runs `rms_norm`."""
    kernels = _kernels(x)
    if (
        kernels is None
        or x.dtype not in kernels.rms_norm.DTYPES
        or delta.dtype != x.dtype
        or weight.dtype != x.dtype
        or delta.shape != x.shape
    ):
        return None
    return kernels.add_rms_norm_rows(x.contiguous(), delta.contiguous(), weight.contiguous(), eps)


def add_rms_norm_quantize(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    record=None,
    permuted_by: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SiteRecord | None] | None:
    """``(s, h, h_q, h_record)``: `add_rms_norm`'s ``(s, h)``, ``h_q = fake_quantize(h,
    scaling="row")`` (round to nearest, one global scale per row; no gradient) and, with
    ``record`` "full" or "compact", the site's record of h (``quantize(h, scaling="row")``, as
    it is or `compact`ed; None without), bit for bit, in one kernel on the GPU
    (`fp4rl.kernels.norm_quant`), for x, delta and weight of one float dtype, delta of x's
    shape and rows of up to 8192 values, a multiple of 16 (`norm_quant.supported`); None
    elsewhere, where the caller runs `add_rms_norm`, then the site. ``permuted_by``: h_q's rows
    stored permuted for the expert GEMM (`fp4rl.ops.expert_rows_step`)."""
    kernels = _kernels(x)
    if kernels is None or not kernels.norm_quant.supported(x, delta, weight):
        return None
    return kernels.add_rms_norm_quantize_rows(
        x.contiguous(), delta.contiguous(), weight.contiguous(), eps, record, permuted_by
    )


def apply_rope(
    x_THD: torch.Tensor, cos_TD: torch.Tensor, signed_sin_TD: torch.Tensor
) -> torch.Tensor | None:
    """Rotary embedding of ``[T, H, D]`` rows in one kernel on the GPU (`fp4rl.kernels.rope`,
    bitwise the eager formulation), for tables of x's dtype and a power-of-two D; None
    elsewhere, where the caller runs the eager formulation."""
    kernels = _kernels(x_THD)
    if (
        kernels is None
        or x_THD.dim() != 3
        or not kernels.rope.supported(x_THD)
        or cos_TD.dtype != x_THD.dtype
        or signed_sin_TD.dtype != x_THD.dtype
    ):
        return None
    return kernels.rope_rows(x_THD.contiguous(), cos_TD.contiguous(), signed_sin_TD.contiguous())


def norm_rope(
    x_THD: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_TD: torch.Tensor,
    signed_sin_TD: torch.Tensor,
) -> torch.Tensor | None:
    """`apply_rope` of `rms_norm` over each ``[T, H, D]`` row (Qwen3's per-head q/k norm, then
    the rotation) in one kernel on the GPU (`fp4rl.kernels.norm_rope`: the two kernels' bits),
    for x, weight and tables of one dtype and a power-of-two D; None elsewhere, where the
    caller runs the two."""
    kernels = _kernels(x_THD)
    if (
        kernels is None
        or not kernels.norm_rope.supported(x_THD, weight)
        or cos_TD.dtype != x_THD.dtype
        or signed_sin_TD.dtype != x_THD.dtype
    ):
        return None
    return kernels.norm_rope_rows(
        x_THD.contiguous(),
        weight.contiguous(),
        eps,
        cos_TD.contiguous(),
        signed_sin_TD.contiguous(),
    )


def sort_by_expert(
    ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(order, inverse, counts)``: ``order = torch.argsort(ids.flatten(), stable=True)``
    (int64) for int32 or int64 expert ids in ``[0, num_experts)``, its inverse permutation
    (``inverse[order] = arange``) and the assignments per expert (int64 ``[num_experts]``), as
    one counting-sort kernel on the GPU
    (`fp4rl.kernels.expert_sort`) for sorts of decode size (shapes only decide); None
    elsewhere, where the caller sorts with torch (`fp4rl.model.experts.dispatch_order`)."""
    kernels = _kernels(ids)
    if (
        kernels is None
        or ids.dtype not in kernels.expert_sort.ID_DTYPES
        or not kernels.expert_sort.supported(ids.numel(), num_experts)
    ):
        return None
    return kernels.sort_expert_ids(ids.contiguous(), num_experts)


def swiglu(
    gate_up_A2I: torch.Tensor, *, quantize: bool = False, permuted_by: int | None = None
) -> torch.Tensor | None:
    """The experts' ``silu(gate) * up`` of rows ``[gate | up]`` in one kernel on the GPU
    (`fp4rl.kernels.swiglu`, bitwise `fp4rl.model.experts.eager_swiglu`); with ``quantize``, the
    intermediate site's round-to-nearest values of it too (``fake_quantize(h, scaling="row")``).
    None elsewhere or for shapes the kernel does not take; the caller then runs the eager ops.
    ``permuted_by``: the rows stored permuted for the expert GEMM (`fp4rl.ops.expert_rows_step`)."""
    kernels = _kernels(gate_up_A2I)
    if kernels is None or not kernels.swiglu.supported(gate_up_A2I):
        return None
    return kernels.swiglu_rows(gate_up_A2I.contiguous(), quantize=quantize, permuted_by=permuted_by)


def swiglu_site(
    gate_up_A2I: torch.Tensor,
    record: str,
    row_order: torch.Tensor | None = None,
    permuted_by: int | None = None,
) -> tuple[torch.Tensor, SiteRecord] | None:
    """``(h_q, record)``: `swiglu` with ``quantize`` and the intermediate site's record of h in
    form ``record`` ("full" or "compact"), its rows in the order ``row_order`` names (record row
    ``c`` from h's row ``row_order[c]``; the record shaped like ``row_order``, else like h's
    rows), bit for bit what quantizing h, then picking its rows gives, in one kernel on the GPU
    (`fp4rl.kernels.swiglu`). None where `swiglu` is. ``permuted_by`` as `swiglu`'s (the
    record's rows stay in real order)."""
    kernels = _kernels(gate_up_A2I)
    if kernels is None or not kernels.swiglu.supported(gate_up_A2I):
        return None
    order = None if row_order is None else row_order.contiguous()
    return kernels.swiglu_site_rows(gate_up_A2I.contiguous(), record, order, permuted_by)


def draw_in_token_order(
    logprobs_BV: torch.Tensor, u_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sampler's token-order draw, ``(token [B], logprob [B])``, in one fused kernel on the
    GPU (`fp4rl.kernels.token_draw`: its own order of the float64 sums); None elsewhere."""
    kernels = _kernels(logprobs_BV)
    if kernels is None:
        return None
    return kernels.draw_in_token_order(logprobs_BV.contiguous(), u_B.contiguous())


def sort_values(rows_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sampler's sorted values, ``torch.sort(rows_BV, descending=True)[0].float()`` bit for
    bit, for rows of 16-bit floats on the GPU, with the counts `token_at_rank` maps a rank back
    by (`fp4rl.kernels.value_sort`: a count of each row's bit patterns, no sort); None
    elsewhere, where the caller sorts."""
    kernels = _kernels(rows_BV)
    if kernels is None or rows_BV.dtype not in kernels.value_sort.DTYPES:
        return None
    return kernels.sort_values_by_counting(rows_BV.contiguous())


def walk_exponentials(x_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x_BV.double().exp(), (x_BV > -inf).sum(-1))`` of float32 rows on the GPU in one
    pass, the same bits and counts (`fp4rl.kernels.value_sort.walk_exponentials`); None
    elsewhere."""
    kernels = _kernels(x_BV)
    if kernels is None or x_BV.dtype != torch.float32:
        return None
    return kernels.walk_exponentials(x_BV.contiguous())


def token_at_rank(
    rows_BV: torch.Tensor, ends_BN: torch.Tensor, rank_B: torch.Tensor
) -> torch.Tensor:
    """int64 ``[B]``: the id the stable descending sort of each row of ``rows_BV`` puts at
    ``rank_B``, from `sort_values`' counts ``ends_BN`` (so only where it ran)."""
    return _kernels(rows_BV).token_at_rank(rows_BV.contiguous(), ends_BN, rank_B.contiguous())


def moe_combine(
    y_AH: torch.Tensor, row_order_Tk: torch.Tensor, weights_Tk: torch.Tensor
) -> torch.Tensor | None:
    """The MoE combine ``out[t] = sum_j y[row_order[t, j]] * weights[t, j]`` (``[T, H]`` in y's
    dtype) in one kernel on the GPU (`fp4rl.kernels.moe_combine`: the eager arithmetic, the k
    products summed in a fixed FP32 order, the same bits whatever the batch), for shapes and
    dtypes it takes (`moe_combine.supported`); None elsewhere, where the caller runs the eager
    formulation (`fp4rl.model.experts.eager_combine`)."""
    kernels = _kernels(y_AH)
    if kernels is None or not kernels.moe_combine.supported(y_AH, row_order_Tk, weights_Tk):
        return None
    return kernels.combine_rows(
        y_AH.contiguous(), row_order_Tk.contiguous(), weights_Tk.contiguous()
    )


def route(
    x_TH: torch.Tensor, weight_EH: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(weights [T, k] in x's dtype, ids [T, k] int64)``: the router's softmax over FP32
    logits, its top k and (with ``norm_topk_prob``) their normalization, in two kernels on the
    GPU (`fp4rl.kernels.router`: FP32 sums in a fixed order, the same bits whatever the batch;
    ties to the lowest expert id; NaN rows get NaN weights and ids in range), for shapes and
    dtypes it takes (`router.supported`) and up to `router.MAX_ROWS` rows (decode steps); None
    elsewhere, where the caller runs the eager formulation (`fp4rl.model.moe.Router`)."""
    kernels = _kernels(x_TH)
    if (
        kernels is None
        or x_TH.shape[0] > kernels.router.MAX_ROWS
        or not kernels.router.supported(x_TH, weight_EH, top_k)
    ):
        return None
    return kernels.route_rows(x_TH.contiguous(), weight_EH.contiguous(), top_k, norm_topk_prob)


def project(x_MK: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """``[x_MK @ w.T for w in weights]`` for a decode step's few rows and one to three weights
    of one input, in one kernel launch on the GPU (`fp4rl.kernels.skinny_gemm`: FP32 sums
    rounded once, in an order fixed by K, so a row's bits do not depend on the batch; not
    bitwise cuBLAS), for BF16 or FP16 x and weights of its dtype (`skinny_gemm.supported`) and
    the rows where it is the faster (`skinny_gemm.preferred`: up to 64 for several weights, 16
    for one); None elsewhere, where the caller runs ``F.linear`` per weight."""
    kernels = _kernels(x_MK)
    if kernels is None or not kernels.skinny_gemm.preferred(x_MK.shape[0], len(weights)):
        return None
    x_MK, weights = x_MK.contiguous(), [w.contiguous() for w in weights]
    if not kernels.skinny_gemm.supported(x_MK, weights):
        return None
    return kernels.project_rows(x_MK, weights)
