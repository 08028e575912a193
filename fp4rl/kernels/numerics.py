"""The NVFP4 recipe's elementwise pieces as `@triton.jit` device functions.

Each function computes the same bits as a piece of `fp4rl.fp4.reference` (or of
`fp4rl.fp4.rounding` for the bracket), often by a cheaper exact route (docs/numerics.md lists
them); the kernels in this package are built from them. No kernel lives here. Rules that run
through the file:

- Divisions are IEEE-rounded: `tl.math.div_rn` (PTX `div.rn.f32`, no `.ftz`), or Markstein's
  correction from a correctly rounded reciprocal (`block_ratio`). Triton's plain `/` on FP32
  lowers to `div.full.f32` on NVIDIA GPUs, which is not.
- Products feed an addition only where the product is exact, so FMA contraction cannot change a
  result; the launchers disable it all the same, and explicit `tl.fma` is used where a single
  rounding is the point.
- Under Triton's interpreter, whose fp8 casts are emulated and whose bf16 cast truncates, E4M3
  and bf16 conversions are built from integer arithmetic; on the GPU the hardware converts
  (`cvt.rn.satfinite.e4m3x2.f32`, `cvt.rn.bf16.f32`), which is exact for what the kernels pass.

The kernels are bound by instruction issue and the integer/logic unit more than by memory, so
the per-element pieces lean on FP32 and multiply-add instructions (a magic-number FMA for E2M1
rounding, multiply-highs for shifts) rather than on chains of comparisons and shifts.
"""

import triton
import triton.language as tl

try:  # where Triton keeps libdevice moved between versions
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the installed Triton
    from triton.language.extra.cuda import libdevice

from fp4rl.fp4.format import E4M3_MAX, GLOBAL_SCALE_DIVISOR, MIN_GLOBAL_SCALE

_E4M3_MAX = tl.constexpr(E4M3_MAX)
_GLOBAL_SCALE_DIVISOR = tl.constexpr(GLOBAL_SCALE_DIVISOR)
_MIN_GLOBAL_SCALE = tl.constexpr(MIN_GLOBAL_SCALE)
_F32_INF_BITS = tl.constexpr(0x7F800000)
# torch's canonical NaN (`math.nan`): the reference's NaN global scales have exactly these bits.
_F32_NAN_BITS = tl.constexpr(0x7FC00000)
_F32_480_BITS = tl.constexpr(0x43F00000)  # 480.0: torch's e4m3fn cast gives NaN at and above it
_F32_2POW_M6_BITS = tl.constexpr(0x3C800000)  # 2**-6, the smallest normal E4M3 value
_F32_2POW_M126 = tl.constexpr(2.0**-126)  # the smallest normal FP32 value
# Kernels are decorated interpreted-or-compiled when this package is imported; so is this.
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def nan_like(v):
    """FP32 NaN with torch's bits (0x7FC00000), shaped like ``v``."""
    return tl.full(v.shape, _F32_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def max_nan(a, b):
    """``max(a, b)`` that returns NaN if either is NaN (PTX ``max.NaN.f32``, one instruction)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def is_finite(v):
    """True where FP32 ``v`` is finite (False for ±inf and NaN)."""
    return tl.abs(v) < float("inf")


@triton.jit
def global_scale_from_amax(amax, finite):
    """``amax / 2688`` in FP32; canonical NaN unless the group is ``finite``, 0 below
    MIN_GLOBAL_SCALE."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, _GLOBAL_SCALE_DIVISOR, tl.float32))
    s = tl.where(finite, s, nan_like(amax))
    return tl.where(s < _MIN_GLOBAL_SCALE, 0.0, s)


@triton.jit
def ratio_divisor(global_scale):
    """What `block_ratio` needs of a group's global scale, computed once per group:
    ``(S, d * S, 1 / (d * S))`` for ``d = 6 * global_scale`` (rounded to FP32) and S the power of
    two that puts ``d * S`` in [1, 2) (garbage, harmlessly, where d is 0, inf or NaN)."""
    d = global_scale * 6.0
    exponent = d.to(tl.int32, bitcast=True) & 0x7F800000
    scale = ((254 << 23) - exponent).to(tl.float32, bitcast=True)  # 2**(127 - e)
    d_scaled = d * scale  # exact
    one = tl.full(d.shape, 1.0, tl.float32)
    return scale, d_scaled, tl.math.div_rn(one, d_scaled)


@triton.jit
def block_ratio(block_amax, global_scale, scale, d_scaled, reciprocal):
    """``block_amax / (6 * global_scale)`` correctly rounded, 0 where the global scale is 0 or
    ``6 * global_scale`` overflows (shapes broadcast; the last three from `ratio_divisor`).

    On the GPU the division is Markstein's: with ``y = RN(1 / b)`` and a quotient ``q0`` within
    an ulp of ``a / b``, the residual ``a - b * q0`` is exact in one FMA and ``RN(q0 + r * y)`` is
    the correctly rounded quotient. Scaling a and b by the same power of two keeps every step
    in the normal range wherever the result matters (a ratio at or below 2**-10 rounds to the
    zero block scale however it is computed; one above 1024 saturates to 448). That is four
    multiply-adds per block instead of a full division. The interpreter divides directly.
    """
    if _INTERPRETED:
        quotient = tl.math.div_rn(
            block_amax, tl.where(global_scale == 0.0, 1.0, global_scale * 6.0)
        )
    else:
        a = block_amax * scale  # exact where it matters (see above)
        q0 = a * reciprocal
        residual = tl.fma(-d_scaled, q0, a)
        quotient = tl.where(q0 > 1024.0, q0, tl.fma(residual, reciprocal, q0))
    dead = (global_scale == 0.0) | (global_scale * 6.0 == float("inf"))
    return tl.where(dead, 0.0, quotient)


@triton.jit
def e4m3_rne_satfinite(v):
    """FP32 ``v`` -> float8_e4m3fn as ``v.clamp(max=448).to(float8_e4m3fn)``: (byte as int32,
    its FP32 value).

    Follows torch's conversion exactly: nearest, ties to even, subnormals kept, sign kept, and a
    magnitude that rounds past 448 (only negative ones can, after the clamp) or NaN -> 0x7F.
    """
    v = tl.where(v > _E4M3_MAX, _E4M3_MAX, v)  # a compare, so NaN passes through
    if not _INTERPRETED:
        # The GPU's cvt.rn.satfinite.e4m3x2.f32: nearest even, subnormals kept, NaN -> 0x7F.
        # It saturates rather than overflowing to NaN, which differs from torch only for
        # magnitudes past 464, i.e. negative inputs: the kernels pass non-negative ratios.
        fp8 = v.to(tl.float8e4nv)
        return fp8.to(tl.uint8, bitcast=True).to(tl.int32), fp8.to(tl.float32)
    bits = v.to(tl.int32, bitcast=True)
    sign = bits & -0x80000000
    # Clamping the magnitude bits at 480 maps NaN and overflow to 0x7F below and keeps the
    # integer rounding from overflowing int32.
    mag = tl.minimum(bits & 0x7FFFFFFF, _F32_480_BITS)
    # Normal range: drop 20 of the 23 mantissa bits, round half to even, rebias 127 -> 7.
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal_byte = (rounded >> 20) - ((127 - 7) << 3)
    normal_value = (rounded & -0x100000).to(tl.float32, bitcast=True)
    # Subnormal range, multiples of 2**-9: v * 2**9 is exact, adding 2**23 rounds it to an
    # integer (ties to even) held in the low mantissa bits. 8 units = byte 0x08 = 2**-6.
    units = mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0
    subnormal_byte = units.to(tl.int32, bitcast=True) - 0x4B000000
    subnormal_value = (units - 8388608.0) * 0.001953125  # both exact
    subnormal = mag < _F32_2POW_M6_BITS
    byte = tl.where(subnormal, subnormal_byte, normal_byte)
    value = tl.where(subnormal, subnormal_value, normal_value)
    value = tl.where(byte == 0x7F, nan_like(value), value)
    value = (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return byte | ((sign >> 24) & 0x80), value


@triton.jit
def e4m3_value(byte):
    """float8_e4m3fn byte (int32) -> FP32, exactly; 0x7F / 0xFF -> NaN. The GPU converts in
    hardware; the interpreter, whose fp8 casts are emulated, by integer arithmetic."""
    if not _INTERPRETED:
        return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    normal = (((exponent + (127 - 7)) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # mantissa * 2**-9, exact
    magnitude = tl.where(exponent == 0, subnormal, normal)
    magnitude = tl.where((byte & 0x7F) == 0x7F, nan_like(magnitude), magnitude)
    return (magnitude.to(tl.int32, bitcast=True) | ((byte & 0x80) << 24)).to(
        tl.float32, bitcast=True
    )


@triton.jit
def block_reciprocal(block_scale, global_scale):
    """``(live, 1 / (block_scale * global_scale))``: live blocks have a positive finite product.

    Dead blocks (zero or NaN scale) get reciprocal 1 and must be given zero codes.
    """
    denom = block_scale * global_scale
    live = denom > 0.0  # False for 0 and NaN
    one = tl.full(denom.shape, 1.0, tl.float32)
    return live, tl.math.div_rn(one, tl.where(live, denom, one))


@triton.jit
def sign_bit(y):
    """The E2M1 sign bit (0 or 8, int32) of FP32 ``y``: set for -0.0 too.

    ``bits >> 28`` as the high word of ``bits * 16``: a multiply runs on the FP32/IMAD pipe,
    leaving the integer pipe (the bottleneck here) to the rest.
    """
    return tl.umulhi(y.to(tl.uint32, bitcast=True), 16).to(tl.int32, bitcast=True) & 0x8


@triton.jit
def e2m1_round(y, cap):
    """``min(|y|, cap)`` rounded to the E2M1 grid, ties to even (FP32). ``cap`` is 6 for live
    blocks (saturation) and 0 for dead ones, which so get +0 whatever y is (NaN included: the
    GPU's min, like `tl.minimum` in the interpreter, returns the non-NaN operand).

    Adding ``2**(e + 22)`` (for ``|y|`` in ``[2**e, 2**(e + 1))``, at least ``2**22``) leaves the
    E2M1 spacing (0.5 below 2, 1 below 4, 2 up to 6) as the unit in the last place, so that one
    FP32 add rounds ``|y|`` onto the grid, ties to even, and subtracting it back is exact. The
    same decisions as `reference.e2m1_rne`'s boundary comparisons, in FP32 instructions, which
    the GPU issues at twice the rate of integer and compare instructions.
    """
    a = tl.minimum(tl.abs(y), cap)
    # The binade of max(a, 1): its exponent bits alone. Its product with 2**22 is exact, so each
    # multiply-add below rounds once, exactly as the separate add would (and the second is exact).
    binade = (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(
        tl.float32, bitcast=True
    )
    rounded = tl.fma(binade, 4194304.0, a)
    return tl.fma(binade, -4194304.0, rounded)


@triton.jit
def e2m1_bits(q, SHIFT: tl.constexpr):
    """For an E2M1 value ``q`` (FP32, signed): a uint32 with its magnitude index in bits
    ``SHIFT`` to ``SHIFT + 2``, its sign in bit ``SHIFT + 9`` and zeros elsewhere.

    ``q * 2**-126`` maps the grid onto FP32's smallest numbers, where E2M1's subnormal 0.5 lands
    on an FP32 subnormal and 1 on the smallest normal: bits 22-24 of the product are then the
    index (0, 0.5, 1, 1.5, 2, 3, 4, 6 -> 0..7). The product is exact and must not be flushed to
    zero (PTX ``mul.rn.f32``, no ``.ftz``).
    """
    bits = (q * _F32_2POW_M126).to(tl.uint32, bitcast=True)
    return shift_right(bits, 22 - SHIFT)


@triton.jit
def shift_right(u, N: tl.constexpr):
    """``u >> N`` for a uint32 whose low N bits are zero, as the high word of ``u * (2**(32 - N)
    + 1)``: the product's low word is u itself (no carry), and the multiply runs on the GPU's
    multiply-add units, which have the throughput to spare that its integer unit, the
    bottleneck of these kernels, does not (a plain shift by a power of two would go there)."""
    return tl.umulhi(u, tl.full(u.shape, (1 << (32 - N)) + 1, tl.uint32))


@triton.jit
def e2m1_index(magnitude):
    """Magnitude index (int32, 0..7) of a non-negative E2M1 value."""
    return e2m1_bits(magnitude, 0).to(tl.int32, bitcast=True)


@triton.jit
def code_byte(q_even, q_odd):
    """The packed byte of an (even, odd) pair of signed E2M1 values, as a uint32 below 256: even
    code in the low nibble, odd in the high one, each ``sign << 3 | index``."""
    # Indices at bits 0-2 and 4-6, signs at 9 and 13: the fields do not overlap, so + is |.
    w = e2m1_bits(q_even, 0) + e2m1_bits(q_odd, 4)
    # w < 2**14, so the low word of w * (2**26 + 1) does not carry: its high word is w >> 6,
    # which holds the signs at bits 3 and 7 and nothing above bit 7.
    signs = tl.umulhi(w, tl.full(w.shape, (1 << 26) + 1, tl.uint32))
    return select_0x77(w, signs)


@triton.jit
def select_0x77(a, b):
    """``(a & 0x77) | (b & ~0x77)`` for uint32: one LOP3 on the GPU. Written out, the compiler
    narrows ``~0x77`` to the bits it knows b can have and emits two instructions."""
    if _INTERPRETED:
        return (a & 0x77) | (b & 0xFFFFFF88)
    return tl.inline_asm_elementwise(
        "lop3.b32 $0, $1, $2, 0x77, 0xE4;", "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True, pack=1
    )


@triton.jit
def e2m1_value(code):
    """E2M1 code (int32, low nibble) -> FP32 built from bits: index i >= 2 is ``(i + 252) <<
    22`` (1, 1.5, 2, 3, 4, 6), index 1 is 0.5 (0x3F000000) and index 0 is ±0."""
    index = code & 0x7
    bits = tl.where(index < 2, index * 0x3F000000, (index + 252) << 22)
    return (bits | ((code & 0x8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_bracket(y):
    """Magnitude indices ``(lo, hi)`` (int32) of the E2M1 values just below and above ``|y|``
    (equal on the grid, both 7 from 6 up): the nearest one and, by the side it lies on, its
    neighbour."""
    a = tl.minimum(tl.abs(y), 6.0)
    magnitude = e2m1_round(a, 6.0)
    index = e2m1_index(magnitude)
    lo = tl.where(magnitude > a, index - 1, index)
    return lo, tl.where(magnitude < a, index + 1, index)


@triton.jit
def with_sign_of(magnitude, y, sign_mask):
    """``magnitude`` (non-negative FP32) with the sign bit of ``y`` (-0 included) where
    ``sign_mask`` is ``-0x80000000``, unsigned where it is 0 (dead blocks)."""
    bits = magnitude.to(tl.int32, bitcast=True) | (y.to(tl.int32, bitcast=True) & sign_mask)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scale_back(value, block_scale, global_scale):
    """``value * block_scale * global_scale``, left to right: two FP32 products (the first exact
    for an E2M1 value and an E4M3 scale)."""
    return (value * block_scale) * global_scale


@triton.jit
def exp_rn(v):
    """FP32 ``exp(v)`` as CUDA's accurate ``expf`` computes it (libdevice's), where ``tl.exp`` is
    a faster approximation; under the interpreter numpy's exp, which may differ in the last bit.
    """
    if _INTERPRETED:
        return tl.exp(v)
    return libdevice.exp(v)


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """FP32 ``v`` -> dtype, nearest even, as torch's ``.to(dtype)`` (NaN payloads aside).

    The GPU's casts round to nearest even; the interpreter's fp32 -> bf16 cast truncates, so
    there bf16 is rounded by integer arithmetic. NaN stays NaN; its payload is not specified.
    """
    if _INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        is_nan = (bits & 0x7FFFFFFF) > _F32_INF_BITS
        bits = tl.where(is_nan, 0x7FC00000, bits + 0x7FFF + ((bits >> 16) & 1))
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit
def e2m1_guided(y, guide, COMPACT: tl.constexpr):
    """E2M1 code of FP32 ``y`` picked from its bracket by the rollout (`fp4rl.fp4.rounding`).

    Full guidance (``guide`` = the rollout's code): the rollout's magnitude clamped into
    ``[lo, hi]``, or ``lo`` when the rollout's code has the other sign. Compact (``guide`` = its
    mantissa bit): the bracket member with that mantissa bit. The result has the sign of ``y``.
    """
    lo, hi = e2m1_bracket(y)
    sign = sign_bit(y)
    if COMPACT:
        magnitude = tl.where((lo & 1) == guide, lo, hi)
    else:
        toward = tl.where((guide & 0x8) == sign, guide & 0x7, 0)
        magnitude = tl.minimum(tl.maximum(toward, lo), hi)
    return magnitude | sign


@triton.jit
def dot(a, b, acc):
    """``acc + a @ b``, FP32 accumulation: BF16 operands on the tensor cores (exact products),
    FP32 operands as IEEE FP32.

    Under the interpreter the dot is numpy's matmul, which multiplies BF16 operands as their raw
    16-bit integers and sums FP32 in an order of its own that changes with the shapes (its BLAS
    blocking), so that a row's bits would depend on how many rows share the dot. There the
    operands are upcast exactly to FP64, whose products of BF16 (and FP32) values are exact and
    whose sum of one step is exact too unless its terms span some 2**29 (BF16) or more, and
    that sum is rounded once to FP32 and added: the same bits for every shape."""
    if _INTERPRETED:
        zero = tl.zeros(acc.shape, tl.float64)
        step = tl.dot(a.to(tl.float64), b.to(tl.float64), zero, input_precision="ieee")
        acc = acc + step.to(tl.float32)
    elif a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
