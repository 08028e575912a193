"""NVFP4 codes -> compact guidance's mantissa bits: `rounding.compact` in one launch.

A code's mantissa bit is bit 0 of its nibble, and a byte of packed bits holds elements
``8j .. 8j + 7``: the eight nibbles of the ``j``-th little-endian int32 word of the codes
(element ``8j + i`` at bits ``4i .. 4i + 3``). Three shift-or-mask steps move the word's bits
0, 4, ..., 28 together into its low byte. The record's scales are the tensor's own (no copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4rl.fp4.rounding import CompactCodes
from fp4rl.fp4.tensor import NVFP4Tensor
from fp4rl.kernels.launch import check_contiguous, check_kernel_device, device_of

BLOCK = 1024  # words per program


# The word count changes with every batch: no recompiling for W == 1 or W % 16 == 0.
@triton.jit(do_not_specialize=["W"])
def _mantissa_bits_kernel(words_W, bits_W, W, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < W
    m = tl.load(words_W + i, mask=ok, other=0) & 0x11111111  # bit 0 of each nibble
    m = (m | (m >> 3)) & 0x03030303  # pairs: bits 0-1 of each byte
    m = (m | (m >> 6)) & 0x000F000F  # fours: bits 0-3 of each half
    m = (m | (m >> 12)) & 0xFF  # eight: bits 0-7
    tl.store(bits_W + i, m.to(tl.uint8), mask=ok)


def launch(t: NVFP4Tensor) -> CompactCodes:
    """``rounding.compact(t)``: the mantissa bits ``[..., K/8]`` and ``t``'s scales."""
    codes = t.codes
    check_kernel_device("codes", codes)
    check_contiguous("codes", codes)
    if codes.data_ptr() % 4:  # read as int32 words of 8 codes
        raise ValueError(f"codes must be 4-byte aligned; got address {codes.data_ptr():#x}")
    bits = torch.empty((*codes.shape[:-1], codes.shape[-1] // 4), dtype=torch.uint8,
                       device=codes.device)  # fmt: skip
    num_words = bits.numel()
    if num_words:
        with device_of(bits):
            _mantissa_bits_kernel[(triton.cdiv(num_words, BLOCK),)](
                codes.view(torch.int32), bits, num_words, BLOCK=BLOCK
            )
    return CompactCodes(mantissa_bits=bits, block_scale=t.block_scale, global_scale=t.global_scale)
