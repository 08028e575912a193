"""The reference recipe against independent float64 oracles (brute-force nearest on each grid)."""

import math

import pytest
import torch

from fp4rl.fp4 import reference as R
from fp4rl.fp4.format import E2M1_VALUES


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative E4M3 value, from the bit layout (bias 7, 3 mantissa bits)."""
    values = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals, including 0
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return torch.tensor([v for v in values if v <= 448.0], dtype=torch.float64)


def nearest_even(v: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the nearest grid value; ties to the even index (= even mantissa bit)."""
    d = (v[:, None] - grid[None, :]).abs()
    best = d.min(1, keepdim=True).values
    ties = d == best
    idx = torch.arange(len(grid)).expand_as(d)
    even = torch.where(ties & (idx % 2 == 0), idx, len(grid))
    first = torch.where(ties, idx, len(grid)).min(1).values
    return torch.where(even.min(1).values < len(grid), even.min(1).values, first)


def test_e2m1_rne_matches_bruteforce_on_dense_grid_and_every_tie():
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    mids = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([torch.linspace(-7, 7, 20001, dtype=torch.float64), mids, -mids, grid, -grid])
    v32 = v.float()
    codes = R.e2m1_rne(v32)
    want = nearest_even(v32.double().abs().clamp(max=6.0), grid)
    assert torch.equal((codes & 7).long(), want)
    assert torch.equal((codes >> 3).bool(), torch.signbit(v32))


def test_e2m1_ties_follow_the_documented_directions():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert R.e2m1_value(R.e2m1_rne(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert R.e2m1_value(R.e2m1_rne(torch.tensor([6.5, 1e30, -7.0]))).tolist() == [6.0, 6.0, -6.0]
    neg_zero = R.e2m1_rne(torch.tensor([-0.1, -0.0]))
    assert neg_zero.tolist() == [8, 8]  # sign bit kept on values that round to zero


def test_e4m3_rne_satfinite_matches_bruteforce():
    grid = e4m3_grid()
    mids = (grid[1:] + grid[:-1]) / 2
    v = torch.cat([grid, mids, torch.rand(20000, dtype=torch.float64) * 460, mids * (1 + 1e-6)])
    v32 = v.float()
    got = R.e4m3_rne_satfinite(v32).double()
    want = grid[nearest_even(v32.double().clamp(max=448.0), grid)]
    assert torch.equal(got, want)
    assert R.e4m3_rne_satfinite(torch.tensor([1e9])).item() == 448.0
    assert math.isnan(R.e4m3_rne_satfinite(torch.tensor([math.nan])).float().item())


def test_pack_layout_even_element_in_low_nibble():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    assert R.pack_e2m1(codes).tolist() == [[0x21, 0xF3]]
    assert torch.equal(R.unpack_e2m1(R.pack_e2m1(codes)), codes)


def test_page_layout_puts_each_sign_at_the_top_of_a_byte():
    """KV pages' layout: in each 4-byte word element j keeps its magnitude in nibble j, and its
    sign is the top bit of byte j (j < 4) or of byte j - 4 of the word shifted left by a
    nibble, where the decoding kernels' lookup flips it; `codes_of_pages` undoes it."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 32), dtype=torch.uint8, generator=g)
    codes[0] = torch.arange(16).repeat(2)
    codes[1] = 15 - codes[0]
    paged = R.page_codes(R.pack_e2m1(codes))
    b = paged.long().unflatten(-1, (-1, 4))
    words = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    elements = codes.long().unflatten(-1, (-1, 8))
    for j in range(8):
        sign_bit = 8 * j + 7 if j < 4 else 8 * (j - 4) + 3
        assert torch.equal((words >> (4 * j)) & 7, elements[..., j] & 7), j
        assert torch.equal((words >> sign_bit) & 1, elements[..., j] >> 3), j
        assert torch.equal((words >> (4 * j + 3)) & 1, elements[..., R.PAGE_SIGNS[j]] >> 3), j
    assert torch.equal(R.codes_of_pages(paged), R.pack_e2m1(codes))


def oracle_quantize(x: torch.Tensor, s: torch.Tensor):
    """Float64 re-derivation of steps 3-4 from the FP32 global scale ``s`` (per row)."""
    blocks = x.float().unflatten(-1, (-1, 16))
    six_s = s.float() * 6.0  # FP32 product, as the spec rounds it
    ratio = (blocks.abs().amax(-1) / six_s).float()
    grid = e4m3_grid()
    sf = grid[nearest_even(ratio.flatten().double().clamp(max=448), grid)].view(ratio.shape).float()
    denom = sf * s.float()
    recip = (1.0 / denom.double()).float()
    y = blocks * recip.unsqueeze(-1)
    grid2 = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    mag = nearest_even(y.flatten().double().abs().clamp(max=6), grid2).view(y.shape)
    return sf, mag, torch.signbit(y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantize_per_row_matches_oracle(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 96, generator=g) * torch.logspace(-3, 3, 37)[:, None]).to(dtype)
    t = R.quantize(x, scaling="row")
    s = x.float().abs().amax(-1, keepdim=True) / 2688.0
    assert torch.equal(t.global_scale, s)
    sf, mag, sign = oracle_quantize(x, s)
    assert torch.equal(t.block_scale.float(), sf)
    codes = R.unpack_e2m1(t.codes).unflatten(-1, (-1, 16))
    assert torch.equal((codes & 7).long(), mag)
    assert torch.equal((codes >> 3).bool(), sign)


def test_dequantize_error_is_bounded():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    d = R.dequantize(R.quantize(x, scaling="row"))
    # NVFP4 on Gaussian data: ~9-10% relative RMS error (SQNR ~20 dB); 0.12 is the floor.
    assert (d - x).norm() / x.norm() < 0.12


def test_scaling_groups_share_global_scales():
    w = torch.randn(4, 32, 64)
    per_expert = R.quantize(w, scaling=2)
    assert per_expert.global_scale.shape == (4, 1, 1)
    assert torch.equal(per_expert.global_scale.flatten(), w.abs().amax((1, 2)) / 2688.0)
    assert R.quantize(w).global_scale.shape == (1, 1, 1)
    assert R.quantize(w, scaling="row").global_scale.shape == (4, 32, 1)
    # Caller-given groups: W1 and W3 as separate tensors with one shared scale per expert.
    w1, w3 = w[:, :16], w[:, 16:]
    s = R.global_scale_from_amax(R.amax_of(w1, w3, dims=(1, 2)))
    joint = R.quantize(w1, scaling=2, global_scale=s)
    assert torch.equal(joint.codes, per_expert.codes[:, :16])
    assert torch.equal(
        joint.block_scale.view(torch.uint8), per_expert.block_scale[:, :16].view(torch.uint8)
    )


def test_zero_rows_and_zero_blocks_give_zero_codes_and_scales():
    x = torch.randn(3, 48)
    x[0] = 0.0
    x[1, 16:32] = 0.0
    t = R.quantize(x, scaling="row")
    assert t.global_scale[0].item() == 0.0
    assert (t.block_scale[0].float() == 0).all() and (t.codes[0] == 0).all()
    assert t.block_scale[1, 1].float().item() == 0.0 and (t.codes[1, 8:16] == 0).all()
    assert not R.dequantize(t).isnan().any()


def test_tiny_group_is_flushed_and_tiny_blocks_underflow_to_zero():
    x = torch.full((2, 32), 1e-33)
    x[1, :16] = 1.0
    x[1, 16:] = 2.0**-20  # block amax / (6 s) = 448 * 2**-20 < 2**-10, half the smallest E4M3
    t = R.quantize(x, scaling="row")
    assert t.global_scale[0].item() == 0.0 and (t.codes[0] == 0).all()
    assert t.block_scale[1, 1].float().item() == 0.0 and (t.codes[1, 8:] == 0).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_non_finite_input_poisons_its_group(bad, scaling):
    x = torch.randn(4, 32)
    x[2, 5] = bad
    t = R.quantize(x, scaling=scaling)
    d = R.dequantize(t)
    poisoned = d[2] if scaling == "row" else d
    assert poisoned.isnan().all()
    if scaling == "row":
        assert not d[[0, 1, 3]].isnan().any()
    assert (t.block_scale.view(torch.uint8)[2] == 0x7F).all()
    assert (t.codes[2] == 0).all()


def test_negative_or_nan_caller_scale_poisons_its_group():
    """Checked on the device, not refused on the host: the group fails closed like non-finite
    input (canonical NaN global scale, NaN block scales, zero codes); -0 is a zero scale."""
    x = torch.randn(6, 32)
    nan_bits = torch.tensor([0x7FC00001, -0x400000], dtype=torch.int32).view(torch.float32)
    given = torch.tensor([[-1.0], [-math.inf], [0.01], [-0.0], [0.0], [0.02]])
    given[4, 0], given[5, 0] = nan_bits  # a positive NaN with a payload, and a negative NaN
    t = R.quantize(x, scaling="row", global_scale=given)
    poisoned = [0, 1, 4, 5]
    assert (t.global_scale[poisoned].view(torch.int32) == 0x7FC00000).all()
    assert (t.block_scale[poisoned].view(torch.uint8) == 0x7F).all()
    assert (t.codes[poisoned] == 0).all() and R.dequantize(t)[poisoned].isnan().all()
    assert t.global_scale[3].view(torch.int32).item() == 0  # -0 flushes to +0: zero codes
    assert (t.codes[3] == 0).all() and (t.block_scale[3].float() == 0).all()
    assert not R.dequantize(t)[[2, 3]].isnan().any()


def test_caller_scale_is_never_read_on_the_host():
    """No `.any()` / `.item()` on the scale's values: the whole resolution runs on tensors of
    the meta device, which have no values to read (a CUDA caller pays no sync)."""
    x = torch.empty(4, 3, 32, dtype=torch.bfloat16, device="meta")
    s = R.resolve_global_scale(x, 2, torch.empty(4, 1, 1, device="meta"))
    assert s.shape == (4, 1, 1) and s.device.type == "meta"
    with pytest.raises(ValueError, match="does not broadcast"):
        R.resolve_global_scale(x, 2, torch.empty(3, 1, 1, device="meta"))
    with pytest.raises(TypeError, match="float32"):
        R.resolve_global_scale(x, 2, torch.empty(4, 1, 1, dtype=torch.float16, device="meta"))


def test_caller_scale_with_non_finite_block_marks_only_that_block():
    x = torch.randn(2, 32)
    s = R.quantize(x, scaling="row").global_scale
    x[0, 20] = math.inf
    d = R.dequantize(R.quantize(x, scaling="row", global_scale=s))
    assert d[0, 16:].isnan().all() and not d[0, :16].isnan().any() and not d[1].isnan().any()


@pytest.mark.parametrize(
    ("x", "err", "match"),
    [
        (torch.randn(4, 24), ValueError, r"multiple of 16; got shape \(4, 24\)"),
        (torch.randn(0), ValueError, r"shape \(0,\)"),
        (torch.randint(0, 3, (4, 32)), TypeError, "torch.int64"),
        (torch.randn(4, 32, dtype=torch.float64), TypeError, "torch.float64"),
    ],
)
def test_bad_input_is_named(x, err, match):
    with pytest.raises(err, match=match):
        R.quantize(x)


def test_bad_scaling_and_global_scale_are_named():
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="'col'"):
        R.quantize(x, scaling="col")
    with pytest.raises(ValueError, match=r"\(3, 1\)"):
        R.quantize(x, scaling="row", global_scale=torch.ones(3, 1))
    tiny = R.quantize(x, scaling="row", global_scale=torch.full((4, 1), 1e-36))
    assert (tiny.global_scale == 0).all() and (tiny.codes == 0).all()
    with pytest.raises(TypeError, match="float32"):
        R.quantize(x, scaling="row", global_scale=torch.ones(4, 1, dtype=torch.float64))
