"""The MoE router's live routing without autograd in two kernels: FP32 logits, then top-k.

`fp4rl.model.moe.Router` computes ``softmax(x.float() @ W.float().T)``, its top-k and, with
``norm_topk_prob``, the k probabilities divided by their sum, rounded once to x's dtype: eagerly
two casts, an FP32 GEMV (two kernels), a softmax, a top-k (two), a sum and a division, about
20 us per layer at batch 1. Here it is two launches:

- `_logits_kernel`: the FP32 logits, as partial sums over slices of H (`SumOrder`), one program
  per tile of rows, experts and slice, so that at batch 1 the read of W spreads over many SMs
  (128 programs at Qwen3-30B-A3B's E = 128, H = 2048);
- `_topk_kernel`: one program per row adds the partials, takes the softmax, picks the top k by
  repeated arg-max and normalizes them.

Numerics (`reference_route` writes them out in PyTorch, and is the kernels' twin):

- Each logit is an FP32 sum of the products ``f32(x[t, h]) * f32(W[e, h])`` in an order fixed
  by H alone (`SumOrder`): lane l of slice s accumulates, by FMA, the columns
  ``s * split + i * lanes + l`` for i = 0, 1, ...; the lanes are added as a pairwise tree
  (lane pairs (2i, 2i + 1), then pairs of those, ...), and the slices' partials left to right.
  The products of BF16 or FP16 values are exact in FP32, so the FMA equals the product then
  the add; FP32 operands get one rounding per term. FMA contraction elsewhere is off. Neither
  the number of rows T nor the tile (rows and experts per program) changes a single bit: a
  row's logits are the same whatever the batch it is in. The eager GEMM's order is cuBLAS's (or
  the CPU's), so logits differ from the eager ones by a few FP32 ulps of ``sum |x_h W_eh|``.
- Softmax in FP32: ``m = max_e l_e``, ``p_e = div_rn(exp(l_e - m), s)`` with libdevice's exp
  (CUDA's accurate expf without FTZ, as torch's softmax) and ``s`` the pairwise-tree sum of the E
  exponentials over the next power of two of E lanes (zeros past E).
- Top-k: k arg-maxes of p in turn, ties to the lowest expert id; ids in ``[0, E)`` and distinct
  always, in descending probability. A NaN or +inf logit, or a row of -inf, makes the whole row
  of p NaN (as eagerly): such rows get the ids 0, 1, ..., k - 1 and NaN weights, never an id
  outside ``[0, E)``, which would send the expert GEMM out of bounds.
- Weights: with ``norm_topk_prob`` ``div_rn(p_j, p_0 + p_1 + ... + p_{k-1})`` (that order),
  else ``p_j``; rounded once to x's dtype. Eagerly the sum's order is torch's.

So the router is not bitwise the eager one: ids differ only where two probabilities lie within
the logit sums' rounding error of each other (a near tie at the k-th place, or two near-equal
experts swapped), weights by a few FP32 ulps before their rounding to x's dtype, rarely one unit
there (tests/kernels/test_kernel_router.py bounds both). The launches depend on shapes only
(nothing is read on the host): they can be captured in a CUDA graph. `benchmarks/router.py`
times them against the eager router. When the kernels run (`fp4rl.ops.route`, from
`Router.forward`) and routing under replay or autograd (the eager ops) are not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4rl.kernels import dependent_launch
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import check_contiguous, check_kernel_device, device_of
from fp4rl.kernels.numerics import exp_rn, nan_like, round_to

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
MAX_EXPERTS = 1024  # a row of probabilities is held in registers by one program
# Rows `fp4rl.ops.route` sends here: the logits are FMAs on the CUDA cores, whose time grows with
# T, where the eager router's cuBLAS GEMM does not; on one H200 the two were 51.6 against 57.9 us
# at 1,024 rows (`benchmarks/router.py`), so longer prefill chunks keep the eager router.
MAX_ROWS = 1024
MAX_TOP_K = 16


# ---- the order of the FP32 logit sum ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SumOrder:
    """How a logit's H products are added: ``lanes`` FP32 accumulators per slice of ``split``
    columns (a multiple of ``lanes``), lane l taking every ``lanes``-th column; a function of H
    alone (`sum_order`), so of the model, never of the batch."""

    lanes: int
    split: int

    def num_splits(self, H: int) -> int:
        return -(-H // self.split)


LANES = 64
MIN_SPLIT = 256  # columns per slice at least: 4 steps of 64 lanes
MAX_SPLITS = 16  # the top-k kernel adds at most 16 partials per logit


def sum_order(H: int) -> SumOrder:
    """64 lanes (fewer for H below 64) and slices of at least 256 columns, at most 16 of them:
    H = 2048 gives 8 slices, so a batch-1 logits launch has ``8 * E / block_e`` programs."""
    lanes = min(LANES, triton.next_power_of_2(H))
    per_split = _round_up(_round_up(H, MAX_SPLITS) // MAX_SPLITS, lanes)
    return SumOrder(lanes=lanes, split=min(_round_up(H, lanes), max(MIN_SPLIT, per_split)))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---- the logits launch's tile (any tile gives the same bits) ----------------------------------


@dataclass(frozen=True, slots=True)
class LogitsTile:
    """Programs of ``block_t`` rows and ``block_e`` experts (powers of two) on ``num_warps``
    warps; rows beyond T are masked. The tile sets how often x and W are read, not the sums."""

    block_t: int
    block_e: int
    num_warps: int

    def __post_init__(self) -> None:
        for name, value in (("block_t", self.block_t), ("block_e", self.block_e)):
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two; got {value}")
        if self.num_warps not in (1, 2, 4, 8):
            raise ValueError(f"num_warps must be 1, 2, 4 or 8; got {self.num_warps}")


# From 16 rows: 8 rows of 32 experts on 4 warps. On one H200 (`python benchmarks/router.py
# --tiles 8:32:4,...`, twice) the logits took 12.1 against 13.8-14.0 us at 256 rows for the 16
# rows of 16 experts on 8 warps taken before, 3.8-3.9 against 4.4 at 64, 3.3-3.4 against
# 3.5-3.6 at 16 (BENCHMARKS.md, "The router's logits tile").
WIDE_TILE = LogitsTile(block_t=8, block_e=32, num_warps=4)
WIDE_TILE_MIN_ROWS = 16


def tile_for(T: int) -> LogitsTile:
    """One row per program at batch 1 (W's read over the most SMs), up to 8 rows of 16 experts
    below 16 rows, then `WIDE_TILE` (W read from L2 T / 8 times, x E / 32 times); about 64
    accumulators per thread."""
    if T >= WIDE_TILE_MIN_ROWS:
        return WIDE_TILE
    block_t = triton.next_power_of_2(max(T, 1))
    block_e = 8 if block_t <= 4 else 16
    num_warps = max(1, min(8, block_t * block_e * LANES // 2048))
    return LogitsTile(block_t=block_t, block_e=block_e, num_warps=num_warps)


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def lane_sum(v_RN, N: tl.constexpr, LOG2_N: tl.constexpr):
    """``[R]``: each row of ``v [R, N]`` (N = 2**LOG2_N) summed as a pairwise tree: lanes
    (2i, 2i + 1) first, then pairs of those. The order is written here, so it is the same
    compiled and interpreted, whatever layout the compiler gives v."""
    R: tl.constexpr = v_RN.shape[0]
    for level in tl.static_range(LOG2_N):
        v_RN = tl.reshape(v_RN, [R, N >> (level + 1), 2])
        even, odd = tl.split(v_RN)
        v_RN = even + odd
    return tl.reshape(v_RN, [R])


@triton.jit
def _logits_kernel(
    x_TH, w_EH, partial_TSE, T, E, H,
    NUM_SPLITS: tl.constexpr, STEPS: tl.constexpr, LANES: tl.constexpr, LOG2_LANES: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    row_ok, expert_ok = rows < T, experts < E
    x_rows = x_TH + rows.to(tl.int64)[:, None] * H
    w_rows = w_EH + experts.to(tl.int64)[:, None] * H
    acc = tl.zeros([BLOCK_T, BLOCK_E, LANES], dtype=tl.float32)  # +0.0
    for step in tl.static_range(STEPS):  # unrolled: every load of the slice in flight at once
        cols = (split * STEPS + step) * LANES + tl.arange(0, LANES)
        col_ok = cols < H
        # Masked columns read zeros: their products add +0.0, as the twin's zero padding.
        x = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        w = tl.load(w_rows + cols[None, :], mask=expert_ok[:, None] & col_ok[None, :], other=0.0)
        x3 = tl.broadcast_to(x.to(tl.float32)[:, None, :], [BLOCK_T, BLOCK_E, LANES])
        w3 = tl.broadcast_to(w.to(tl.float32)[None, :, :], [BLOCK_T, BLOCK_E, LANES])
        # One rounding per term; for BF16 and FP16 operands the product is exact anyway.
        acc = tl.fma(x3, w3, acc)
    partial = lane_sum(tl.reshape(acc, [BLOCK_T * BLOCK_E, LANES]), LANES, LOG2_LANES)
    partial = tl.reshape(partial, [BLOCK_T, BLOCK_E])
    out = partial_TSE + (rows.to(tl.int64)[:, None] * NUM_SPLITS + split) * E + experts[None, :]
    tl.store(out, partial, mask=row_ok[:, None] & expert_ok[None, :])


@triton.jit
def _topk_kernel(
    partial_TSE, weights_Tk, ids_Tk, E,
    NUM_SPLITS: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr, OUT: tl.constexpr,
    BLOCK_E: tl.constexpr, LOG2_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    valid = lanes < E
    src = partial_TSE + row * NUM_SPLITS * E + lanes
    logits = tl.load(src, mask=valid, other=float("-inf"))
    for s in tl.static_range(1, NUM_SPLITS):  # the slices' partials, left to right
        logits += tl.load(src + s * E, mask=valid, other=float("-inf"))
    # A NaN or +inf logit, or a row of -inf, makes some exp NaN, so the sum and every p NaN.
    e = tl.where(valid, exp_rn(logits - tl.max(logits, axis=0)), 0.0)
    total = tl.reshape(lane_sum(tl.reshape(e, [1, BLOCK_E]), BLOCK_E, LOG2_E), [])
    p = tl.math.div_rn(e, tl.full([BLOCK_E], 1.0, tl.float32) * total)
    # One int64 key per lane, so that each arg-max is one reduction: the probability's bits
    # (a non-negative float's bits order as integers) above ``BLOCK_E - 1 - lane``, so equal
    # probabilities go to the lowest id. A NaN row keys every lane as p = 0: it takes the
    # lowest ids. Lanes past E and lanes taken hold -1, below every valid key: k <= E leaves a
    # valid lane each time.
    bits = tl.where(p == p, p, 0.0).to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(valid, (bits << LOG2_E) | (BLOCK_E - 1 - lanes), -1)
    slots = tl.arange(0, BLOCK_K)
    top_p = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_id = tl.zeros([BLOCK_K], dtype=tl.int32)
    top_sum = tl.zeros([], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(key, axis=0)
        winner = (BLOCK_E - 1 - (best & (BLOCK_E - 1))).to(tl.int32)
        best_p = (best >> LOG2_E).to(tl.int32).to(tl.float32, bitcast=True)
        key = tl.where(lanes == winner, -1, key)
        top_p = tl.where(slots == j, best_p, top_p)
        top_id = tl.where(slots == j, winner, top_id)
        top_sum += best_p  # j = 0, 1, ..., k - 1 in turn
    if NORM:
        top_p = tl.math.div_rn(top_p, tl.full([BLOCK_K], 1.0, tl.float32) * top_sum)
    top_p = tl.where(total == total, top_p, nan_like(top_p))
    out = row * K + slots
    tl.store(weights_Tk + out, round_to(top_p, OUT), mask=slots < K)
    tl.store(ids_Tk + out, top_id.to(tl.int64), mask=slots < K)


# ---- the plain-PyTorch twin -------------------------------------------------------------------


def pairwise_lane_sum(v: torch.Tensor) -> torch.Tensor:
    """`lane_sum` over the last dim (a power of two): lanes (2i, 2i + 1), then pairs of those."""
    while v.shape[-1] > 1:
        v = v[..., 0::2] + v[..., 1::2]
    return v[..., 0]


def reference_logit_partials(x_TH: torch.Tensor, weight_EH: torch.Tensor) -> torch.Tensor:
    """`logit_partials` in plain PyTorch, `SumOrder`'s additions one by one: bitwise the
    kernel's for BF16 and FP16 operands, whose products are exact (FP32 operands the kernel
    multiplies and adds with one rounding, this twin with two)."""
    (T, H), E = x_TH.shape, weight_EH.shape[0]
    order = sum_order(H)
    S, steps = order.num_splits(H), order.split // order.lanes
    pad = S * order.split - H
    x = torch.nn.functional.pad(x_TH.float(), (0, pad)).view(T, 1, S, steps, order.lanes)
    w = torch.nn.functional.pad(weight_EH.float(), (0, pad)).view(1, E, S, steps, order.lanes)
    acc = torch.zeros(T, E, S, order.lanes, dtype=torch.float32, device=x_TH.device)
    for step in range(steps):
        acc = acc + x[:, :, :, step] * w[:, :, :, step]
    return pairwise_lane_sum(acc).transpose(1, 2).contiguous()


def reference_logits(x_TH: torch.Tensor, weight_EH: torch.Tensor) -> torch.Tensor:
    """FP32 logits ``[T, E]``: `reference_logit_partials` added left to right, as the top-k
    kernel adds them."""
    partial_TSE = reference_logit_partials(x_TH, weight_EH)
    logits_TE = partial_TSE[:, 0]
    for s in range(1, partial_TSE.shape[1]):
        logits_TE = logits_TE + partial_TSE[:, s]
    return logits_TE


def reference_route(
    x_TH: torch.Tensor,
    weight_EH: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    exp=torch.exp,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`launch`'s ``(weights [T, k] in x's dtype, ids [T, k] int64)`` in plain PyTorch, step by
    step as the kernels compute them; ``exp`` the FP32 exponential (the kernel's is CUDA's
    accurate expf, which torch's CUDA exp also is; the interpreter's is numpy's)."""
    logits_TE = reference_logits(x_TH, weight_EH)
    T, E = logits_TE.shape
    e_TE = exp(logits_TE - logits_TE.max(-1, keepdim=True).values)
    padded = torch.nn.functional.pad(e_TE, (0, triton.next_power_of_2(E) - E))
    total_T1 = pairwise_lane_sum(padded)[:, None]
    p_TE = e_TE / total_T1
    key_TE = torch.where(p_TE.isnan(), 0.0, p_TE)
    lanes_E = torch.arange(E, device=x_TH.device)
    top_p, top_id = [], []
    for _ in range(top_k):
        best_T = key_TE.max(-1).values
        winner_T = torch.where(key_TE == best_T[:, None], lanes_E, E).min(-1).values
        key_TE = torch.where(lanes_E == winner_T[:, None], -1.0, key_TE)
        top_p.append(best_T)
        top_id.append(winner_T)
    top_p_Tk = torch.stack(top_p, -1) if top_k else p_TE[:, :0]
    if norm_topk_prob:
        top_sum = torch.zeros(T, dtype=torch.float32, device=x_TH.device)
        for j in range(top_k):
            top_sum = top_sum + top_p_Tk[:, j]
        top_p_Tk = top_p_Tk / top_sum[:, None]
    top_p_Tk = torch.where(total_T1.isnan(), float("nan"), top_p_Tk)
    ids = torch.stack(top_id, -1) if top_k else lanes_E.new_zeros(T, 0)
    return top_p_Tk.to(x_TH.dtype), ids.long()


# ---- the launcher -----------------------------------------------------------------------------


def supported(x_TH: torch.Tensor, weight_EH: torch.Tensor, top_k: int) -> bool:
    """Whether `launch` takes these inputs (dtypes and shapes only): x ``[T, H]`` and weight
    ``[E, H]`` of `DTYPES` on one device, H >= 1, 1 <= E <= 1024, 1 <= top_k <= min(E, 16)."""
    return (
        x_TH.dtype in DTYPES
        and weight_EH.dtype in DTYPES
        and x_TH.dim() == 2
        and weight_EH.dim() == 2
        and x_TH.shape[1] >= 1
        and weight_EH.shape[1] == x_TH.shape[1]
        and 1 <= weight_EH.shape[0] <= MAX_EXPERTS
        and isinstance(top_k, int)
        and not isinstance(top_k, bool)
        and 1 <= top_k <= min(weight_EH.shape[0], MAX_TOP_K)
        and weight_EH.device == x_TH.device
    )


def _check(x_TH: torch.Tensor, weight_EH: torch.Tensor, top_k: int) -> None:
    check_kernel_device("x_TH", x_TH)
    if weight_EH.device != x_TH.device:
        raise ValueError(f"weight_EH must be on {x_TH.device} like x_TH; got {weight_EH.device}")
    if x_TH.dtype not in DTYPES or weight_EH.dtype not in DTYPES:
        raise ValueError(
            f"x_TH and weight_EH must have dtypes among {DTYPES}; got {x_TH.dtype} and "
            f"{weight_EH.dtype}"
        )
    if x_TH.dim() != 2 or x_TH.shape[1] == 0:
        raise ValueError(f"x_TH must be [T, H] with H >= 1; got shape {tuple(x_TH.shape)}")
    if weight_EH.dim() != 2 or weight_EH.shape[1] != x_TH.shape[1]:
        raise ValueError(
            f"weight_EH must be [E, {x_TH.shape[1]}] for x_TH of shape {tuple(x_TH.shape)}; got "
            f"shape {tuple(weight_EH.shape)}"
        )
    E = weight_EH.shape[0]
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"the number of experts must be in [1, {MAX_EXPERTS}]; got E = {E}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(E, MAX_TOP_K):
        raise ValueError(
            f"top_k must be an int in [1, min(E, {MAX_TOP_K})] = [1, {min(E, MAX_TOP_K)}]; "
            f"got {top_k!r}"
        )
    check_contiguous("x_TH", x_TH)
    check_contiguous("weight_EH", weight_EH)


def logit_partials(
    x_TH: torch.Tensor, weight_EH: torch.Tensor, tile: LogitsTile | None = None
) -> torch.Tensor:
    """The logits launch alone: FP32 partial sums ``[T, S, E]`` of each logit over the S slices
    of `sum_order`'s H (checked by `launch`, which adds them in the top-k launch)."""
    (T, H), E = x_TH.shape, weight_EH.shape[0]
    order, tile = sum_order(H), tile or tile_for(T)
    S = order.num_splits(H)
    partial_TSE = torch.empty(T, S, E, dtype=torch.float32, device=x_TH.device)
    if T == 0:
        return partial_TSE
    with device_of(x_TH):
        grid = (-(-T // tile.block_t), -(-E // tile.block_e), S)
        _logits_kernel[grid](
            x_TH, weight_EH, partial_TSE, T, E, H,
            NUM_SPLITS=S, STEPS=order.split // order.lanes, LANES=order.lanes,
            LOG2_LANES=order.lanes.bit_length() - 1, BLOCK_T=tile.block_t,
            BLOCK_E=tile.block_e, num_warps=tile.num_warps,
            # The FMAs are explicit; nothing else may be contracted.
            enable_fp_fusion=False,
            **dependent_launch.keywords(x_TH.device),
        )  # fmt: skip
    return partial_TSE


def launch(
    x_TH: torch.Tensor,
    weight_EH: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    tile: LogitsTile | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in x's dtype, ids [T, k] int64)`` of the router's live routing, as the
    module docstring computes them. ``tile`` other than `tile_for`'s is for benchmarking
    variants; it changes no bit."""
    _check(x_TH, weight_EH, top_k)
    T, E = x_TH.shape[0], weight_EH.shape[0]
    weights_Tk = torch.empty(T, top_k, dtype=x_TH.dtype, device=x_TH.device)
    ids_Tk = torch.empty(T, top_k, dtype=torch.int64, device=x_TH.device)
    if T == 0:
        return weights_Tk, ids_Tk
    partial_TSE = logit_partials(x_TH, weight_EH, tile)
    block_e = triton.next_power_of_2(E)
    with device_of(x_TH):
        _topk_kernel[(T,)](
            partial_TSE, weights_Tk, ids_Tk, E,
            NUM_SPLITS=partial_TSE.shape[1], K=top_k, NORM=bool(norm_topk_prob),
            OUT=_TL_DTYPES[x_TH.dtype], BLOCK_E=block_e, LOG2_E=block_e.bit_length() - 1,
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=max(1, min(4, block_e // 128)),
            # libdevice's expf without flushing subnormal results to zero (Triton's default
            # links its FTZ path): the function torch's CUDA exp runs, subnormals included.
            enable_fp_fusion=False, enable_reflect_ftz=False,
            **dependent_launch.keywords(x_TH.device),
        )  # fmt: skip
    return weights_Tk, ids_Tk
