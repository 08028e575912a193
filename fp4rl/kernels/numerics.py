"""The NVFP4 recipe's elementwise pieces as `@triton.jit` device functions.

Each function is the bit-exact twin of a piece of `fp4rl.fp4.reference` (or of
`fp4rl.fp4.rounding` for the bracket); the kernels in this package are built from them. No
kernel lives here. Two rules run through the file:

- Divisions use `tl.math.div_rn`. Triton's plain `/` on FP32 lowers to `div.full.f32` on NVIDIA
  GPUs, which is not IEEE-rounded; `div_rn` lowers to `div.rn.f32` (no `.ftz`), as the reference's
  true FP32 division needs.
- E4M3 and E2M1 encodings are built from FP32 arithmetic and integer bit operations, never from
  Triton's fp8 casts, whose rounding and NaN handling may differ between the interpreter and the
  GPU. Multiplications here never feed an addition except where the product is exact, so FMA
  contraction cannot change a result; the launchers disable it all the same.

The kernels are limited by integer/compare throughput more than by memory, so the per-element
pieces (`e2m1_round`, `e2m1_value`) lean on one FP32 add with a magic constant rather than on
chains of comparisons, and the GPU path uses the hardware casts where they are exact.
"""

import triton
import triton.language as tl

from fp4rl.fp4.format import E4M3_MAX, GLOBAL_SCALE_DIVISOR, MIN_GLOBAL_SCALE

_E4M3_MAX = tl.constexpr(E4M3_MAX)
_GLOBAL_SCALE_DIVISOR = tl.constexpr(GLOBAL_SCALE_DIVISOR)
_MIN_GLOBAL_SCALE = tl.constexpr(MIN_GLOBAL_SCALE)
_F32_INF_BITS = tl.constexpr(0x7F800000)
# torch's canonical NaN (`math.nan`): the reference's NaN global scales have exactly these bits.
_F32_NAN_BITS = tl.constexpr(0x7FC00000)
_F32_480_BITS = tl.constexpr(0x43F00000)  # 480.0: torch's e4m3fn cast gives NaN at and above it
_F32_2POW_M6_BITS = tl.constexpr(0x3C800000)  # 2**-6, the smallest normal E4M3 value
# Kernels are decorated interpreted-or-compiled when this package is imported; so is this.
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


@triton.jit
def nan_like(v):
    """FP32 NaN with torch's bits (0x7FC00000), shaped like ``v``."""
    return tl.full(v.shape, _F32_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def is_nonfinite(bits):
    """For the int32 bits of a non-negative FP32 value: True for +inf and NaN."""
    return bits >= _F32_INF_BITS


@triton.jit
def global_scale_from_amax(amax, finite):
    """``amax / 2688`` in FP32; canonical NaN unless the group is ``finite``, 0 below
    MIN_GLOBAL_SCALE."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, _GLOBAL_SCALE_DIVISOR, tl.float32))
    s = tl.where(finite, s, nan_like(amax))
    return tl.where(s < _MIN_GLOBAL_SCALE, 0.0, s)


@triton.jit
def poison(x):
    """``x * 0``: ±0 for finite x, NaN for ±inf and NaN. Summed over a group it flags a
    non-finite value with FP32 multiply-adds, which the GPU issues at twice the rate of the
    integer and compare instructions a bit test needs (and `max.f32` would drop a NaN)."""
    return x * 0.0


@triton.jit
def block_ratio(block_amax, global_scale):
    """``block_amax / (6 * global_scale)``, 0 where the global scale is 0 (shapes broadcast)."""
    zero = global_scale == 0.0
    ratio = tl.math.div_rn(block_amax, tl.where(zero, 1.0, global_scale * 6.0))
    return tl.where(zero, 0.0, ratio)


@triton.jit
def e4m3_rne_satfinite(v):
    """FP32 ``v`` -> float8_e4m3fn as ``v.clamp(max=448).to(float8_e4m3fn)``: (byte as int32,
    its FP32 value).

    Follows torch's conversion exactly: nearest, ties to even, subnormals kept, sign kept, and a
    magnitude that rounds past 448 (only negative ones can, after the clamp) or NaN -> 0x7F.
    """
    v = tl.where(v > _E4M3_MAX, _E4M3_MAX, v)  # a compare, so NaN passes through
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
    """float8_e4m3fn byte (int32) -> FP32, by integer arithmetic; 0x7F / 0xFF -> NaN."""
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
def e2m1_round(y):
    """Round FP32 ``|y|`` to E2M1, ties to even, saturating at 6: (magnitude index, magnitude).

    Adding ``2**(e + 22)`` (for ``|y|`` in ``[2**e, 2**(e + 1))``, at least ``2**22``) leaves the
    E2M1 spacing (0.5 below 2, 1 below 4, 2 up to 6) as the unit in the last place, so that one
    FP32 add rounds ``|y|`` onto the grid, ties to even; its low bits count grid steps. The same
    decisions as `reference.e2m1_rne`'s boundary comparisons, in a few instructions, most of
    them FP32 ones, which the GPU issues at twice the rate of integer and compare instructions.
    """
    a = tl.minimum(tl.abs(y), 6.0)  # saturation (the GPU's min also takes NaN to 6)
    # The binade of max(a, 1) (its exponent bits alone) times 2**22, exactly.
    binade = (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(
        tl.float32, bitcast=True
    )
    magic = binade * 4194304.0
    rounded = a + magic
    # index = steps in this binade's spacing + 0, 2 or 4 for [0, 2), [2, 4), [4, 8)
    #       = bits(rounded) - bits(magic) + (bits(binade) >> 22) - 254; the 254 units of the
    # last place are folded into a second exact product, bits(binade * (2**22 + 127)).
    start = binade * 4194431.0
    index = rounded.to(tl.int32, bitcast=True) - start.to(tl.int32, bitcast=True)
    index += binade.to(tl.int32, bitcast=True) >> 22
    return index, rounded - magic  # the difference is exact


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
    index, magnitude = e2m1_round(y)
    a = tl.minimum(tl.abs(y), 6.0)
    lo = tl.where(magnitude > a, index - 1, index)
    return lo, tl.where(magnitude < a, index + 1, index)


@triton.jit
def with_sign_of(magnitude, y):
    """``magnitude`` (non-negative FP32) with the sign bit of ``y``, -0 included."""
    bits = magnitude.to(tl.int32, bitcast=True) | (y.to(tl.int32, bitcast=True) & -0x80000000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scale_back(value, block_scale, global_scale):
    """``value * block_scale * global_scale``, left to right: two FP32 products (the first exact
    for an E2M1 value and an E4M3 scale)."""
    return (value * block_scale) * global_scale


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
