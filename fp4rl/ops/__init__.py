"""The NVFP4 operations the rest of fp4rl calls: one entry point per op, two implementations.

This package sits above both of them: CUDA tensors go to the Triton kernels in `fp4rl.kernels`;
everything else runs the plain-PyTorch specification in `fp4rl.fp4.reference` /
`fp4rl.fp4.rounding`. Neither implementation imports this package. The two are bitwise identical
(tests/kernels), so the choice changes speed only, never a single bit of the result. If Triton
is missing on a CUDA machine the call raises instead of silently running the slow path. Sparse
guidance (`SparseCodes`) is the one exception: no kernel reads its layout yet, so its rounding
runs the PyTorch reference on every device.

Here: the recipe's ops (quantize, dequantize, compact, guided rounding, fake quantization, one
site's quantization), `quantize_into`, which stores a per-row quantization straight into a paged
cache's rows, each row's amax in place of its global scale (`NVFP4Rows`; `quantize_into_pair`: a
layer's K and V in one launch, with their site records from it where asked), the expert GEMM
(`grouped_mm`) and the paged attention. The model's glue, each piece returning None where its
kernel does not run, is in `fp4rl.ops.glue` and named here too (``ops.swiglu``, ...).
`early_dependents` sets when the kernels launched inside it let the next kernel start
(`fp4rl.kernels.dependent_launch`); it moves no bit.
"""

from __future__ import annotations

import contextlib

import torch

from fp4rl.fp4 import reference, rounding, sparse_guidance
from fp4rl.fp4.reference import Scaling
from fp4rl.fp4.rounding import CompactCodes
from fp4rl.fp4.sparse_guidance import SparseCodes
from fp4rl.fp4.tensor import NVFP4Rows, NVFP4Tensor

# Full codes, compact mantissa bits, sparse near-boundary bits, or None: nearest.
Guidance = NVFP4Tensor | CompactCodes | SparseCodes | None
# A site's record as a kernel that quantizes the site on the way makes it.
SiteRecord = NVFP4Tensor | CompactCodes


def _kernels(x: torch.Tensor):
    if not x.is_cuda:
        return None
    try:
        from fp4rl import kernels
    except ImportError as err:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "CUDA tensors need the Triton kernels; install fp4rl with the 'kernels' extra"
        ) from err
    return kernels


@contextlib.contextmanager
def early_dependents(device: torch.device, on: bool = True):
    """Kernels launched on ``device`` inside this block let the kernel after them start as soon
    as all of their programs run (`fp4rl.kernels.dependent_launch.early_dependents`), or, with
    ``on`` false, only as they exit, even inside an enclosing block that has them early; off a
    CUDA device nothing changes."""
    if torch.device(device).type != "cuda":
        yield
        return
    from fp4rl.kernels import dependent_launch

    with dependent_launch.early_dependents(on):
        yield


def quantize(
    x: torch.Tensor, *, scaling: Scaling = "tensor", global_scale: torch.Tensor | None = None
) -> NVFP4Tensor:
    """Round-to-nearest NVFP4 quantization; see `fp4rl.fp4.reference` for the recipe."""
    impl = _kernels(x) or reference
    return impl.quantize(x, scaling=scaling, global_scale=global_scale)


def quantize_into(x_TKD: torch.Tensor, pages: NVFP4Rows, slots_T: torch.Tensor) -> None:
    """``quantize(x_TKD, scaling="row")`` (``[T, heads, K]``, a global scale per row) stored as
    rows ``slots_T`` of ``pages`` (a paged cache's `NVFP4Rows` ``[N, P, heads, K]``, slot ``n *
    P + p``: each row's amax in place of its global scale); on the GPU one kernel, with no
    quantized copy in between."""
    impl = _kernels(x_TKD) or reference
    impl.quantize_into(x_TKD, pages, slots_T)


def quantize_into_pair(
    k_TKD: torch.Tensor,
    k_pages: NVFP4Rows,
    v_TKD: torch.Tensor,
    v_pages: NVFP4Rows,
    slots_T: torch.Tensor,
    record: str | None = None,
) -> tuple[SiteRecord | None, SiteRecord | None]:
    """`quantize_into` of ``k_TKD`` into ``k_pages`` and of ``v_TKD`` (k's shape and dtype) into
    ``v_pages`` at the same ``slots_T``: a layer's new K and V rows, on the GPU in one launch
    with the two calls' bits. With ``record`` ("full" or "compact") also K's and V's site
    records, ``quantize(x, scaling="row")`` as it is or `compact`ed (on the GPU from the same
    launch); ``(None, None)`` without."""
    impl = _kernels(k_TKD)
    if impl is not None:
        return impl.quantize_into_pair(k_TKD, k_pages, v_TKD, v_pages, slots_T, record)
    if record not in ("full", "compact", None):
        raise ValueError(f"record form must be 'full', 'compact' or None; got {record!r}")
    k_rows = reference.quantize_into(k_TKD, k_pages, slots_T)
    v_rows = reference.quantize_into(v_TKD, v_pages, slots_T)
    if record is None:
        return None, None
    if record == "full":
        return k_rows, v_rows
    return rounding.compact(k_rows), rounding.compact(v_rows)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    impl = _kernels(t.codes) or reference
    return impl.dequantize(t, dtype)


def compact(t: NVFP4Tensor) -> CompactCodes:
    """Compact guidance of ``t`` (`rounding.compact`): its codes' mantissa bits, its scales."""
    impl = _kernels(t.codes) or rounding
    return impl.compact(t)


def quantize_guided(
    x: torch.Tensor, guidance: NVFP4Tensor | CompactCodes | SparseCodes
) -> NVFP4Tensor:
    """Guided rounding with the rollout's scales: full codes, compact mantissa bits, or sparse
    guidance (plain PyTorch on every device: no kernel reads the sparse layout yet)."""
    if isinstance(guidance, SparseCodes):
        return sparse_guidance.round_guided_sparse(x, guidance)
    impl = _kernels(x) or rounding
    if isinstance(guidance, NVFP4Tensor):
        return impl.round_guided_full(x, guidance)
    if isinstance(guidance, CompactCodes):
        return impl.round_guided_compact(x, guidance)
    raise TypeError(
        f"guidance must be NVFP4Tensor, CompactCodes or SparseCodes, got {type(guidance).__name__}"
    )


# Row counts up to which the fused NVFP4 GEMM beats dequantizing every expert then one BF16
# grouped GEMM (one H200, `python benchmarks/moe.py`: 1.6x faster at 8,192 rows, 1.07x (w13)
# and 1.16x (w2) at 24,576, slower at 32,768 -- long prefills; BENCHMARKS.md "Routed-expert
# GEMM: prefill chunks").
FUSED_GEMM_MAX_ROWS = 24576
# The same bound where the fused GEMM runs on Hopper's warpgroup MMA (`moe_gemm_wgmma`): 1.23x
# (w13) and 1.26x (w2) faster than the dequantization at 32,768 rows, 1.04x and 1.01x at 49,152,
# slower at 65,536 (BENCHMARKS.md "Routed-expert GEMM: the warpgroup MMA past 3,072 tokens").
FUSED_GEMM_MAX_ROWS_WGMMA = 49152
# Row counts up to which the same kernel over BF16 weights replaces `torch._grouped_mm` in
# inference: it was faster at every size measured from 1 to 2,048 tokens of top-8 (one H200,
# `python benchmarks/moe.py`, "Routed-expert GEMM" and "Routed-expert GEMM: prefill chunks" in
# BENCHMARKS.md: 2.2x at one token, 1.1x at 8,192 rows, 1.18x (w13) and 1.15x (w2) at 16,384),
# slower at 24,576 (0.88x and 0.83x). Outside inference mode (training) `torch._grouped_mm`
# runs, which has a backward.
BF16_KERNEL_MAX_ROWS = 16384


def grouped_mm(
    x_AK: torch.Tensor,
    w_ENK: torch.Tensor | NVFP4Tensor,
    counts_E: torch.Tensor,
    *,
    order_A: torch.Tensor | None = None,
    top_k: int = 1,
    x_permuted_by: int | None = None,
) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts_E[e]`` rows each) times each expert's ``w.T``.

    With ``order_A`` (the MoE dispatch's assignments sorted by expert) x holds tokens and row a
    is ``x[order_A[a] // top_k]``: the fused kernel reads those rows where they lie, the other
    paths gather them first.

    ``x_permuted_by``: x's rows are stored permuted in K steps of that width, the step
    `expert_rows_step` gave for this call (a ValueError where the call cannot read them).

    ``w`` is a tensor, or packed NVFP4 weights: on the GPU in BF16 those are decoded in
    registers by one fused kernel (only experts with rows are read), elsewhere dequantized to
    ``x``'s dtype first. Either way the weight values are bitwise ``dequantize(w, x.dtype)``;
    only the FP32 accumulation order differs. BF16 weights go through the same kernel on the
    GPU in inference mode (the engine's steps; at most BF16_KERNEL_MAX_ROWS rows), else
    `torch._grouped_mm`, so a trainer's forwards, with or without gradients, sum alike. On the
    GPU the group offsets stay on the device (no host sync); the CPU path is a loop of plain
    matmuls.
    """
    rows = x_AK.shape[0] if order_A is None else order_A.shape[0]
    if x_permuted_by is not None:  # the fused kernel alone reads them (and checks the step)
        kernels = _fused_nvfp4_kernels(x_AK, w_ENK, rows)
        if kernels is None:
            raise ValueError(
                f"x_permuted_by={x_permuted_by}: only the fused NVFP4 kernel reads permuted "
                f"rows, and this grouped_mm of {rows} rows does not run it"
            )
        return kernels.grouped_mm(x_AK.contiguous(), w_ENK, counts_E, order_A, top_k, x_permuted_by)
    if _bf16_kernel_runs(x_AK, w_ENK, rows):
        return _kernels(x_AK).grouped_mm(x_AK.contiguous(), w_ENK, counts_E, order_A, top_k)
    if isinstance(w_ENK, NVFP4Tensor):
        kernels = _fused_nvfp4_kernels(x_AK, w_ENK, rows)
        if kernels is not None:
            return kernels.grouped_mm(x_AK.contiguous(), w_ENK, counts_E, order_A, top_k)
        w_ENK = dequantize(w_ENK, x_AK.dtype)
    if order_A is not None:
        x_AK = x_AK[order_A // top_k]
    if x_AK.is_cuda and x_AK.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offsets = counts_E.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x_AK, w_ENK.transpose(-2, -1), offs=offsets)
    rows = x_AK.split(counts_E.tolist())
    outs = [x.matmul(w.t()) for x, w in zip(rows, w_ENK, strict=True) if x.numel()]
    return torch.cat(outs) if outs else x_AK.new_zeros(0, w_ENK.shape[1])


def expert_rows_step(x_AK: torch.Tensor, w_ENK: torch.Tensor | NVFP4Tensor, rows: int):
    """The K step in which `grouped_mm` of ``rows`` rows like ``x_AK`` times ``w_ENK`` would
    read x's rows stored permuted (`fp4rl.kernels.launch.permuted_rows`), for their producer
    to write them so; None where it reads them in real order: anything but the fused NVFP4
    kernel on the GPU, and there unless its trial switch is on
    (`fp4rl.kernels.moe_gemm.PERMUTED_ROWS`)."""
    kernels = _kernels(x_AK)
    if kernels is None or not kernels.moe_gemm.PERMUTED_ROWS:  # nothing more to ask (hot path)
        return None
    kernels = _fused_nvfp4_kernels(x_AK, w_ENK, rows)
    return None if kernels is None else kernels.grouped_mm_rows_step(x_AK, w_ENK, rows)


def _fused_nvfp4_kernels(x_AK: torch.Tensor, w_ENK, rows: int):
    """`fp4rl.kernels` where `grouped_mm` sends packed NVFP4 weights to the fused kernel (BF16
    rows on the GPU, at most `FUSED_GEMM_MAX_ROWS` of them, or `FUSED_GEMM_MAX_ROWS_WGMMA` on
    the warpgroup MMA), else None."""
    kernels = _kernels(x_AK)
    if kernels is None or not isinstance(w_ENK, NVFP4Tensor) or x_AK.dtype != torch.bfloat16:
        return None
    wgmma = kernels.grouped_mm_on_warpgroup_mma(x_AK, w_ENK)
    return (
        kernels if rows <= (FUSED_GEMM_MAX_ROWS_WGMMA if wgmma else FUSED_GEMM_MAX_ROWS) else None
    )


def _bf16_kernel_runs(x_AK: torch.Tensor, w_ENK, rows: int) -> bool:
    """Whether `grouped_mm` sends BF16 weights to the fused kernel (see its docstring)."""
    if isinstance(w_ENK, NVFP4Tensor) or not x_AK.is_cuda or rows > BF16_KERNEL_MAX_ROWS:
        return False
    bf16 = x_AK.dtype == w_ENK.dtype == torch.bfloat16
    shaped = w_ENK.dim() == 3 and w_ENK.is_contiguous()
    return bf16 and shaped and torch.is_inference_mode_enabled()


def paged_decode_kernel_runs(q: torch.Tensor, nvfp4_pages: bool) -> bool:
    """Whether `paged_decode_attention` runs the kernel for queries like ``q`` (``[B, Hq, D]``
    or any tensor of the queries' dtype, device and head dim) over BF16 or NVFP4 pages, rather
    than returning None: on the GPU with Triton, except BF16 queries over NVFP4 pages of head
    dim below 32, which the kernel refuses (`paged_attention.bf16_nvfp4_supported`, a
    miscompile on sm_90); those few tiny models take the gather path."""
    kernels = _kernels(q)
    if kernels is None:
        return False
    if nvfp4_pages and q.dtype == torch.bfloat16:
        from fp4rl.kernels import attention_tiles

        shortest = min(
            *(tile.block_n for _, tile in attention_tiles.CONFIGS["nvfp4"]),
            *attention_tiles.SMALL_TILES["nvfp4"],
        )
        return kernels.paged_attention.bf16_nvfp4_supported(q.shape[-1], shortest)
    return True


def paged_decode_attention(
    q_BHD: torch.Tensor,
    k: torch.Tensor | NVFP4Rows,
    v: torch.Tensor | NVFP4Rows,
    block_table_BN: torch.Tensor,
    context_B: torch.Tensor,
) -> torch.Tensor | None:
    """Decode attention of one query token per sequence over its pages (``[num_blocks, P, K,
    D]`` tensors or NVFP4Rows, read where they lie), on the GPU; None where the kernel does
    not run (`paged_decode_kernel_runs`), where the caller gathers and runs the plain-PyTorch
    attention (`fp4rl.rollout.attention`), the spec the kernel is tested against."""
    if not paged_decode_kernel_runs(q_BHD, isinstance(k, NVFP4Rows)):
        return None
    return _kernels(q_BHD).paged_decode_attention(q_BHD, k, v, block_table_BN, context_B)


def paged_prefill_plan(q_THD: torch.Tensor, segments, block_tables, group: int):
    """The prefill kernel's plan of a step's prefill segments (``(first row, start, num)`` each,
    with their block tables; `fp4rl.kernels.paged_prefill.plan`), built once per step for
    queries like ``q_THD``; None off the GPU, where no kernel runs."""
    kernels = _kernels(q_THD)
    if kernels is None:
        return None
    return kernels.paged_prefill.plan(segments, block_tables, group, q_THD.device)


def paged_prefill_plan_over(
    segments_S3: torch.Tensor, table_SN: torch.Tensor, tiles_P2: torch.Tensor, group: int
):
    """`paged_prefill_plan`'s plan over int32 device tensors the caller fills step after step
    (a CUDA graph's inputs; `fp4rl.kernels.paged_prefill.plan_over`: a tile of a segment of no
    tokens does nothing); None off the GPU."""
    kernels = _kernels(segments_S3)
    if kernels is None:
        return None
    return kernels.paged_prefill.plan_over(segments_S3, table_SN, tiles_P2, group)


def paged_prefill_block_q(group: int) -> int:
    """Query tokens per tile of the prefill kernel's plans, for ``group`` query heads per KV
    head (the tiles `paged_prefill_plan_over`'s caller lists)."""
    from fp4rl.kernels import paged_prefill

    return paged_prefill.TILE.block_q(group)


def paged_prefill_attention(
    q_THD: torch.Tensor,
    k: torch.Tensor | NVFP4Rows,
    v: torch.Tensor | NVFP4Rows,
    prefill,
    out_THD: torch.Tensor,
) -> torch.Tensor | None:
    """Prefill attention of a step's prefill segments (a `paged_prefill_plan`) over their pages,
    read where they lie, written into ``out_THD``'s rows, on the GPU; None where the kernel
    does not run (no plan, or BF16 queries over NVFP4 pages of head dim below 32: the
    miscompile `paged_decode_kernel_runs` names), where the caller runs ``attend_fp32`` over
    the gathered context, the kernel's spec."""
    if prefill is None:
        return None
    kernels = _kernels(q_THD)
    supported = kernels.paged_attention.bf16_nvfp4_supported(q_THD.shape[-1], prefill.tile.block_n)
    if isinstance(k, NVFP4Rows) and q_THD.dtype == torch.bfloat16 and not supported:
        return None
    return kernels.paged_prefill_attention(q_THD, k, v, prefill, out_THD)


def quantize_site(
    x: torch.Tensor, *, scaling: Scaling = "row", guidance: Guidance = None
) -> NVFP4Tensor:
    """Quantize one FP4 site: nearest rounding, or guided when the rollout's record is given."""
    if guidance is None:
        return quantize(x, scaling=scaling)
    return quantize_guided(x, guidance)


class _FakeQuantize(torch.autograd.Function):
    """Forward: dequantize(quantize(x)) in x's dtype. Backward: straight through."""

    @staticmethod
    def forward(ctx, x, scaling, global_scale, guidance):
        kernels = _kernels(x)
        if kernels is not None and not isinstance(guidance, SparseCodes):
            # One fused pass; codes and scales never reach memory.
            return kernels.fake_quantize(
                x, scaling=scaling, global_scale=global_scale, guidance=guidance
            )
        if guidance is not None:
            t = quantize_guided(x, guidance)
        else:
            t = quantize(x, scaling=scaling, global_scale=global_scale)
        return dequantize(t, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def fake_quantize(
    x: torch.Tensor,
    *,
    scaling: Scaling = "row",
    global_scale: torch.Tensor | None = None,
    guidance: Guidance = None,
) -> torch.Tensor:
    """Quantize-dequantize ``x`` (nearest, or guided by the rollout), gradient passed through."""
    return _FakeQuantize.apply(x, scaling, global_scale, guidance)


# The model's glue, under the names its callers use (``ops.swiglu``); imported last, since it
# finds the kernels through this package (`_kernels`).
from fp4rl.ops.glue import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_quantize,
    apply_rope,
    draw_in_token_order,
    moe_combine,
    norm_rope,
    project,
    rms_norm,
    route,
    sort_by_expert,
    sort_values,
    swiglu,
    swiglu_site,
    token_at_rank,
    walk_exponentials,
)

__all__ = [
    "FUSED_GEMM_MAX_ROWS",
    "FUSED_GEMM_MAX_ROWS_WGMMA",
    "BF16_KERNEL_MAX_ROWS",
    "Guidance",
    "SiteRecord",
    "add_rms_norm",
    "add_rms_norm_quantize",
    "apply_rope",
    "compact",
    "dequantize",
    "draw_in_token_order",
    "early_dependents",
    "fake_quantize",
    "grouped_mm",
    "moe_combine",
    "norm_rope",
    "paged_decode_attention",
    "paged_decode_kernel_runs",
    "paged_prefill_attention",
    "paged_prefill_block_q",
    "paged_prefill_plan",
    "paged_prefill_plan_over",
    "project",
    "quantize",
    "quantize_guided",
    "quantize_into",
    "quantize_into_pair",
    "quantize_site",
    "rms_norm",
    "route",
    "sort_by_expert",
    "sort_values",
    "swiglu",
    "swiglu_site",
    "token_at_rank",
    "walk_exponentials",
]
