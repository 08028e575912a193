"""The NVFP4 operations the rest of fp4rl calls: one entry point per op, two implementations.

This module sits above both of them: CUDA tensors go to the Triton kernels in `fp4rl.kernels`;
everything else runs the plain-PyTorch specification in `fp4rl.fp4.reference` /
`fp4rl.fp4.rounding`. Neither implementation imports this module. The two are bitwise identical
(tests/kernels), so the choice changes speed only, never a single bit of the result. If Triton
is missing on a CUDA machine the call raises instead of silently running the slow path.
"""

from __future__ import annotations

import torch

from fp4rl.fp4 import reference, rounding
from fp4rl.fp4.reference import Scaling
from fp4rl.fp4.rounding import CompactCodes
from fp4rl.fp4.tensor import NVFP4Tensor

Guidance = NVFP4Tensor | CompactCodes | None  # full codes, compact mantissa bits, or nearest


def _kernels(x: torch.Tensor):
    if not x.is_cuda:
        return None
    try:
        from fp4rl import kernels
    except ImportError as err:  # pragma: no cover - depends on the machine
        raise RuntimeError(
            "CUDA tensors need the Triton kernels; install fp4rl with the 'kernels' extra"
        ) from err
    return kernels


def quantize(
    x: torch.Tensor, *, scaling: Scaling = "tensor", global_scale: torch.Tensor | None = None
) -> NVFP4Tensor:
    """Round-to-nearest NVFP4 quantization; see `fp4rl.fp4.reference` for the recipe."""
    impl = _kernels(x) or reference
    return impl.quantize(x, scaling=scaling, global_scale=global_scale)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    impl = _kernels(t.codes) or reference
    return impl.dequantize(t, dtype)


def quantize_guided(x: torch.Tensor, guidance: NVFP4Tensor | CompactCodes) -> NVFP4Tensor:
    """Guided rounding with the rollout's scales: full codes or compact mantissa bits."""
    impl = _kernels(x) or rounding
    if isinstance(guidance, NVFP4Tensor):
        return impl.round_guided_full(x, guidance)
    if isinstance(guidance, CompactCodes):
        return impl.round_guided_compact(x, guidance)
    raise TypeError(f"guidance must be NVFP4Tensor or CompactCodes, got {type(guidance).__name__}")


def quantize_site(
    x: torch.Tensor, *, scaling: Scaling = "row", guidance: Guidance = None
) -> NVFP4Tensor:
    """Quantize one FP4 site: nearest rounding, or guided when the rollout's record is given."""
    if guidance is None:
        return quantize(x, scaling=scaling)
    return quantize_guided(x, guidance)


class _FakeQuantize(torch.autograd.Function):
    """Forward: dequantize(quantize(x)) in x's dtype. Backward: straight through."""

    @staticmethod
    def forward(ctx, x, scaling, global_scale, guidance):
        kernels = _kernels(x)
        if kernels is not None:  # one fused pass; codes and scales never reach memory
            return kernels.fake_quantize(
                x, scaling=scaling, global_scale=global_scale, guidance=guidance
            )
        if guidance is not None:
            t = quantize_guided(x, guidance)
        else:
            t = quantize(x, scaling=scaling, global_scale=global_scale)
        return dequantize(t, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def fake_quantize(
    x: torch.Tensor,
    *,
    scaling: Scaling = "row",
    global_scale: torch.Tensor | None = None,
    guidance: Guidance = None,
) -> torch.Tensor:
    """Quantize-dequantize ``x`` (nearest, or guided by the rollout), gradient passed through."""
    return _FakeQuantize.apply(x, scaling, global_scale, guidance)
