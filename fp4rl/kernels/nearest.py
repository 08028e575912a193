"""Round-to-nearest NVFP4 quantization (`reference.quantize`) and its fused fake-quant twin.

One kernel; SCALE_SOURCE says where each row's FP32 global scale comes from:

- ``"row_amax"`` (per-row scaling, the rollout's per-token activations): pass 1 over the
  program's rows takes their amax, pass 2 quantizes them. Rows of up to 8192 values are loaded
  once and kept in registers between the passes (ONE_CHUNK); longer rows are walked twice, the
  second walk re-reading what the first brought into L1/L2.
- ``"group_amax"`` (per-tensor, per-expert): the int32 group amax from `amax.group_amax_bits`,
  a first launch that reads x once more. Groups small enough to stay in L2 between the two
  passes (experts) can go to `expert_quant` instead, one launch that reads them from HBM once:
  those up to its ``MAX_GROUP_BYTES``.
- ``"given"``: the caller's global scale per group (a group spanning several tensors).

With SCATTER (per-row scaling only) row ``r`` of x is stored as row ``slots[r // heads] * heads
+ r % heads`` of the outputs: x ``[T, heads, K]`` quantized straight into a paged KV cache's
NVFP4 pages at the tokens' slots (`launch_into`), with the bits of `launch`, the codes' sign
bits where pages keep them (`reference.page_codes`), each row's amax stored in x's dtype where
`launch` stores its global scale (`NVFP4Rows`). With PAIRED, grid axis 1 picks one of two such
(x, pages) sets at the same slots: a layer's K and V in one launch (`launch_into_pair`).

With FAKE the kernel stores ``dequantize(quantize(x))`` in x's dtype instead of codes, block
scales and global scales: the trainer's forward needs only those values. With RECORD it also
stores each row's site record (full codes or compact mantissa bits, block and global scales) at
the row's own place (`tiles.store_record`): the K and V records a rollout keeps come out of the
launch that writes them into the pages (`launch_into_pair` with ``record``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.fp4 import reference
from fp4rl.fp4.reference import Scaling
from fp4rl.fp4.rounding import CompactCodes
from fp4rl.fp4.tensor import NVFP4Rows, NVFP4Tensor
from fp4rl.kernels import amax, dependent_launch, expert_quant
from fp4rl.kernels.dependent_launch import wait_for_prior
from fp4rl.kernels.launch import (
    CONFIGS,
    TileConfig,
    check_contiguous,
    check_device,
    check_x,
    device_of,
    outputs,
    pair_view,
    record_outputs,
    rows_per_group,
    word_view,
)
from fp4rl.kernels.numerics import (
    global_scale_from_amax,
    is_finite,
    max_nan,
    nan_like,
    ratio_divisor,
)
from fp4rl.kernels.tiles import (
    block_amax,
    load_pairs,
    program_rows,
    quantize_chunk,
    row_amax,
    store_record,
)


# Row counts change with every batch: no recompiling for R == 1 or R % 16 == 0.
@triton.jit(do_not_specialize=["R", "rows_per_group"])
def _quantize_kernel(
    x_RK,
    codes_RK8,
    block_scale_RKB,
    fake_RK,
    scale_in_G,
    global_scale_G,
    slots_T,
    x2_RK,
    codes2_RK8,
    block_scale2_RKB,
    global_scale2_G,
    record_RK,
    record_block_scale_RKB,
    record_global_scale_R,
    record2_RK,
    record2_block_scale_RKB,
    record2_global_scale_R,
    R,
    K,
    rows_per_group,
    heads,
    slot_stride,
    SCALE_SOURCE: tl.constexpr,
    FAKE: tl.constexpr,
    SCATTER: tl.constexpr,
    PAIRED: tl.constexpr,
    RECORD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_prior(PDL)
    # Grid axis 1 picks the tensor: 0 the first (x_RK ...), 1 the second (x2_RK ...). The outer
    # test is resolved at compile time: unpaired launches carry no branch.
    if PAIRED:  # noqa: SIM102
        if tl.program_id(1) == 1:
            x_RK = x2_RK
            codes_RK8 = codes2_RK8
            block_scale_RKB = block_scale2_RKB
            global_scale_G = global_scale2_G
            record_RK = record2_RK
            record_block_scale_RKB = record2_block_scale_RKB
            record_global_scale_R = record2_global_scale_R
    rows_R, row_ok_R = program_rows(R, BLOCK_R)
    group_R = rows_R // rows_per_group
    out_R = rows_R  # where the row's codes, block scales and (per-row) global scale go
    if SCATTER:
        slot_R = tl.load(slots_T + (rows_R // heads) * slot_stride, mask=row_ok_R, other=0)
        slot_R = slot_R.to(tl.int64)
        out_R = slot_R * heads + rows_R % heads
    if SCALE_SOURCE == "given":
        s_R = tl.load(scale_in_G + group_R, mask=row_ok_R, other=0.0)
    else:
        if ONE_CHUNK:  # set only for SCALE_SOURCE == "row_amax"
            # The whole row is one chunk: load it once and keep it in registers for pass 2.
            x_even, x_odd = load_pairs(x_RK, rows_R, row_ok_R, 0, K, BLOCK_K)
            block_amax_RB = block_amax(x_even, x_odd)
            amax_R = tl.reduce(block_amax_RB, 1, max_nan)
        elif SCALE_SOURCE == "row_amax":
            amax_R = row_amax(x_RK, rows_R, row_ok_R, K, BLOCK_R, BLOCK_K, NUM_STAGES)
        else:
            amax_bits_R = tl.load(scale_in_G + group_R, mask=row_ok_R, other=0)
            amax_R = amax_bits_R.to(tl.float32, bitcast=True)
        s_R = global_scale_from_amax(amax_R, is_finite(amax_R))
        if SCATTER:  # groups are rows, whose pages keep the amax (x's dtype: exact)
            kept_R = tl.where(is_finite(amax_R), amax_R, nan_like(amax_R))
            tl.store(global_scale_G + out_R, kept_R.to(global_scale_G.dtype.element_ty),
                     mask=row_ok_R)  # fmt: skip
        elif not FAKE:  # one store per group: by the program holding its first row
            tl.store(global_scale_G + group_R, s_R, mask=row_ok_R & (rows_R % rows_per_group == 0))
    scale_R, d_scaled_R, reciprocal_R = ratio_divisor(s_R)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if not ONE_CHUNK:
            x_even, x_odd = load_pairs(x_RK, rows_R, row_ok_R, k0, K, BLOCK_K)
            block_amax_RB = block_amax(x_even, x_odd)
        q_even, q_odd, block_byte = quantize_chunk(
            x_even, x_odd, block_amax_RB, s_R, scale_R, d_scaled_R, reciprocal_R, fake_RK,
            codes_RK8, block_scale_RKB, out_R, row_ok_R, k0, K,
            POISON_BLOCKS=SCALE_SOURCE == "given", FAKE=FAKE, BLOCK_K=BLOCK_K, PAGE_SIGNS=SCATTER,
        )  # fmt: skip
        store_record(
            record_RK, record_block_scale_RKB, record_global_scale_R, rows_R, row_ok_R, k0, K,
            q_even, q_odd, block_byte, s_R, RECORD, BLOCK_K,
        )  # fmt: skip


def _default_config(source: str, k: int, fake: bool) -> TileConfig:
    """Per-row scaling of rows that fit one "row" chunk loads each row once and keeps it in
    registers for both passes, with 4 warps per row for codes and 8 for fake-quant values. On
    one H200, 16384 x 7168 BF16: quantize 108-110 us with 4 warps against 117-121 us with 8;
    fake-quant 135-143 us with 8 against 149-152 us with 4. Other scalings walk 1024-wide
    chunks."""
    if source == "row_amax" and k <= CONFIGS["row"].block_k:
        return CONFIGS["row"] if fake else CONFIGS["row-4warps"]
    return CONFIGS["default"]


def launch(
    x: torch.Tensor,
    *,
    scaling: Scaling,
    global_scale: torch.Tensor | None,
    fake: bool,
    config: TileConfig | None = None,
) -> NVFP4Tensor | torch.Tensor:
    """Quantize ``x [..., K]`` as `reference.quantize`; with ``fake``, return
    ``reference.dequantize(that, x.dtype)`` instead."""
    check_x(x)
    g = reference.group_ndim(x, scaling)
    k = x.shape[-1]
    x_RK = x.view(-1, k)
    num_rows = x_RK.shape[0]
    group_rows = rows_per_group(x.shape, g)
    if global_scale is not None:
        # The reference's own checks (dtype, broadcast) and its contiguous per-group layout.
        s = reference.resolve_global_scale(x, scaling, global_scale)
        check_device("global_scale", s, x.device)
        source = "given"
    else:
        scale_shape = reference.global_scale_shape(x.shape, g)
        s = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
        if num_rows == 0 and group_rows == 0 and s.numel():
            raise ValueError(f"scaling={scaling!r} makes empty groups for x {tuple(x.shape)}")
        source = "row_amax" if group_rows == 1 else "group_amax"
    fake_RK, codes, codes_words, block_scale = outputs(x, fake)
    # Groups that fit in L2 (experts) are read from HBM once; a given tile config asks for the
    # two-launch path below.
    fused = source == "group_amax" and config is None and expert_quant.fits(x_RK, group_rows)
    if num_rows and fused:
        expert_quant.launch(x_RK, group_rows, s, fake_RK, codes_words, block_scale, fake=fake)
    elif num_rows:
        if config is None:
            config = _default_config(source, k, fake)
        if source == "group_amax":
            scale_in = amax.group_amax_bits(x_RK, group_rows, config)
        else:
            scale_in = s if source == "given" else x_RK  # x_RK: never read
        grid, meta = config.launch(num_rows, k)
        one_chunk = source == "row_amax" and k <= meta["BLOCK_K"]
        with device_of(x):
            _quantize_kernel[grid](
                pair_view(x_RK), codes_words, block_scale, fake_RK, scale_in, s, x_RK,
                pair_view(x_RK), codes_words, block_scale, s, *[s] * 6, num_rows, k, group_rows,
                1, 1, SCALE_SOURCE=source, FAKE=fake, SCATTER=False, PAIRED=False, RECORD=0,
                ONE_CHUNK=one_chunk,
                **meta,
                **dependent_launch.keywords(x.device),
            )  # fmt: skip
    if fake:
        return fake_RK.view(x.shape)
    return NVFP4Tensor(
        codes=codes, block_scale=block_scale.view(torch.float8_e4m3fn), global_scale=s
    )


def launch_into(x_TKD: torch.Tensor, pages: NVFP4Rows, slots_T: torch.Tensor) -> None:
    """``reference.quantize_into``: ``reference.quantize(x_TKD, scaling="row")`` (one global
    scale per ``[t, h]`` row) as rows ``slots_T[t]`` of ``pages`` (`NVFP4Rows` codes ``[N, P,
    heads, K / 2]`` and the like: slot ``n * P + p``), each row's amax in place of its global
    scale, in one launch: no quantized copy of x is made. ``slots_T`` (int64, distinct, any
    stride: a view of the engine's staged rows) must lie within the pages; that is not checked
    (it would need a device sync)."""
    _check_rows(x_TKD, pages, "x_TKD", "pages")
    _check_slots(slots_T, x_TKD)
    _scatter_rows(x_TKD, pages, x_TKD, pages, slots_T, paired=False, record=None)


def launch_into_pair(
    k_TKD: torch.Tensor,
    k_pages: NVFP4Rows,
    v_TKD: torch.Tensor,
    v_pages: NVFP4Rows,
    slots_T: torch.Tensor,
    record: str | None = None,
) -> tuple[NVFP4Tensor | CompactCodes | None, NVFP4Tensor | CompactCodes | None]:
    """`launch_into` of ``k_TKD`` into ``k_pages`` and of ``v_TKD`` (k's shape and dtype) into
    ``v_pages`` at the same ``slots_T``, in ONE launch: grid axis 1 picks K (0) or V (1), every
    bit what the two `launch_into` calls store. With ``record`` ("full" or "compact") the same
    launch also makes K's and V's site records, ``quantize(x, scaling="row")`` (as it is, or its
    `rounding.compact`) of each, and returns them (else ``(None, None)``). Errors name the k or v
    value at fault."""
    _check_rows(k_TKD, k_pages, "k_TKD", "k_pages")
    _check_rows(v_TKD, v_pages, "v_TKD", "v_pages")
    if v_TKD.shape != k_TKD.shape or v_TKD.dtype != k_TKD.dtype:
        raise ValueError(
            f"v_TKD must have k_TKD's shape {tuple(k_TKD.shape)} and dtype {k_TKD.dtype}; got "
            f"{tuple(v_TKD.shape)} {v_TKD.dtype}"
        )
    _check_slots(slots_T, k_TKD)
    return _scatter_rows(k_TKD, k_pages, v_TKD, v_pages, slots_T, paired=True, record=record)


def _check_rows(x_TKD: torch.Tensor, pages: NVFP4Rows, x_name: str, pages_name: str) -> None:
    """What `launch_into` needs of x ``[T, heads, K]`` and its pages; errors use the names."""
    try:
        check_x(x_TKD)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{x_name}: {err}") from err
    if x_TKD.dim() != 3:
        raise ValueError(f"{x_name} must be [T, heads, K]; got shape {tuple(x_TKD.shape)}")
    _, heads, k = x_TKD.shape
    lead = tuple(pages.codes.shape[:-1])
    if len(lead) != 3 or tuple(pages.shape[2:]) != (heads, k):
        raise ValueError(
            f"{pages_name} must be [N, P, heads, K] = [N, P, {heads}, {k}] for {x_name} of shape "
            f"{tuple(x_TKD.shape)}; got {tuple(pages.shape)}"
        )
    if pages.amax.dtype != x_TKD.dtype:
        raise ValueError(
            f"{pages_name} keep {pages.amax.dtype} amaxes but {x_name} is {x_TKD.dtype}; a row's "
            "amax is kept in the row's own dtype"
        )
    for name, t in zip(("codes", "block_scale", "amax"), pages.tensors(), strict=True):
        check_device(f"{pages_name}.{name}", t, x_TKD.device)
        check_contiguous(f"{pages_name}.{name}", t)


def _check_slots(slots_T: torch.Tensor, x_TKD: torch.Tensor) -> None:
    T = x_TKD.shape[0]
    check_device("slots_T", slots_T, x_TKD.device)
    if slots_T.dtype != torch.int64 or tuple(slots_T.shape) != (T,):
        raise ValueError(
            f"slots_T must be int64 of shape ({T},); got {slots_T.dtype} of shape "
            f"{tuple(slots_T.shape)}"
        )


def _scatter_rows(x_TKD, pages, x2_TKD, pages2, slots_T, *, paired: bool, record):
    """The checked launch: x's rows (and, ``paired``, x2's: grid axis 1) into their pages, with
    their records in form ``record`` if given; returns the records (None without)."""
    T, heads, k = x_TKD.shape
    recs = [record_outputs(record, tuple(x_TKD.shape[:-1]), k, x_TKD.device) for _ in range(2)]
    if T == 0:
        return recs[0].record, recs[1].record
    x_RK, x2_RK = x_TKD.view(-1, k), x2_TKD.view(-1, k)
    (programs,), meta = _default_config("row_amax", k, False).launch(x_RK.shape[0], k)
    grid = (programs, 2 if paired else 1)
    with device_of(x_TKD):
        _quantize_kernel[grid](
            pair_view(x_RK), word_view(pages.codes), pages.block_scale.view(torch.uint8), x_RK,
            x_RK, pages.amax, slots_T, pair_view(x2_RK), word_view(pages2.codes),
            pages2.block_scale.view(torch.uint8), pages2.amax, *recs[0].pointers(),
            *recs[1].pointers(),
            x_RK.shape[0], k, 1, heads, slots_T.stride(0), SCALE_SOURCE="row_amax", FAKE=False,
            SCATTER=True, PAIRED=paired, RECORD=recs[0].RECORD, ONE_CHUNK=k <= meta["BLOCK_K"],
            **meta, **dependent_launch.keywords(x_TKD.device),
        )  # fmt: skip
    return recs[0].record, recs[1].record
