"""Triton kernels that reproduce `fp4rl.fp4.reference` and `fp4rl.fp4.rounding` bit for bit.

`fp4rl.ops` sends CUDA tensors here; the signatures mirror the reference. Each kernel file
holds one `@triton.jit` kernel and its checked `launch`, which also takes a `TileConfig` from
`launch.CONFIGS` for benchmarking variants. With TRITON_INTERPRET=1 set before this package is
imported, the same kernels run on CPU tensors (slowly): that is how CI checks them.
"""

from __future__ import annotations

import torch

from fp4rl.fp4.reference import Scaling
from fp4rl.fp4.rounding import CompactCodes
from fp4rl.fp4.tensor import NVFP4Rows, NVFP4Tensor
from fp4rl.kernels import (
    dequant,
    expert_sort,
    guided,
    mantissa_bits,
    moe_combine,
    moe_gemm,
    nearest,
    norm_quant,
    norm_rope,
    paged_attention,
    paged_prefill,
    rms_norm,
    rope,
    router,
    skinny_gemm,
    swiglu,
    token_draw,
    value_sort,
)

__all__ = [
    "add_rms_norm_quantize_rows",
    "add_rms_norm_rows",
    "combine_rows",
    "compact",
    "dequantize",
    "draw_in_token_order",
    "fake_quantize",
    "grouped_mm",
    "grouped_mm_on_warpgroup_mma",
    "norm_rope_rows",
    "paged_decode_attention",
    "paged_prefill_attention",
    "project_rows",
    "quantize",
    "quantize_into",
    "quantize_into_pair",
    "round_guided_compact",
    "rms_norm_rows",
    "rope_rows",
    "route_rows",
    "round_guided_full",
    "sort_expert_ids",
    "sort_values_by_counting",
    "swiglu_rows",
    "swiglu_site_rows",
    "token_at_rank",
    "walk_exponentials",
]


def quantize(
    x: torch.Tensor, *, scaling: Scaling = "tensor", global_scale: torch.Tensor | None = None
) -> NVFP4Tensor:
    """`reference.quantize`: round-to-nearest NVFP4."""
    return nearest.launch(x, scaling=scaling, global_scale=global_scale, fake=False)


def quantize_into(x_TKD: torch.Tensor, pages: NVFP4Rows, slots_T: torch.Tensor) -> None:
    """`reference.quantize_into`: per-row quantization stored straight into paged rows."""
    nearest.launch_into(x_TKD, pages, slots_T)


def quantize_into_pair(
    k_TKD: torch.Tensor,
    k_pages: NVFP4Rows,
    v_TKD: torch.Tensor,
    v_pages: NVFP4Rows,
    slots_T: torch.Tensor,
    record: str | None = None,
) -> tuple[NVFP4Tensor | CompactCodes | None, NVFP4Tensor | CompactCodes | None]:
    """`quantize_into` of K and of V at the same slots, in one launch; with ``record``, their
    site records from it too."""
    return nearest.launch_into_pair(k_TKD, k_pages, v_TKD, v_pages, slots_T, record)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`reference.dequantize`."""
    return dequant.launch(t, dtype)


def round_guided_full(x: torch.Tensor, rollout: NVFP4Tensor) -> NVFP4Tensor:
    """`rounding.round_guided_full`: the rollout's scales, rounding toward its codes."""
    return guided.launch(x, rollout, fake=False)


def compact(t: NVFP4Tensor) -> CompactCodes:
    """`rounding.compact`: the mantissa bits of the codes in one launch, with t's scales."""
    return mantissa_bits.launch(t)


def round_guided_compact(x: torch.Tensor, guidance: CompactCodes) -> NVFP4Tensor:
    """`rounding.round_guided_compact`: the rollout's scales, picking by its mantissa bits."""
    return guided.launch(x, guidance, fake=False)


def fake_quantize(
    x: torch.Tensor,
    *,
    scaling: Scaling = "row",
    global_scale: torch.Tensor | None = None,
    guidance: NVFP4Tensor | CompactCodes | None = None,
) -> torch.Tensor:
    """``reference.dequantize(q, x.dtype)`` in one pass over x, where q is the nearest
    quantization of x or, given ``guidance``, its guided one (which, as in `fp4rl.ops`,
    uses the rollout's scales and ignores ``scaling`` and ``global_scale``)."""
    if guidance is None:
        return nearest.launch(x, scaling=scaling, global_scale=global_scale, fake=True)
    return guided.launch(x, guidance, fake=True)


def grouped_mm(
    x_AK: torch.Tensor,
    w: NVFP4Tensor,
    counts_E: torch.Tensor,
    order_A: torch.Tensor | None = None,
    top_k: int = 1,
    x_permuted_by: int | None = None,
) -> torch.Tensor:
    """`moe_gemm.reference_gemm`: expert-grouped rows (or tokens gathered by ``order_A //
    top_k`` as they are read) times packed NVFP4 weights, decoded in registers; x's rows stored
    permuted in K steps of ``x_permuted_by`` where given (`grouped_mm_rows_step`)."""
    return moe_gemm.launch(
        x_AK, w, counts_E, order_A=order_A, top_k=top_k, x_permuted_by=x_permuted_by
    )


def grouped_mm_rows_step(x_AK: torch.Tensor, w: NVFP4Tensor, rows: int) -> int | None:
    """The K step `grouped_mm` of ``rows`` rows like ``x_AK``'s times ``w`` reads them
    permuted in, or None (`moe_gemm.rows_step`: a trial switch, off by default)."""
    E, N, K = w.shape
    return moe_gemm.rows_step(x_AK.device, rows, E, N, K)


def grouped_mm_on_warpgroup_mma(x_AK: torch.Tensor, w: NVFP4Tensor) -> bool:
    """Whether `grouped_mm` runs on Hopper's warpgroup MMA for rows like ``x_AK``."""
    return moe_gemm.on_warpgroup_mma(x_AK.device, w.shape[1], w.shape[2])


def combine_rows(
    y_AH: torch.Tensor, row_order_Tk: torch.Tensor, weights_Tk: torch.Tensor
) -> torch.Tensor:
    """`fp4rl.model.experts.eager_combine` up to its FP32 sum's order: one program per token and
    chunk of H."""
    return moe_combine.launch(y_AH, row_order_Tk, weights_Tk)


def paged_decode_attention(q_BHD, k, v, block_table_BN, context_B) -> torch.Tensor:
    """`paged_attention.reference_decode`: one query token per sequence over its KV pages
    (BF16 tensors or NVFP4 decoded in registers)."""
    return paged_attention.launch(q_BHD, k, v, block_table_BN, context_B)


def paged_prefill_attention(q_THD, k, v, prefill, out_THD) -> torch.Tensor:
    """`paged_prefill.reference_prefill`: each prefill segment's queries over their cached
    context (BF16 pages, or NVFP4 decoded in registers), written into ``out_THD``'s rows."""
    return paged_prefill.launch(q_THD, k, v, prefill, out_THD)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`fp4rl.model.layers.eager_rms_norm` up to its FP32 sum's order: one program per row."""
    return rms_norm.launch(x, weight, eps)


def add_rms_norm_rows(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm_rows(x + delta, weight, eps))``, bit for bit, in one launch."""
    return rms_norm.launch_add(x, delta, weight, eps)


def add_rms_norm_quantize_rows(
    x: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    record=None,
    permuted_by: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, NVFP4Tensor | CompactCodes | None]:
    """``(s, h, fake_quantize(h, scaling="row"), record)`` for ``(s, h) = add_rms_norm_rows(x,
    delta, weight, eps)`` and, in form ``record`` if given, the site's record of h, bit for bit,
    in one launch; the site's values stored in `launch.permuted_rows`' order for K steps of
    ``permuted_by`` where given."""
    return norm_quant.launch(x, delta, weight, eps, record, permuted_by)


def norm_rope_rows(
    x_THD: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_TD: torch.Tensor,
    signed_sin_TD: torch.Tensor,
) -> torch.Tensor:
    """`rope_rows` of `rms_norm_rows` (the per-head q/k norm), bit for bit, in one launch."""
    return norm_rope.launch(x_THD, weight, eps, cos_TD, signed_sin_TD)


def rope_rows(
    x_THD: torch.Tensor, cos_TD: torch.Tensor, signed_sin_TD: torch.Tensor
) -> torch.Tensor:
    """`fp4rl.model.layers.apply_rope`, bit for bit, in one launch."""
    return rope.launch(x_THD, cos_TD, signed_sin_TD)


def route_rows(
    x_TH: torch.Tensor, weight_EH: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp4rl.model.moe.Router`'s live routing up to its FP32 sums' order: the logits in one
    launch, softmax and top-k in another (`router.reference_route` is the kernels' twin)."""
    return router.launch(x_TH, weight_EH, top_k, norm_topk_prob)


def sort_expert_ids(
    ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.argsort(ids.flatten(), stable=True)`` for expert ids in ``[0, num_experts)``, its
    inverse permutation and the assignments per expert: a counting sort in one launch
    (`expert_sort.launch`)."""
    return expert_sort.launch(ids, num_experts)


def project_rows(x_MK: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[x_MK @ w.T for w in weights]``, FP32 sums rounded once, one to three weights of one
    input in one launch, batch-invariant (`skinny_gemm.launch`)."""
    return skinny_gemm.launch(x_MK, weights)


def swiglu_rows(
    gate_up: torch.Tensor, *, quantize: bool = False, permuted_by: int | None = None
) -> torch.Tensor:
    """`fp4rl.model.experts.eager_swiglu` bit for bit in one launch; with ``quantize`` the
    intermediate site's fake quantization of it in the same pass; with ``permuted_by``, stored
    in `launch.permuted_rows`' order for K steps of that width."""
    return swiglu.launch(gate_up, quantize=quantize, permuted_by=permuted_by)


def swiglu_site_rows(
    gate_up: torch.Tensor,
    record: str,
    row_order: torch.Tensor | None,
    permuted_by: int | None = None,
) -> tuple[torch.Tensor, NVFP4Tensor | CompactCodes]:
    """``swiglu_rows(gate_up, quantize=True, permuted_by=permuted_by)`` and the intermediate
    site's record in form ``record``, its rows ordered by ``row_order``
    (`swiglu.launch_recording`), in one launch."""
    return swiglu.launch_recording(gate_up, record, row_order, permuted_by)


def draw_in_token_order(
    logprobs_BV: torch.Tensor, u_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp4rl.rollout.sampler._draw_in_token_order` up to its float64 sums' order: ``(token [B]
    int64, logprob [B] float32)`` for float32 log-probabilities ``[B, V]`` and float64 numbers
    ``u [B]``, in two launches that read nothing back (`token_draw.launch`)."""
    return token_draw.launch(logprobs_BV, u_B)


def sort_values_by_counting(rows_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(rows_BV, descending=True)[0].float()`` bit for bit for 16-bit rows, by
    counting each row's bit patterns, and the counts' cumulative sums that `token_at_rank`
    takes (`value_sort.sort_values`)."""
    return value_sort.sort_values(rows_BV)


def token_at_rank(
    rows_BV: torch.Tensor, ends_BN: torch.Tensor, rank_B: torch.Tensor
) -> torch.Tensor:
    """The id the stable descending sort of each 16-bit row puts at its rank, from
    `sort_values_by_counting`'s counts (`value_sort.token_at_rank`)."""
    return value_sort.token_at_rank(rows_BV, ends_BN, rank_B)


def walk_exponentials(x_BV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x_BV.double().exp()`` of float32 rows and each row's count of entries above -inf, in
    one launch, torch's bits on the GPU (`value_sort.walk_exponentials`)."""
    return value_sort.walk_exponentials(x_BV)
