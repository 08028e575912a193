"""Fake quantization: the forward is the reference quantize-dequantize, the backward identity."""

import torch

from fp4rl.fp4 import compact, dequantize, fake_quantize, quantize, quantize_guided
from fp4rl.fp4 import reference as R


def test_forward_is_reference_quantize_dequantize_bitwise():
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    y = fake_quantize(x, scaling="row")
    assert y.dtype == torch.bfloat16
    assert torch.equal(
        y.view(torch.int16), R.dequantize(R.quantize(x, scaling="row"), x.dtype).view(torch.int16)
    )


def test_backward_is_straight_through():
    x = torch.randn(3, 32, requires_grad=True)
    upstream = torch.randn(3, 32)
    fake_quantize(x, scaling="tensor").backward(upstream)
    assert torch.equal(x.grad, upstream)


def test_guided_fake_quant_uses_the_rollout_record():
    x = torch.randn(4, 32)
    rollout = quantize(x * 1.01, scaling="row")
    for guidance in (rollout, compact(rollout)):
        y = fake_quantize(x, guidance=guidance)
        assert torch.equal(y, dequantize(quantize_guided(x, guidance)))
        # The global scale is the rollout's: every output is a codeword times the rollout's scales.
        sf = rollout.block_scale.float().repeat_interleave(16, -1) * rollout.global_scale
        codeword = y / sf
        assert torch.equal(codeword, R.e2m1_value(R.e2m1_rne(codeword)))
