"""Int32 words of 8 packed E2M1 codes decoded in registers, exactly: the pieces the expert
GEMMs' programs and the paged attention's share, and the KV pages' layout of the sign bits
(which `tiles` writes).

A code's magnitude index moved to FP32 bits 22-24 is exactly e2m1 * 2**-126 (0.5 lands on a
subnormal). The 2**126 comes back split between the two scales: block scales times 2**118
stay finite (448 * 2**118 < 2**127), global scales times 2**8 stay finite below 2**120 (every
scale quantize computes from finite input is below 2**117). Both products are exact, and
(code * sf * 2**-118) * (s * 2**8) is the same real number as (code * sf) * s, so it rounds
to the same FP32 value: the reference's bits (docs/numerics.md, "Dequantize").
"""

import triton
import triton.language as tl

BLOCK_SCALE_BIAS = tl.constexpr(2.0**118)
GLOBAL_SCALE_BIAS = tl.constexpr(2.0**8)
_CODE_BITS = tl.constexpr(0x81C00000 - (1 << 32))  # FP32 sign bit and bits 22-24, as int32


@triton.jit
def packed_code(words, J: tl.constexpr):
    """Code J of each int32 word of 8 packed codes (element ``8 * word + J``) as ``e2m1 *
    2**-126`` (FP32): the code moved to the top of the word, then an arithmetic shift by 6 that
    copies its sign over bits 25-31 and lands its index on bits 22-24, then one mask."""
    return (((words << (28 - 4 * J)) >> 6) & _CODE_BITS).to(tl.float32, bitcast=True)


_SIGN_BIT = tl.constexpr(-(1 << 31))  # FP32's sign bit, as int32


@triton.jit
def page_code(words, J: tl.constexpr):
    """`packed_code` of KV pages' words, whose sign bits sit elsewhere (`reference.PAGE_SIGNS`):
    element J's sign is the top bit of nibble 2J + 1 (J < 4) or 2J - 8, element J's magnitude
    index stays in nibble J."""
    SIGN: tl.constexpr = 8 * J + 7 - 36 * (J // 4)  # the sign's bit in the word
    magnitude = ((words >> (4 * J)) & 7) << 22
    return (magnitude | ((words << (31 - SIGN)) & _SIGN_BIT)).to(tl.float32, bitcast=True)


@triton.jit
def _page_sign(words, I: tl.constexpr):
    """Nibble I's top bit in KV pages' layout: the sign of element ``PAGE_SIGNS[I]``."""
    J: tl.constexpr = I // 2 + 4 * (1 - I % 2)  # reference.PAGE_SIGNS[I]
    return ((words >> (4 * J + 3)) & 1) << (4 * I + 3)


@triton.jit
def page_words(words):
    """Int32 words of 8 packed codes with their sign bits moved to the KV pages' places
    (`reference.page_codes`)."""
    moved = words & 0x77777777
    for i in tl.static_range(8):
        moved |= _page_sign(words, i)
    return moved


# Pairs: codes J and J + 4 of a word sit 16 bits apart, so two shifts and two masks place both
# at once as the halves of a BF16x2 word (BF16 has FP32's exponent, so the same bit position
# gives the same e2m1 * 2**-126), and one `mul.rn.bf16x2` by the biased block scale gives both
# exact products e2m1 * sf * 2**-8 (at most 6 significant bits, at least 2**-18). The global
# scale then goes on the FP32 accumulator, times 2**8: `moe_gemm`'s SCALE_AFTER.
# Compiled only: the interpreter runs no PTX, and decodes one code at a time to the same values.
PAIRS = tl.constexpr(not triton.knobs.runtime.interpret)
_PAIR_MAGNITUDE_BITS = tl.constexpr(0x01C001C0)
_PAIR_SIGN_BITS = tl.constexpr(0x80008000 - (1 << 32))


@triton.jit
def packed_pair(words, J: tl.constexpr):
    """Codes J (low half) and J + 4 (high half) of each int32 word of 8 packed codes, J < 4, as
    a BF16x2 word (int32) of ``e2m1 * 2**-126`` each."""
    # J >= 2 shifts right, arithmetically: the copied sign bits are masked off.
    magnitude = words << (6 - 4 * J) if J <= 1 else words >> (4 * J - 6)
    return (magnitude & _PAIR_MAGNITUDE_BITS) | ((words << (12 - 4 * J)) & _PAIR_SIGN_BITS)


@triton.jit
def bf16x2_bits(v):
    """FP32 ``v`` that BF16 holds exactly -> its BF16 bits in both halves of an int32."""
    bits = (v.to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    return bits | (bits << 16)


@triton.jit
def bf16x2_halves(pair, scale):
    """The two BF16 halves (low, high) of ``pair * scale``, BF16x2 words, each product rounded
    once to BF16 (exact for the products `packed_pair` and block scales make). GPU only."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r",
        [pair, scale],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=1,
    )
