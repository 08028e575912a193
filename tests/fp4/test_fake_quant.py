"""Fake quantization: the forward is the reference quantize-dequantize, the backward identity."""

import torch

from fp4rl.fp4 import compact
from fp4rl.fp4 import reference as R
from fp4rl.ops import dequantize, fake_quantize, quantize, quantize_guided


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
        # Guided rounding keeps the rollout's scales; only the codes are chosen locally.
        t = quantize_guided(x, guidance)
        assert t.global_scale is rollout.global_scale
        assert torch.equal(t.block_scale.view(torch.uint8), rollout.block_scale.view(torch.uint8))
