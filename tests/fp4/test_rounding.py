"""Guided rounding: properties against nearest rounding, zero crossings, compact guidance."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4rl.fp4 import reference as R
from fp4rl.fp4 import rounding as G


def signed_values(t) -> torch.Tensor:
    return R.e2m1_value(R.unpack_e2m1(t.codes))


def perturbed(x: torch.Tensor, rel: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return x * (1 + rel * torch.randn(x.shape, generator=g))


finite_rows = st.lists(
    st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32), min_size=32, max_size=32
)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(finite_rows, min_size=1, max_size=4),
    rel=st.sampled_from([1e-3, 3e-2, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_guided_full_never_widens_the_gap_and_hits_adjacent_rollout_codes(rows, rel, seed):
    rollout_x = torch.tensor(rows, dtype=torch.float32)
    local_x = perturbed(rollout_x, rel, seed)
    rollout = R.quantize(rollout_x, scaling="row")
    v_r = signed_values(rollout)
    guided = G.round_guided_full(local_x, rollout)
    # Round-to-nearest of the same local value under the same (rollout) scales.
    y, _ = R.scaled_values(
        local_x.unflatten(-1, (-1, 16)), rollout.block_scale, rollout.global_scale
    )
    nearest = R.e2m1_value(R.e2m1_rne(y)).flatten(-2)
    gap_nearest = (nearest - v_r).abs()
    gap_guided = (signed_values(guided) - v_r).abs()
    assert (gap_guided <= gap_nearest).all()
    # Whenever the rollout's codeword is one of the two neighbours of the local value, take it.
    lo, hi = G.e2m1_bracket(y)
    table = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
    sign = torch.where(torch.signbit(y), -1.0, 1.0)
    v_r_blocks = v_r.unflatten(-1, (-1, 16))
    adjacent = (v_r_blocks == sign * table[lo.long()]) | (v_r_blocks == sign * table[hi.long()])
    got = signed_values(guided).unflatten(-1, (-1, 16))
    assert torch.equal(got[adjacent], v_r_blocks[adjacent])


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(finite_rows, min_size=1, max_size=4),
    rel=st.sampled_from([1e-3, 3e-2]),
    seed=st.integers(0, 2**16),
)
def test_compact_equals_full_when_rollout_is_a_neighbour(rows, rel, seed):
    rollout_x = torch.tensor(rows, dtype=torch.float32)
    local_x = perturbed(rollout_x, rel, seed)
    rollout = R.quantize(rollout_x, scaling="row")
    full = G.round_guided_full(local_x, rollout)
    small = G.round_guided_compact(local_x, G.compact(rollout))
    y, _ = R.scaled_values(
        local_x.unflatten(-1, (-1, 16)), rollout.block_scale, rollout.global_scale
    )
    lo, hi = G.e2m1_bracket(y)
    mag_r = R.unpack_e2m1(rollout.codes).unflatten(-1, (-1, 16)) & 7
    same_sign = (R.unpack_e2m1(rollout.codes).unflatten(-1, (-1, 16)) >> 3) == torch.signbit(y)
    neighbour = ((mag_r == lo) | (mag_r == hi)) & (same_sign | (mag_r == 0))
    f = R.unpack_e2m1(full.codes).unflatten(-1, (-1, 16))
    c = R.unpack_e2m1(small.codes).unflatten(-1, (-1, 16))
    assert torch.equal(f[neighbour], c[neighbour])


def test_guided_equals_nearest_when_both_sides_agree():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    rollout = R.quantize(x, scaling="row")
    assert G.round_guided_full(x, rollout).equal(rollout)
    assert G.round_guided_compact(x, G.compact(rollout)).equal(rollout)


def rollout_with(codes_row: list[int], scale_for: torch.Tensor):
    """A rollout record with the given codes and block/global scales of ``scale_for``."""
    t = R.quantize(scale_for, scaling="row")
    codes = torch.tensor([codes_row], dtype=torch.uint8)
    return R.NVFP4Tensor(
        codes=R.pack_e2m1(codes), block_scale=t.block_scale, global_scale=t.global_scale
    )


def test_zero_crossing_full_and_compact():
    # Scales chosen so the scaled value y equals x: amax 6 * 448 / 448... s = 6/2688, sf = 448/448.
    ref = torch.zeros(1, 16)
    ref[0, 0] = 6.0
    s = R.quantize(ref, scaling="row")
    denom = s.block_scale.float() * s.global_scale
    assert torch.allclose(1.0 / denom, torch.ones_like(denom))
    local = ref.clone()
    local[0, 1] = 0.2  # bracket {+0, +0.5}
    local[0, 2] = -0.2  # bracket {-0, -0.5}
    rollout_codes = [7, 0x8 | 1, 1] + [0] * 13  # rollout chose -0.5 and +0.5: the other side
    rollout = rollout_with(rollout_codes, ref)
    full = R.unpack_e2m1(G.round_guided_full(local, rollout).codes)[0]
    assert full[1].item() == 0 and full[2].item() == 0x8  # signed zero: the nearer member
    small = R.unpack_e2m1(G.round_guided_compact(local, G.compact(rollout)).codes)[0]
    # Compact cannot see the sign: mantissa bit 1 picks +-0.5 on the local side of zero.
    assert small[1].item() == 1 and small[2].item() == 0x8 | 1


def test_values_on_the_grid_and_beyond_saturation_keep_their_codeword():
    ref = torch.zeros(1, 16)
    ref[0, 0] = 6.0
    local = ref.clone()
    local[0, 1], local[0, 2] = 1.5, 7.0
    rollout = rollout_with([7, 5, 5] + [0] * 13, ref)  # rollout said 3.0 for both
    got = R.unpack_e2m1(G.round_guided_full(local, rollout).codes)[0]
    assert got[1].item() == 3 and got[2].item() == 7


def test_guided_poisons_non_finite_blocks():
    x = torch.randn(2, 32)
    rollout = R.quantize(x, scaling="row")
    x[1, 3] = math.nan
    for t in (G.round_guided_full(x, rollout), G.round_guided_compact(x, G.compact(rollout))):
        d = R.dequantize(t)
        assert d[1, :16].isnan().all() and not d[1, 16:].isnan().any() and not d[0].isnan().any()


def test_compact_packing_and_size():
    t = R.quantize(torch.randn(4, 64), scaling="row")
    c = G.compact(t)
    assert c.mantissa_bits.shape == (4, 8) and c.shape == t.shape
    assert torch.equal(G.unpack_bits(c.mantissa_bits), R.unpack_e2m1(t.codes) & 1)
    assert c.nbytes < t.nbytes
