"""Dequantize against the reference for every code, every block-scale byte and odd scales."""

import math

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import DTYPES, assert_same_values  # noqa: E402

from fp4rl import kernels  # noqa: E402
from fp4rl.fp4 import reference as R  # noqa: E402
from fp4rl.fp4.tensor import NVFP4Tensor  # noqa: E402


def check_dequantize(t: NVFP4Tensor, device: str) -> None:
    on_device = t.map(lambda m: m.to(device))
    for dtype in DTYPES:
        got = kernels.dequantize(on_device, dtype)
        assert_same_values(got, R.dequantize(t, dtype), f"dequantize to {dtype}")


def every_byte_tensor(lead: tuple[int, ...], k: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random code bytes and block-scale bytes that cycle through all 256 patterns."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (*lead, k // 2), generator=g, dtype=torch.uint8)
    n = math.prod(lead) * (k // 16)
    block_bytes = (torch.arange(n) % 256).to(torch.uint8).view(*lead, k // 16)
    return codes, block_bytes.view(torch.float8_e4m3fn)


def test_every_code_and_block_scale_byte(device):
    codes, block_scale = every_byte_tensor((32,), 128, seed=0)  # 256 blocks: every byte
    global_scale = torch.rand(32, 1) * 10
    global_scale[:4, 0] = torch.tensor([0.0, math.nan, 2.0**-117, 2.0**100])
    check_dequantize(NVFP4Tensor(codes, block_scale, global_scale), device)


def test_denormal_products_are_kept(device):
    """0.5 * 2**-9 * 2**-117 = 2**-127: a denormal FP32 (and bf16) result, not flushed."""
    codes = torch.full((2, 8), 0x91, dtype=torch.uint8)  # ±0.5
    block_scale = torch.ones(2, 1, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 2**-9
    global_scale = torch.tensor([[2.0**-117], [2.0**-126]])
    t = NVFP4Tensor(codes, block_scale, global_scale)
    assert R.dequantize(t)[0, 0].item() == 2.0**-127
    check_dequantize(t, device)


@pytest.mark.parametrize(
    "scale_shape", [(1, 1, 1), (3, 1, 1), (3, 5, 1), (1, 5, 1)], ids=lambda s: str(s)
)
def test_global_scale_broadcast_patterns(device, scale_shape):
    codes, block_scale = every_byte_tensor((3, 5), 48, seed=1)
    global_scale = torch.rand(scale_shape) + 0.5
    check_dequantize(NVFP4Tensor(codes, block_scale, global_scale), device)


@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_round_trip_of_quantize(device, scaling):
    x = torch.randn(17, 96).to(torch.bfloat16)
    check_dequantize(R.quantize(x, scaling=scaling), device)
    check_dequantize(R.quantize(x[:0], scaling="row"), device)  # no rows


def test_bad_dtype_and_layout_are_refused(device):
    t = R.quantize(torch.randn(4, 32), scaling="row").map(lambda m: m.to(device))
    with pytest.raises(TypeError, match="torch.int8"):
        kernels.dequantize(t, torch.int8)
    strided = NVFP4Tensor(t.codes.t().contiguous().t(), t.block_scale, t.global_scale)
    with pytest.raises(ValueError, match=r"codes must be contiguous; got shape \(4, 16\)"):
        kernels.dequantize(strided, torch.bfloat16)


@pytest.mark.gpu
def test_large_dequantize_on_gpu():
    codes, block_scale = every_byte_tensor((8, 512), 7168, seed=2)
    check_dequantize(NVFP4Tensor(codes, block_scale, torch.rand(8, 1, 1) + 0.1), "cuda")
