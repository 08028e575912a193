"""Compact guidance's mantissa bits in one launch, against `rounding.compact`, bit for bit."""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from fp4rl import kernels  # noqa: E402
from fp4rl.fp4 import NVFP4Tensor, compact  # noqa: E402
from fp4rl.fp4.reference import quantize  # noqa: E402


def check_compact(t: NVFP4Tensor, device: str) -> None:
    on_device = t.map(lambda m: m.to(device))
    got = kernels.compact(on_device)
    want = compact(t)
    assert got.mantissa_bits.shape == want.mantissa_bits.shape
    assert torch.equal(got.mantissa_bits.cpu(), want.mantissa_bits)
    # The scales are the record's own, not copies.
    assert got.block_scale is on_device.block_scale
    assert got.global_scale is on_device.global_scale


def random_codes(lead: tuple[int, ...], k: int, seed: int) -> NVFP4Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (*lead, k // 2), generator=g, dtype=torch.uint8)
    block_scale = torch.randint(0, 126, (*lead, k // 16), generator=g, dtype=torch.uint8)
    return NVFP4Tensor(codes, block_scale.view(torch.float8_e4m3fn), torch.rand(*lead, 1))


def test_every_code_byte_in_every_position_of_a_word(device):
    # 256 byte patterns in each of the 4 byte positions of an int32 word: 1,024 words.
    byte = torch.arange(256, dtype=torch.uint8)
    codes = torch.stack([torch.roll(byte, shift) for shift in range(4)], dim=-1).view(64, 16)
    t = NVFP4Tensor(
        codes, torch.ones(64, 2, dtype=torch.uint8).view(torch.float8_e4m3fn), torch.ones(64, 1)
    )
    check_compact(t, device)


@pytest.mark.parametrize("lead, k", [((1,), 16), ((3, 5), 48), ((7, 2, 4), 128), ((0,), 32)])
def test_shapes_and_leading_dims(device, lead, k):
    check_compact(random_codes(lead, k, seed=k), device)


def test_more_words_than_one_program(device):
    check_compact(random_codes((9,), 2048 + 256, seed=1), device)  # 2,592 words: 3 programs


def test_a_site_record_compacts_like_the_reference(device):
    x = torch.randn(6, 8, 64, generator=torch.Generator().manual_seed(2))
    check_compact(quantize(x, scaling="row"), device)


def test_misaligned_or_strided_codes_are_refused(device):
    t = random_codes((4,), 64, seed=3).map(lambda m: m.to(device))
    with pytest.raises(ValueError, match="codes must be contiguous"):
        strided = torch.zeros(32, 4, dtype=torch.uint8, device=device).t()
        kernels.compact(NVFP4Tensor(strided, t.block_scale, t.global_scale))
    flat = torch.empty(4 * 32 + 1, dtype=torch.uint8, device=device)[1:].view(4, 32)
    with pytest.raises(ValueError, match="codes must be 4-byte aligned"):
        kernels.compact(NVFP4Tensor(flat, t.block_scale, t.global_scale))
