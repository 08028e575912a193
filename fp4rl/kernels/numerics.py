"""The NVFP4 recipe's elementwise pieces as `@triton.jit` device functions.

Each function is the bit-exact twin of a piece of `fp4rl.fp4.reference` (or of
`fp4rl.fp4.rounding` for the bracket); the kernels in this package are built from them. No
kernel lives here. Two rules run through the file:

- Divisions use `tl.math.div_rn`. Triton's plain `/` on FP32 lowers to `div.full.f32` on NVIDIA
  GPUs, which is not IEEE-rounded; `div_rn` lowers to `div.rn.f32` (no `.ftz`), as the reference's
  true FP32 division needs.
- E4M3 and E2M1 encodings are built from FP32 comparisons and integer bit arithmetic, never from
  Triton's fp8 casts, whose rounding and NaN handling may differ between the interpreter and the
  GPU. Multiplications here never feed an addition except where the product is exact, so FMA
  contraction cannot change a result; the launchers disable it all the same.
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
_BF16_NAN_BITS = tl.constexpr(0x7FC0)  # what torch's fp32 -> bf16 cast makes of any NaN
_F16_NAN_BITS = tl.constexpr(0x7E00)  # and its fp32 -> fp16 cast of a positive NaN
_F32_480_BITS = tl.constexpr(0x43F00000)  # 480.0: torch's e4m3fn cast gives NaN at and above it
_F32_2POW_M6_BITS = tl.constexpr(0x3C800000)  # 2**-6, the smallest normal E4M3 value


@triton.jit
def abs_bits(x):
    """Bits of ``|x|`` as int32 for FP32 ``x``: they order like ``|x|``, with NaN above +inf.

    Max-reducing these instead of floats keeps NaN: the GPU's `max.f32` drops a NaN operand.
    """
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def nan_like(v):
    """FP32 NaN with torch's bits (0x7FC00000), shaped like ``v``."""
    return tl.full(v.shape, _F32_NAN_BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def is_nonfinite(bits):
    """For bits from `abs_bits`: True for ±inf and NaN."""
    return bits >= _F32_INF_BITS


@triton.jit
def global_scale_from_amax(amax_bits):
    """``amax / 2688`` in FP32; canonical NaN for a non-finite amax, 0 below MIN_GLOBAL_SCALE."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    s = tl.math.div_rn(amax, tl.full(amax.shape, _GLOBAL_SCALE_DIVISOR, tl.float32))
    s = tl.where(is_nonfinite(amax_bits), nan_like(amax), s)
    return tl.where(s < _MIN_GLOBAL_SCALE, 0.0, s)


@triton.jit
def block_ratio(block_amax_bits, global_scale):
    """``block_amax / (6 * global_scale)``, 0 where the global scale is 0 (shapes broadcast)."""
    block_amax = block_amax_bits.to(tl.float32, bitcast=True)
    zero = global_scale == 0.0
    ratio = tl.math.div_rn(block_amax, tl.where(zero, 1.0, global_scale * 6.0))
    return tl.where(zero, 0.0, ratio)


@triton.jit
def e4m3_rne_satfinite(v):
    """FP32 ``v`` -> float8_e4m3fn byte (int32) as ``v.clamp(max=448).to(float8_e4m3fn)``.

    Follows torch's conversion exactly: nearest, ties to even, subnormals kept, sign kept, and a
    magnitude that rounds past 448 (only negative ones can, after the clamp) or NaN -> 0x7F.
    """
    v = tl.where(v > _E4M3_MAX, _E4M3_MAX, v)  # a compare, so NaN passes through
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    # Clamping the magnitude bits at 480 maps NaN and overflow to 0x7F below and keeps the
    # integer rounding from overflowing int32.
    mag = tl.minimum(bits & 0x7FFFFFFF, _F32_480_BITS)
    # Normal range: drop 20 of the 23 mantissa bits, round half to even, rebias 127 -> 7.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # Subnormal range, multiples of 2**-9: v * 2**9 is exact, adding 2**23 rounds it to an
    # integer (ties to even) and subtracting 2**23 is exact. 8 units = byte 0x08 = 2**-6.
    units = (mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0) - 8388608.0
    byte = tl.where(mag < _F32_2POW_M6_BITS, units.to(tl.int32), normal)
    return byte | sign


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
    """The E2M1 sign bit (0 or 8, int32) of FP32 ``y``: set for -0.0 too."""
    return (y.to(tl.int32, bitcast=True) >> 28) & 0x8


@triton.jit
def e2m1_rne(y):
    """FP32 ``y`` -> E2M1 code (int32, low nibble): ties to even, saturating, -0 kept.

    The magnitude index counts the boundaries passed; ties at 0.75, 1.75, 3.5 go up (>=), the
    others down (>).
    """
    a = tl.abs(y)
    index = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return index | sign_bit(y)


@triton.jit
def e2m1_value(code):
    """E2M1 code (int32, low nibble) -> FP32 built from bits: 1.m * 2**(e - 1), 0.5, or ±0."""
    index = code & 0x7
    exponent = index >> 1
    mantissa = index & 0x1
    bits = tl.where(index >= 2, ((126 + exponent) << 23) | (mantissa << 22), 0)
    bits = tl.where(index == 1, 0x3F000000, bits)  # 0.5
    return (bits | ((code & 0x8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_bracket(y):
    """Magnitude indices ``(lo, hi)`` (int32) of the E2M1 values just below and above ``|y|``."""
    a = tl.abs(y)
    lo = (
        (a >= 0.5).to(tl.int32)
        + (a >= 1.0).to(tl.int32)
        + (a >= 1.5).to(tl.int32)
        + (a >= 2.0).to(tl.int32)
        + (a >= 3.0).to(tl.int32)
        + (a >= 4.0).to(tl.int32)
        + (a >= 6.0).to(tl.int32)
    )
    hi = lo + ((a > e2m1_value(lo)) & (lo < 7)).to(tl.int32)
    return lo, hi


@triton.jit
def dequantize_values(code, block_scale, global_scale):
    """``e2m1_value(code) * block_scale * global_scale``, left to right, two FP32 products."""
    return (e2m1_value(code) * block_scale) * global_scale


@triton.jit
def upcast_exact(x):
    """bf16 / fp16 / fp32 -> FP32, exactly. bf16 goes by bits: the interpreter's bf16 -> fp32
    cast mangles subnormals (the GPU's is a plain shift, like this)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def cast_like_torch(v, dtype: tl.constexpr):
    """FP32 ``v`` -> dtype as torch's ``.to(dtype)`` on the CPU: nearest even, canonical NaN.

    bf16 is rounded here by integer arithmetic because the interpreter's fp32 -> bf16 cast
    truncates; the GPU's own cast rounds to nearest even like this. A GPU NaN is 0x7FFFFFFF,
    torch's is 0x7FC00000 (and 0x7FC0 / 0x7E00 once cast), so NaN is written explicitly.
    """
    is_nan = abs_bits(v) > _F32_INF_BITS
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = tl.where(is_nan, _BF16_NAN_BITS << 16, bits + 0x7FFF + ((bits >> 16) & 1))
        out = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float16:
        nan = tl.full(v.shape, _F16_NAN_BITS, tl.int16).to(tl.float16, bitcast=True)
        out = tl.where(is_nan, nan, v.to(tl.float16))
    else:
        out = tl.where(is_nan, nan_like(v), v)
    return out


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
