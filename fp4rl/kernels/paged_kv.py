"""Paged KV as the attention kernels read it: the device functions that walk a sequence's
pages through its block table and hand K and V to the dots, and the launchers' shared checks.

Both attention kernels (`paged_attention`: one query token per sequence; `paged_prefill`:
tiles of a prefill segment's query tokens) step through a context BLOCK_N tokens at a time with
`context_step`, which returns the step's K and V values exactly as ``KVCache.read`` returns
them: BF16 pages cast to the query dtype, NVFP4 pages decoded in registers as
``reference.dequantize`` computes them (``(e2m1 * f32(block_scale)) * global_scale`` in FP32,
then cast; the first product is exact, the second rounds once, for every global scale below
2**120), each row's global scale made from the amax its pages keep (`NVFP4Rows`) as the
quantizer made it (`numerics.global_scale_from_amax`). `probabilities_times_values` multiplies
FP32 probabilities by BF16 V exactly on the tensor cores: each probability as three BF16 parts
whose sum is exactly p. The kernels' contract, and the twins they are tested against, are in
their own modules.

Legend: N tokens of a step, D head dim, W = D / 8 int32 words of packed codes per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.fp4 import reference
from fp4rl.fp4.tensor import NVFP4Rows
from fp4rl.kernels.launch import check_contiguous, check_kernel_device
from fp4rl.kernels.numerics import dot, e4m3_value, global_scale_from_amax, is_finite, round_to
from fp4rl.kernels.packed_words import BLOCK_SCALE_BIAS, GLOBAL_SCALE_BIAS, page_code

KVPages = torch.Tensor | NVFP4Rows  # [num_blocks, P, K, D] values, or the NVFP4 members


@triton.jit
def _code_values(words, sf_W, s_N, J: tl.constexpr, DTYPE: tl.constexpr):
    """Code J of each int32 word of 8 (element ``8 * word + J``) scaled back, in DTYPE."""
    return round_to((page_code(words, J) * sf_W) * s_N[:, None], DTYPE)


@triton.jit
def _block_scales(block_scale, rows_N, ok_N, D: tl.constexpr):
    """The biased block scales ``sf * 2**118`` (FP32, ``[BLOCK_N, D // 16]``) of cache rows
    ``rows_N``. From head dim 64 up a row's scales are read as int32 words of 4 (the pointer is
    to int32 then): loads of 4 bytes or more are what the software pipeline prefetches
    (cp.async), where byte loads would stall each step on global memory; bytes are picked out
    by shifts."""
    if D >= 64:
        words = tl.load(
            block_scale + rows_N[:, None] * (D // 64) + tl.arange(0, D // 64)[None, :],
            mask=ok_N[:, None],
            other=0,
        )  # [BLOCK_N, D // 64]: scales 4i .. 4i + 3
        sf0 = e4m3_value(words & 0xFF)
        sf1 = e4m3_value((words >> 8) & 0xFF)
        sf2 = e4m3_value((words >> 16) & 0xFF)
        sf3 = e4m3_value((words >> 24) & 0xFF)
        # [..., k1, k0] for scale k = 2 * k1 + k0 of the word.
        sf = tl.reshape(tl.join(tl.join(sf0, sf2), tl.join(sf1, sf3)), [rows_N.shape[0], D // 16])
    else:
        sf = e4m3_value(
            tl.load(
                block_scale + rows_N[:, None] * (D // 16) + tl.arange(0, D // 16)[None, :],
                mask=ok_N[:, None],
                other=0,
            ).to(tl.int32)
        )
    return sf * BLOCK_SCALE_BIAS


@triton.jit
def row_global_scales(amax, rows_N, ok_N):
    """The global scales of cache rows ``rows_N`` from the amaxes their pages keep (any float
    dtype: exact in FP32), as the quantizer computed them; 0 where ``ok_N`` is False. A 2-byte
    amax is read as the 4-byte word that holds it (`page_members` checks that the pages' words
    are whole): loads of 4 bytes or more are what the software pipeline prefetches."""
    if amax.dtype.element_ty == tl.float32:
        amax_N = tl.load(amax + rows_N, mask=ok_N, other=0.0)
    else:
        words = tl.load(amax.to(tl.pointer_type(tl.int32)) + rows_N // 2, mask=ok_N, other=0)
        half = (words >> ((rows_N % 2) * 16).to(tl.int32)) & 0xFFFF
        amax_N = half.to(tl.int16).to(amax.dtype.element_ty, bitcast=True).to(tl.float32)
    return global_scale_from_amax(amax_N, is_finite(amax_N))


@triton.jit
def _load_kv(
    pages, block_scale, amax, rows_N, ok_N, D: tl.constexpr, NVFP4: tl.constexpr,
    DTYPE: tl.constexpr,
):  # fmt: skip
    """The ``[BLOCK_N, D]`` K or V values of cache rows ``rows_N`` (row = slot * K + kv head) in
    DTYPE, as ``KVCache.read`` returns them; 0 where ``ok_N`` is False."""
    if NVFP4:
        W: tl.constexpr = D // 8  # int32 words of codes per row
        words = tl.load(
            pages + rows_N[:, None] * W + tl.arange(0, W)[None, :], mask=ok_N[:, None], other=0
        )
        sf = _block_scales(block_scale, rows_N, ok_N, D)
        sf_W = tl.reshape(tl.join(sf, sf), [rows_N.shape[0], W])  # a block is two words
        s_N = row_global_scales(amax, rows_N, ok_N) * GLOBAL_SCALE_BIAS
        # Joined as [..., b2, b1, b0] for J = 4 * b2 + 2 * b1 + b0: element 8 * word + J.
        evens = tl.join(
            tl.join(
                _code_values(words, sf_W, s_N, 0, DTYPE), _code_values(words, sf_W, s_N, 4, DTYPE)
            ),
            tl.join(
                _code_values(words, sf_W, s_N, 2, DTYPE), _code_values(words, sf_W, s_N, 6, DTYPE)
            ),
        )
        odds = tl.join(
            tl.join(
                _code_values(words, sf_W, s_N, 1, DTYPE), _code_values(words, sf_W, s_N, 5, DTYPE)
            ),
            tl.join(
                _code_values(words, sf_W, s_N, 3, DTYPE), _code_values(words, sf_W, s_N, 7, DTYPE)
            ),
        )
        return tl.reshape(tl.join(evens, odds), [rows_N.shape[0], D])
    values = tl.load(
        pages + rows_N[:, None] * D + tl.arange(0, D)[None, :], mask=ok_N[:, None], other=0.0
    )
    if pages.dtype.element_ty != DTYPE:
        values = round_to(values.to(tl.float32), DTYPE)
    return values


@triton.jit
def _three_parts(p):
    """FP32 ``p`` as three BF16 parts, ``p1 + p2 + p3 == p`` exactly: each part is the rounding
    error of the ones before, which FP32 holds exactly (24 bits in three parts of 8)."""
    p1 = round_to(p, tl.bfloat16)
    rest = p - p1.to(tl.float32)
    p2 = round_to(rest, tl.bfloat16)
    return p1, p2, round_to(rest - p2.to(tl.float32), tl.bfloat16)


@triton.jit
def _times(part, v, acc, KEYS_FIRST: tl.constexpr):
    """``acc + part @ v``, or keys first ``acc + v @ part`` (v then ``[D, BLOCK_N]``)."""
    return dot(v, part, acc) if KEYS_FIRST else dot(part, v, acc)


@triton.jit
def probabilities_times_values(p, v, acc, TWIN: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """``acc + p @ v`` for FP32 probabilities p and V values in the dot's dtype. For BF16 V, p is
    split into three BF16 parts (`_three_parts`), so the tensor-core products are exact and the
    sum is p . v in FP32. KEYS_FIRST: the same transposed, ``acc + v @ p`` for ``v [D,
    BLOCK_N]`` and ``p [BLOCK_N, BLOCK_G]``.

    TWIN: the lower half of p's heads (rows, or keys first columns) repeats the upper half (the
    kernel's twin rows), so the parts share two dots instead of three: ``[p1; p2]`` and ``[p3;
    0]``. The upper heads of acc then hold the p1 and p3 terms and the lower ones the p2 terms,
    to be added by the caller."""
    if KEYS_FIRST:
        upper = (tl.arange(0, p.shape[1]) < p.shape[1] // 2)[None, :]
    else:
        upper = (tl.arange(0, p.shape[0]) < p.shape[0] // 2)[:, None]
    if v.dtype == tl.float32:
        if TWIN:
            p = tl.where(upper, p, 0.0)
        acc = _times(p, v, acc, KEYS_FIRST)
    else:
        p1, p2, p3 = _three_parts(p)
        if TWIN:
            acc = _times(tl.where(upper, p1, p2), v, acc, KEYS_FIRST)
            acc = _times(tl.where(upper, p3, tl.zeros_like(p3)), v, acc, KEYS_FIRST)
        else:
            acc = _times(p1, v, acc, KEYS_FIRST)
            acc = _times(p2, v, acc, KEYS_FIRST)
            acc = _times(p3, v, acc, KEYS_FIRST)
    return acc


@triton.jit
def context_step(
    k_pages, k_block_scale, k_amax, v_pages, v_block_scale, v_amax, table_row,
    n0, end, num_kv_heads, kv_head, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
    NVFP4: tl.constexpr, DTYPE: tl.constexpr,
):  # fmt: skip
    """One step of the walk over a context: which of tokens ``n0 .. n0 + BLOCK_N`` lie before
    ``end``, and their ``[BLOCK_N, D]`` K and V values (`_load_kv`; 0 past ``end``), found
    through the sequence's block table row (cache row = slot * K + kv head)."""
    t_N = n0 + tl.arange(0, BLOCK_N)
    ok_N = t_N < end
    page_N = tl.load(table_row + t_N // PAGE, mask=ok_N, other=0)
    rows_N = (page_N.to(tl.int64) * PAGE + t_N % PAGE) * num_kv_heads + kv_head
    k_ND = _load_kv(k_pages, k_block_scale, k_amax, rows_N, ok_N, D, NVFP4, DTYPE)
    v_ND = _load_kv(v_pages, v_block_scale, v_amax, rows_N, ok_N, D, NVFP4, DTYPE)
    return ok_N, k_ND, v_ND


# Compiled by Triton 3.6 for the H200, BF16 queries over NVFP4 pages give wrong outputs (most
# of them outside the bound, some NaN) whenever a dot's reduction over decoded K or V values is
# only 16 long: head dim 16 (q . k) or 16-token steps (p . v). Swept on one H200 over head dims
# 16-128, steps of 16-128 tokens and 1-8 warps: every other case is within the bound, BF16
# pages and FP32 queries at every size, and the interpreter at every size. The launcher refuses
# the failing sizes on every device rather than trust them anywhere.
MIN_BF16_NVFP4_REDUCTION = 32


def bf16_nvfp4_supported(head_dim: int, block_n: int) -> bool:
    """Whether BF16 queries over NVFP4 pages may run with this head dim and step length."""
    return min(head_dim, block_n) >= MIN_BF16_NVFP4_REDUCTION


def check_queries(name: str, q: torch.Tensor, dims: str) -> None:
    """Queries for the attention kernels: a contiguous 3-D bfloat16 or float32 tensor ``dims``
    on a device the kernels run on."""
    check_kernel_device(name, q)
    if q.dim() != 3 or q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"{name} must be a 3-D bfloat16 or float32 tensor {dims}; got {q.dtype} of shape "
            f"{tuple(q.shape)}"
        )
    check_contiguous(name, q)


def page_members(name: str, pages: KVPages) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values or codes as int32 words, block-scale bytes, row amaxes) for the kernel; a BF16
    cache passes its values thrice (the scale pointers are not read)."""
    if isinstance(pages, NVFP4Rows):
        for member, t in zip(("codes", "block_scale", "amax"), pages.tensors(), strict=True):
            check_contiguous(f"{name}.{member}", t)
        amax = pages.amax
        if amax.element_size() == 2:  # read as whole 4-byte words (`row_global_scales`)
            start = amax.data_ptr() - amax.untyped_storage().data_ptr()
            words_end = start + 4 * -(-amax.numel() // 2)
            if amax.data_ptr() % 4 or words_end > amax.untyped_storage().nbytes():
                raise ValueError(
                    f"{name}.amax must lie in whole 4-byte words of its storage (4-byte aligned, "
                    f"an even count or a spare value after it); got {amax.numel()} values at "
                    f"{amax.data_ptr():#x}"
                )
        if pages.codes.data_ptr() % 4:  # read as int32 words of 8 codes
            raise ValueError(
                f"{name}.codes must be 4-byte aligned; got address {pages.codes.data_ptr():#x}"
            )
        scales = pages.block_scale.view(torch.uint8)
        if pages.shape[-1] >= 64:  # read as int32 words of 4 scales (`_block_scales`)
            if scales.data_ptr() % 4:
                raise ValueError(
                    f"{name}.block_scale must be 4-byte aligned; got address {scales.data_ptr():#x}"
                )
            scales = scales.view(torch.int32)
        return pages.codes.view(torch.int32), scales, pages.amax
    if pages.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name} pages must be bfloat16, float16 or float32; got {pages.dtype}")
    check_contiguous(name, pages)
    return pages, pages, pages


def read_rows(pages: KVPages, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The K or V rows ``[*slots.shape, K, D]`` of cache ``slots`` in ``dtype``, as
    ``KVCache.read`` returns them: BF16 pages cast, NVFP4 rows `reference.dequantize`d."""
    if isinstance(pages, NVFP4Rows):
        rows = reference.rows_tensor(pages.map(lambda m: m.flatten(0, 1)[slots]))
        return reference.dequantize(rows, dtype)
    return pages.flatten(0, 1)[slots].to(dtype)
