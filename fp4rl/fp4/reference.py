"""The NVFP4 recipe in plain PyTorch: this module is the specification.

Every kernel in `fp4rl.kernels` must reproduce these functions bit for bit (codes, block scales,
global scales, dequantized values). All arithmetic is FP32, in this order:

1. ``amax = max |x|`` over the scaling group (the input is upcast exactly from BF16/FP16).
2. ``global_scale = amax / 2688`` (a true FP32 division). A non-finite amax makes it NaN: the
   group is *poisoned*; a result below ``MIN_GLOBAL_SCALE`` (all-zero groups included) is 0.
3. ``block_scale = e4m3_rne_satfinite(block_amax / (6 * global_scale))`` per 16 values along K:
   ``6 * global_scale`` is rounded to FP32 first, the quotient is clamped to 448 and rounded to
   the nearest E4M3 value, ties to even, subnormals kept.
4. ``codes = e2m1_rne(x * (1 / (f32(block_scale) * global_scale)))``: product, then reciprocal,
   then multiply, each rounded to FP32. Ties go to the even mantissa; |v| > 6 saturates; a
   negative value that rounds to zero keeps its sign bit.
5. ``dequantized = e2m1_value(code) * f32(block_scale) * global_scale`` (left to right; the first
   product is exact).

Zero and non-finite groups: a group with ``global_scale == 0`` gets zero codes and zero block
scales; a block with ``block_scale == 0`` gets zero codes. A caller-given global scale is
flushed the same way below ``MIN_GLOBAL_SCALE``; a negative or NaN one poisons its group. A
poisoned group (any NaN or ±Inf in it, or a negative or NaN caller-given scale) gets a NaN global
scale, NaN block scales (byte 0x7F) and zero codes, so every value of it dequantizes to NaN and
never to a plausible finite number.
"""

from __future__ import annotations

import math

import torch

from fp4rl.fp4.format import (
    BLOCK_SIZE,
    E2M1_VALUES,
    E4M3_MAX,
    GLOBAL_SCALE_DIVISOR,
    MAGNITUDE_MASK,
    MIN_GLOBAL_SCALE,
    SIGN_BIT,
)
from fp4rl.fp4.tensor import SUPPORTED_DTYPES, NVFP4Rows, NVFP4Tensor

Scaling = str | int  # "tensor", "row", or the number of trailing dims sharing one global scale


# ---- scalar recipe pieces (elementwise, FP32 in, FP32/uint8 out) -------------------------


def e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    """Round FP32 ``v`` to the nearest E2M1 code (uint8 in the low nibble).

    The magnitude index counts the boundaries that ``|v|`` has passed; a boundary whose tie goes
    up counts when ``|v| >=`` it, one whose tie goes down only when ``|v| >`` it.
    """
    a = v.abs()
    index = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    return index | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes (uint8, low nibble) to FP32 values, keeping the sign of zero."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & MAGNITUDE_MASK).long()]
    return torch.where((codes & SIGN_BIT) != 0, -magnitude, magnitude)


def e4m3_rne_satfinite(v: torch.Tensor) -> torch.Tensor:
    """Round non-negative FP32 ``v`` to float8_e4m3fn: nearest, ties to even, clamp to 448.

    NaN stays NaN (byte 0x7F).
    """
    return v.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)


def global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 2688`` in FP32; NaN for a non-finite amax, 0 below ``MIN_GLOBAL_SCALE``.

    The divisor is a tensor on amax's device: on CUDA, torch divides by a Python scalar as a
    multiplication by its reciprocal, which is not the IEEE quotient the kernels compute."""
    amax = amax.float()
    s = amax / torch.full_like(amax, GLOBAL_SCALE_DIVISOR)
    s = torch.where(torch.isfinite(s), s, torch.full_like(s, math.nan))
    return torch.where(s < MIN_GLOBAL_SCALE, torch.zeros_like(s), s)


def block_scale_ratio(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The unrounded block scale ``block_amax / (6 * global_scale)`` in FP32 (0 where the global
    scale is 0), which `block_scale_from_amax` rounds to E4M3."""
    ratio = block_amax / (global_scale * 6.0)
    # A zero global scale (flushed or all-zero group) would divide by zero: its blocks are zero.
    return torch.where(global_scale == 0, torch.zeros_like(ratio), ratio)


def block_scale_from_amax(block_amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales from FP32 block amaxes and their (broadcast) global scales."""
    return e4m3_rne_satfinite(block_scale_ratio(block_amax, global_scale))


def scaled_values(
    x_blocks: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * (1 / (f32(sf) * s))`` for ``x_blocks [..., nb, 16]``; also a mask of live blocks.

    A block is live when its denominator is a positive finite number; dead blocks (zero or NaN
    scale) must get zero codes.
    """
    denom = block_scale.float() * global_scale  # [..., nb]
    live = denom > 0  # False for 0 and NaN
    recip = 1.0 / torch.where(live, denom, torch.ones_like(denom))
    return x_blocks.float() * recip.unsqueeze(-1), live


# ---- packing ------------------------------------------------------------------------------


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes (low nibble) -> ``[..., K/2]`` bytes, element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` bytes -> ``[..., K]`` codes."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# KV pages (`NVFP4Rows`) keep the codes of each 4-byte word (elements 8w..8w+7, element 8w + j's
# magnitude in nibble j, as `pack_e2m1` packs them) with the eight sign bits moved: nibble i's
# top bit holds the sign of element ``PAGE_SIGNS[i]``. The signs of elements 0-3 are then the
# top bits of the word's four bytes, and those of elements 4-7 the top bits of the bytes of the
# word shifted left by a nibble, which is where the decoding kernels' byte-permute lookup flips
# them (`fp4rl.kernels.fragments.look_up`): two instructions fewer per 8 values than picking
# them out of their nibbles. The codes are the recipe's; only their bits sit elsewhere.
PAGE_SIGNS = (4, 0, 5, 1, 6, 2, 7, 3)


def _with_signs(nibbles: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., W, 8]`` with each one's sign bit taken from ``signs``, packed."""
    return pack_e2m1(((nibbles & MAGNITUDE_MASK) | (signs & SIGN_BIT)).flatten(-2))


# Slices, not index lists: no index tensor travels to the device, so a CUDA graph can capture
# `rows_tensor` and `quantize_into` (KVCache.read, the benchmarks' gather baseline).
def page_codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes ``[..., K/2]`` (K % 16 == 0) in the KV pages' layout (`PAGE_SIGNS`)."""
    nibbles = unpack_e2m1(packed).unflatten(-1, (-1, 8))
    return _with_signs(nibbles, torch.stack((nibbles[..., 4:], nibbles[..., :4]), -1).flatten(-2))


def codes_of_pages(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `page_codes`: KV pages' codes packed as `pack_e2m1` packs them (element
    j's sign from nibble 2j + 1, or 2j - 8)."""
    nibbles = unpack_e2m1(packed).unflatten(-1, (-1, 8))
    return _with_signs(nibbles, torch.cat((nibbles[..., 1::2], nibbles[..., 0::2]), -1))


# ---- scaling groups -----------------------------------------------------------------------


def check_input(x: torch.Tensor) -> None:
    """Raise for inputs no NVFP4 path accepts: wrong dtype, no last dim, K % 16 != 0."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"NVFP4 quantization takes bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE or x.shape[-1] == 0:
        raise ValueError(
            f"NVFP4 needs a last dimension that is a positive multiple of {BLOCK_SIZE}; "
            f"got shape {tuple(x.shape)}"
        )


def group_ndim(x: torch.Tensor, scaling: Scaling) -> int:
    """Resolve ``scaling`` to the number of trailing dims that share one global scale."""
    if scaling == "tensor":
        return x.dim()
    if scaling == "row":
        return 1
    if isinstance(scaling, int) and not isinstance(scaling, bool) and 1 <= scaling <= x.dim():
        return scaling
    raise ValueError(
        f"scaling must be 'tensor', 'row' or an int in [1, {x.dim()}] for shape "
        f"{tuple(x.shape)}; got {scaling!r}"
    )


def global_scale_shape(shape: torch.Size, ndim: int) -> tuple[int, ...]:
    return (*shape[: len(shape) - ndim], *([1] * ndim))


def resolve_global_scale(
    x: torch.Tensor, scaling: Scaling, global_scale: torch.Tensor | None
) -> torch.Tensor:
    """The FP32 global scale of each group, shaped ``shape[:-g] + (1,) * g``.

    Computed from ``x`` when ``global_scale`` is None; otherwise the caller's scale (for groups
    that span several tensors, such as an expert's W1 and W3) is checked and broadcast. Only its
    dtype and shape are checked on the host; its values never leave the device (no sync, so a
    quantize with a given scale can be captured in a CUDA graph).
    """
    g = group_ndim(x, scaling)
    shape = global_scale_shape(x.shape, g)
    if global_scale is None:
        amax = x.float().abs().amax(dim=tuple(range(x.dim() - g, x.dim())), keepdim=True)
        return global_scale_from_amax(amax)
    if global_scale.dtype != torch.float32:
        raise TypeError(f"global_scale must be float32, got {global_scale.dtype}")
    try:
        s = global_scale.expand(shape).contiguous()
    except RuntimeError as err:
        raise ValueError(
            f"global_scale of shape {tuple(global_scale.shape)} does not broadcast to the "
            f"{shape} that scaling={scaling!r} gives for x of shape {tuple(x.shape)}"
        ) from err
    # A negative scale (or a NaN of either sign) fails closed, as non-finite input does: the
    # canonical NaN poisons the group (NaN block scales, zero codes). -0 is not negative.
    s = torch.where((s < 0) | s.isnan(), torch.full_like(s, math.nan), s)
    # The same flush as for computed scales: a tiny scale would make 1 / (sf * s) infinite.
    return torch.where(s < MIN_GLOBAL_SCALE, torch.zeros_like(s), s)


def amax_of(*tensors: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Joint FP32 amax of several same-leading-shape tensors over ``dims`` (keepdim)."""
    return torch.stack([t.float().abs().amax(dim=dims, keepdim=True) for t in tensors]).amax(0)


# ---- quantize / dequantize ----------------------------------------------------------------


def quantize(
    x: torch.Tensor, *, scaling: Scaling = "tensor", global_scale: torch.Tensor | None = None
) -> NVFP4Tensor:
    """Quantize ``x [..., K]`` to NVFP4 with round-to-nearest-even (steps 1-4 above)."""
    check_input(x)
    s = resolve_global_scale(x, scaling, global_scale)
    x_blocks = x.unflatten(-1, (-1, BLOCK_SIZE))  # [..., nb, 16]
    block_amax = x_blocks.float().abs().amax(-1)  # [..., nb]
    block_scale = block_scale_from_amax(block_amax, s)
    # A caller-given global scale does not see x: poison the blocks that hold non-finite values.
    bad = ~torch.isfinite(x_blocks).all(-1)
    block_scale = torch.where(bad, torch.full_like(block_scale, math.nan), block_scale)
    y, live = scaled_values(x_blocks, block_scale, s)
    codes = torch.where(live.unsqueeze(-1), e2m1_rne(y), torch.zeros_like(y, dtype=torch.uint8))
    return NVFP4Tensor(codes=pack_e2m1(codes.flatten(-2)), block_scale=block_scale, global_scale=s)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``e2m1_value(code) * f32(block_scale) * global_scale`` in FP32, then cast to ``dtype``."""
    values = e2m1_value(unpack_e2m1(t.codes)).unflatten(-1, (-1, BLOCK_SIZE))
    scaled = values * t.block_scale.float().unsqueeze(-1)  # exact: E2M1 x E4M3 fits in FP32
    return (scaled.flatten(-2) * t.global_scale).to(dtype)


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` of each row, ``[..., 1]`` in x's dtype (exact: it is one of x's magnitudes),
    the canonical NaN where a row is not finite: `global_scale_from_amax` makes of it the row's
    global scale under ``scaling="row"``."""
    amax = x.abs().amax(-1, keepdim=True)
    return torch.where(torch.isfinite(amax), amax, torch.full_like(amax, math.nan))


def rows_tensor(rows: NVFP4Rows) -> NVFP4Tensor:
    """The `NVFP4Tensor` of rows kept with their amax: the codes packed back (`codes_of_pages`)
    and each global scale recomputed from the amax, bit for bit what `quantize` gave."""
    return NVFP4Tensor(
        codes_of_pages(rows.codes), rows.block_scale, global_scale_from_amax(rows.amax)
    )


def quantize_into(x_TKD: torch.Tensor, pages: NVFP4Rows, slots_T: torch.Tensor) -> NVFP4Tensor:
    """``quantize(x_TKD, scaling="row")`` stored as rows ``slots_T`` of ``pages`` flattened over
    their first two dims (a paged cache's ``[N, P, ...]``: slot ``n * P + p``), with each row's
    `row_amax` in place of its global scale and the codes in the pages' layout (`page_codes`).
    x must have the dtype of the pages' amaxes, so that they hold each amax exactly. Returns
    the quantized rows (the site record of ``x`` rounded to nearest)."""
    if x_TKD.dtype != pages.amax.dtype:
        raise ValueError(
            f"x_TKD is {x_TKD.dtype} but the pages keep {pages.amax.dtype} amaxes; a row's amax "
            "is kept in the row's own dtype"
        )
    t = quantize(x_TKD, scaling="row")
    values = (page_codes(t.codes), t.block_scale, row_amax(x_TKD))
    for page, value in zip(pages.tensors(), values, strict=True):
        page.flatten(0, 1)[slots_T] = value
    return t
