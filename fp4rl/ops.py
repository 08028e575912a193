"""The NVFP4 operations the rest of fp4rl calls: one entry point per op, two implementations.

This module sits above both of them: CUDA tensors go to the Triton kernels in `fp4rl.kernels`;
everything else runs the plain-PyTorch specification in `fp4rl.fp4.reference` /
`fp4rl.fp4.rounding`. Neither implementation imports this module. The two are bitwise identical
(tests/kernels), so the choice changes speed only, never a single bit of the result. If Triton
is missing on a CUDA machine the call raises instead of silently running the slow path. Sparse
guidance (`SparseCodes`) is the one exception: no kernel reads its layout yet, so its rounding
runs the PyTorch reference on every device.

Pieces of the model's glue also have a kernel here, each returning None where it does not run
(the caller then runs its eager formulation): `apply_rope`, `sort_by_expert` (with the
inverse permutation and the counts per expert) and `swiglu` (with, optionally, the intermediate
site's fake quantization), bitwise the eager results, `rms_norm` and `moe_combine`, the eager
arithmetic but for the order of one FP32 sum per output, and `route` (the router's live
routing: FP32 logits, softmax, top-k, in two launches), the eager arithmetic but for the order
of its FP32 sums, so that near-tied experts may be picked the other way (docs/numerics.md,
"What is bitwise"); `norm_rope` composes the RMSNorm and RoPE kernels in one launch, with their
bits; `add_rms_norm` so composes the residual add and the RMSNorm kernel after it, and
`add_rms_norm_quantize` those two and the routed experts' input site (`fake_quantize` of the
norm, per row). `quantize_into` stores a per-row quantization straight into a paged cache's
rows, each row's amax in place of its global scale (`NVFP4Rows`; `quantize_into_pair`: a
layer's K and V in one launch). Those that make a site's values on the way
(`add_rms_norm_quantize`, `swiglu_site`, `quantize_into_pair`) can store its record (full or
compact) from the same launch: a captured site then costs no launch more. `project`
multiplies a decode step's few rows by up to three weights of one input (q, k and v) in one
launch, batch-invariant (None where the kernel does not run: the caller uses cuBLAS). The sampler's
token-order draw (`draw_in_token_order`) is one more, with float64 sums in an order of its own.
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
    reference.quantize_into(k_TKD, k_pages, slots_T)
    reference.quantize_into(v_TKD, v_pages, slots_T)
    return tuple(_record_of(x, record) for x in (k_TKD, v_TKD))


def _record_of(x: torch.Tensor, record: str | None) -> SiteRecord | None:
    """A site's record of ``x`` rounded to nearest per row, in form ``record`` (None: none)."""
    if record not in ("full", "compact", None):
        raise ValueError(f"record form must be 'full', 'compact' or None; got {record!r}")
    if record is None:
        return None
    t = reference.quantize(x, scaling="row")
    return t if record == "full" else rounding.compact(t)


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
# grouped GEMM (one H200, `python benchmarks/moe.py`: 1.6x faster at 8,192 rows, slower at
# 32,768 -- long prefills).
FUSED_GEMM_MAX_ROWS = 16384
# Row counts up to which the same kernel over BF16 weights replaces `torch._grouped_mm` in
# inference: it was faster at every size measured, 1 to 1,024 tokens of top-8 (one H200,
# `python benchmarks/moe.py`, "Routed-expert GEMM" in BENCHMARKS.md: 2.2x at one token, 1.1x
# at 8,192 rows); longer prefill chunks were not measured. Outside inference mode (training)
# `torch._grouped_mm` runs, which has a backward.
BF16_KERNEL_MAX_ROWS = 8192


def grouped_mm(
    x_AK: torch.Tensor,
    w_ENK: torch.Tensor | NVFP4Tensor,
    counts_E: torch.Tensor,
    *,
    order_A: torch.Tensor | None = None,
    top_k: int = 1,
) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts_E[e]`` rows each) times each expert's ``w.T``.

    With ``order_A`` (the MoE dispatch's assignments sorted by expert) x holds tokens and row a
    is ``x[order_A[a] // top_k]``: the fused kernel reads those rows where they lie, the other
    paths gather them first.

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
    if _bf16_kernel_runs(x_AK, w_ENK, rows):
        return _kernels(x_AK).grouped_mm(x_AK.contiguous(), w_ENK, counts_E, order_A, top_k)
    if isinstance(w_ENK, NVFP4Tensor):
        fused = x_AK.dtype == torch.bfloat16 and rows <= FUSED_GEMM_MAX_ROWS
        kernels = _kernels(x_AK)
        if kernels is not None and fused:
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
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, record=None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SiteRecord | None] | None:
    """``(s, h, h_q, h_record)``: `add_rms_norm`'s ``(s, h)``, ``h_q = fake_quantize(h,
    scaling="row")`` (round to nearest, one global scale per row; no gradient) and, with
    ``record`` "full" or "compact", the site's record of h (``quantize(h, scaling="row")``, as
    it is or `compact`ed; None without), bit for bit, in one kernel on the GPU
    (`fp4rl.kernels.norm_quant`), for x, delta and weight of one float dtype, delta of x's
    shape and rows of up to 8192 values, a multiple of 16 (`norm_quant.supported`); None
    elsewhere, where the caller runs `add_rms_norm`, then the site."""
    kernels = _kernels(x)
    if kernels is None or not kernels.norm_quant.supported(x, delta, weight):
        return None
    return kernels.add_rms_norm_quantize_rows(
        x.contiguous(), delta.contiguous(), weight.contiguous(), eps, record
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


def swiglu(gate_up_A2I: torch.Tensor, *, quantize: bool = False) -> torch.Tensor | None:
    """The experts' ``silu(gate) * up`` of rows ``[gate | up]`` in one kernel on the GPU
    (`fp4rl.kernels.swiglu`, bitwise `fp4rl.model.experts.eager_swiglu`); with ``quantize``, the
    intermediate site's round-to-nearest values of it too (``fake_quantize(h, scaling="row")``).
    None elsewhere or for shapes the kernel does not take; the caller then runs the eager ops."""
    kernels = _kernels(gate_up_A2I)
    if kernels is None or not kernels.swiglu.supported(gate_up_A2I):
        return None
    return kernels.swiglu_rows(gate_up_A2I.contiguous(), quantize=quantize)


def swiglu_site(
    gate_up_A2I: torch.Tensor, record: str, row_order: torch.Tensor | None = None
) -> tuple[torch.Tensor, SiteRecord] | None:
    """``(h_q, record)``: `swiglu` with ``quantize`` and the intermediate site's record of h in
    form ``record`` ("full" or "compact"), its rows in the order ``row_order`` names (record row
    ``c`` from h's row ``row_order[c]``; the record shaped like ``row_order``, else like h's
    rows), bit for bit what quantizing h, then picking its rows gives, in one kernel on the GPU
    (`fp4rl.kernels.swiglu`). None where `swiglu` is."""
    kernels = _kernels(gate_up_A2I)
    if kernels is None or not kernels.swiglu.supported(gate_up_A2I):
        return None
    order = None if row_order is None else row_order.contiguous()
    return kernels.swiglu_site_rows(gate_up_A2I.contiguous(), record, order)


def draw_in_token_order(
    logprobs_BV: torch.Tensor, u_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sampler's token-order draw, ``(token [B], logprob [B])``, in one fused kernel on the
    GPU (`fp4rl.kernels.token_draw`: its own order of the float64 sums); None elsewhere."""
    kernels = _kernels(logprobs_BV)
    if kernels is None:
        return None
    return kernels.draw_in_token_order(logprobs_BV.contiguous(), u_B.contiguous())


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
