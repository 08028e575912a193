"""Guided rounding (full and compact) and its fused fake-quant against `fp4rl.fp4.rounding`."""

import math

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import DTYPES, assert_nvfp4_equal, assert_same_values, cpu  # noqa: E402

from fp4rl import kernels  # noqa: E402
from fp4rl.fp4 import reference as R  # noqa: E402
from fp4rl.fp4 import rounding  # noqa: E402
from fp4rl.fp4.rounding import CompactCodes  # noqa: E402
from fp4rl.fp4.tensor import NVFP4Tensor  # noqa: E402

SHAPES = [(1, 16), (3, 64), (17, 48), (33, 32), (2, 5, 32)]


def check_guided(x: torch.Tensor, rollout: NVFP4Tensor) -> None:
    """Full and compact guidance from ``rollout`` (CPU tensors), kernels on x's device."""
    x_cpu, device = x.cpu(), x.device
    on_device = rollout.map(lambda t: t.to(device))
    want = rounding.round_guided_full(x_cpu, rollout)
    assert_nvfp4_equal(cpu(kernels.round_guided_full(x, on_device)), want, "guided full")
    fake = kernels.fake_quantize(x, guidance=on_device)
    assert_same_values(fake, R.dequantize(want, x.dtype), "guided full fake-quant")

    compact = rounding.compact(rollout)
    compact_on_device = CompactCodes(
        *(t.to(device) for t in (compact.mantissa_bits, compact.block_scale, compact.global_scale))
    )
    want = rounding.round_guided_compact(x_cpu, compact)
    got = kernels.round_guided_compact(x, compact_on_device)
    assert_nvfp4_equal(cpu(got), want, "guided compact")
    fake = kernels.fake_quantize(x, guidance=compact_on_device)
    assert_same_values(fake, R.dequantize(want, x.dtype), "guided compact fake-quant")


def near_copy(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rollout's x, trainer's x): the same values up to a small relative difference."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(x.shape, generator=g) * torch.exp2(4 * torch.rand(x.shape, generator=g))
    noise = 1 + 0.03 * torch.randn(x.shape, generator=g)
    return base.to(x.dtype), (base * noise).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_guidance_from_a_nearby_rollout(device, dtype, shape):
    rollout_x, x = near_copy(torch.empty(shape, dtype=dtype), seed=shape[-1])
    rollout = R.quantize(rollout_x, scaling="row")
    check_guided(x.to(device), rollout)


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_rollout_codes_of_either_sign(device, dtype):
    """Arbitrary rollout codewords: opposite signs, far-away magnitudes, ±0."""
    g = torch.Generator().manual_seed(2)
    rollout_x, x = near_copy(torch.empty(9, 64, dtype=dtype), seed=3)
    rollout = R.quantize(rollout_x, scaling="tensor")
    codes = torch.randint(0, 256, rollout.codes.shape, generator=g, dtype=torch.uint8)
    x[0, :16] = x[0, :16] * 1e-3  # values near zero: bracket {0, 0.5} against signed codes
    check_guided(x.to(device), NVFP4Tensor(codes, rollout.block_scale, rollout.global_scale))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dead_poisoned_and_odd_rollout_scales(device, dtype):
    """Block-scale bytes of every kind (0, subnormal, NaN, negative); zero and NaN global
    scales; non-finite local values; a global scale shared by E experts' rows."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 8, 64, generator=g).to(dtype)
    x[0, 1, 5], x[1, 2, 40], x[1, 3, 0] = math.nan, math.inf, -math.inf
    codes = torch.randint(0, 256, (2, 8, 32), generator=g, dtype=torch.uint8)
    block_bytes = torch.arange(64, dtype=torch.uint8).view(2, 8, 4) * 4 + 1
    block_bytes[0, 0] = torch.tensor([0x00, 0x7F, 0xFF, 0x80], dtype=torch.uint8)
    block_scale = block_bytes.view(torch.float8_e4m3fn)
    per_row = torch.rand(2, 8, 1, generator=g) * 0.01
    per_row[0, 6], per_row[1, 7] = 0.0, math.nan
    for global_scale in (per_row, torch.full((2, 1, 1), 0.003), torch.full((1, 8, 1), 0.02)):
        check_guided(x.to(device), NVFP4Tensor(codes, block_scale, global_scale))


def test_bad_guidance_is_refused(device):
    x = torch.randn(4, 32, device=device)
    rollout = R.quantize(torch.randn(4, 32), scaling="row").map(lambda t: t.to(device))
    with pytest.raises(ValueError, match=r"rollout codes of shape \(4, 32\) for x \(4, 48\)"):
        kernels.round_guided_full(torch.randn(4, 48, device=device), rollout)
    bits = rounding.compact(rollout)
    lopsided = CompactCodes(bits.mantissa_bits, bits.block_scale[:, :1], bits.global_scale)
    with pytest.raises(ValueError, match="guidance block_scale"):
        kernels.round_guided_compact(x, lopsided)
    wrong_scale = CompactCodes(bits.mantissa_bits, bits.block_scale, torch.ones(3, device=device))
    with pytest.raises(ValueError, match="does not broadcast"):
        kernels.round_guided_compact(x, wrong_scale)
    with pytest.raises(TypeError, match="guidance must be"):
        kernels.fake_quantize(x, guidance=rollout.codes)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.round_guided_full(torch.randn(32, 4, device=device).t(), rollout)


@pytest.mark.gpu
def test_large_guided_on_gpu():
    rollout_x, x = near_copy(torch.empty(2048, 7168, dtype=torch.bfloat16), seed=9)
    check_guided(x.cuda(), R.quantize(rollout_x, scaling="row"))
