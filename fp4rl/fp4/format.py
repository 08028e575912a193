"""NVFP4 format constants: the E2M1 code layout, the E4M3 block-scale range, the block size.

A 4-bit E2M1 code is ``sign(1) | exponent(2) | mantissa(1)``; its 3-bit magnitude index
``i = exponent << 1 | mantissa`` selects one of ``E2M1_VALUES``. Two codes share a byte: element
``2j`` in the low nibble, element ``2j + 1`` in the high nibble.
"""

BLOCK_SIZE = 16  # values per E4M3 block scale, along the reduction (last) dimension
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude index -> value
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# global_scale = amax / GLOBAL_SCALE_DIVISOR maps a group's amax onto E2M1_MAX * E4M3_MAX.
GLOBAL_SCALE_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688.0

SIGN_BIT = 0x8
MANTISSA_BIT = 0x1
MAGNITUDE_MASK = 0x7
E4M3_NAN_BYTE = 0x7F  # the float8_e4m3fn NaN pattern that marks a non-finite block or group

# Round-to-nearest boundaries between consecutive magnitudes, and whether an exact tie there
# rounds up (to the odd->even neighbour above) or down. Ties go to the even mantissa bit:
# 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0.
E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_TIE_UP = (False, True, False, True, False, True, False)

# Global scales below this are flushed to zero (the group quantizes to zero codes and zero
# scales). It keeps every product block_scale * global_scale (block_scale >= 2**-9) a normal
# FP32 number, so its reciprocal is finite and no kernel depends on denormal handling. It only
# affects groups whose amax is below 2688 * 2**-117, about 1.6e-32.
MIN_GLOBAL_SCALE = 2.0**-117
