"""Sparse guidance: what is recorded, how the trainer follows it, and how records are cut.

Claims: a value is recorded exactly when the rollout's scaled value lies within delta grid units
of a rounding boundary; the trainer then reproduces the rollout's codeword wherever its own
value is in the same bracket (in particular just across the boundary), and rounds to nearest
under the rollout's scales everywhere else, bitwise; rows sliced, concatenated and permuted
stay exact; malformed records fail with a ValueError or TypeError that says what is wrong.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4rl.fp4 import reference as R
from fp4rl.fp4 import rounding as G
from fp4rl.fp4.format import E2M1_BOUNDARIES
from fp4rl.records import record_cat, record_nbytes, record_rows
from fp4rl.rollout import EngineConfig
from fp4rl.rollout.capture import StepCapture


def signed(codes: torch.Tensor) -> torch.Tensor:
    """Signed E2M1 values of packed codes, both zeros as +0."""
    return R.e2m1_value(R.unpack_e2m1(codes)) + 0.0


def scaled(x: torch.Tensor, t) -> torch.Tensor:
    y, _ = R.scaled_values(x.unflatten(-1, (-1, 16)), t.block_scale, t.global_scale)
    return y.flatten(-2)


def nearest_under(x: torch.Tensor, t) -> torch.Tensor:
    """Nearest codes of ``x`` under ``t``'s scales (dead blocks zero), ``[..., K]``."""
    y, live = R.scaled_values(x.unflatten(-1, (-1, 16)), t.block_scale, t.global_scale)
    return torch.where(live.unsqueeze(-1), R.e2m1_rne(y), 0).to(torch.uint8).flatten(-2)


def test_boundary_distance_in_grid_units():
    y = torch.tensor([0.25, 1.75, 2.5, 5.0, 0.0, 1.0, 4.0, 6.0, 0.375, 2.75, 4.5, -1.375, 7.0])
    want = [0, 0, 0, 0, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25, 1.0]
    assert G.boundary_distance(y).tolist() == want


def test_recorded_exactly_the_values_within_delta():
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    t = R.quantize(x, scaling="row")
    near = G.boundary_distance(scaled(x, t))
    for delta in (0.0, 0.01, 0.1, 0.5):
        s = G.sparse(x, t, delta)
        recorded, bit = s.expand()
        assert torch.equal(recorded, near <= delta)
        assert torch.equal(bit[recorded], R.unpack_e2m1(t.codes)[recorded] & 1)
        assert s.entries.dtype == s.counts.dtype == torch.uint8  # K = 64
        assert record_nbytes(s) == s.nbytes == s.counts.numel() + s.entries.numel() + 6 * 4 + 6 * 4
        # Following its own record, the rollout's values round to its own codes, bitwise.
        assert G.round_guided_sparse(x, s).equal(t)


finite_rows = st.lists(
    st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32), min_size=32, max_size=32
)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(finite_rows, min_size=1, max_size=4),
    rel=st.sampled_from([1e-4, 1e-3, 3e-2]),
    delta=st.sampled_from([0.01, 0.03, 0.1, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_trainer_takes_the_rollouts_side_where_recorded_and_nearest_elsewhere(
    rows, rel, delta, seed
):
    rollout_x = torch.tensor(rows, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    local_x = rollout_x * (1 + rel * torch.randn(rollout_x.shape, generator=g))
    rollout = R.quantize(rollout_x, scaling="row")
    record = G.sparse(rollout_x, rollout, delta)
    got = G.round_guided_sparse(local_x, record)
    assert torch.equal(got.block_scale.view(torch.uint8), rollout.block_scale.view(torch.uint8))
    recorded, _ = record.expand()
    y_r, y_l = scaled(rollout_x, rollout), scaled(local_x, rollout)
    nearest = nearest_under(local_x, rollout)
    codes = R.unpack_e2m1(got.codes)
    # Not recorded: nearest rounding of the local value under the rollout's scales, bitwise.
    assert torch.equal(codes[~recorded], nearest[~recorded])
    # Recorded and in the rollout's bracket (also just across the boundary): its codeword.
    lo_r, hi_r = G.e2m1_bracket(y_r)
    lo_l, hi_l = G.e2m1_bracket(y_l)
    same = recorded & (lo_r == lo_l) & (hi_r == hi_l) & (torch.signbit(y_r) == torch.signbit(y_l))
    assert torch.equal(signed(got.codes)[same], signed(rollout.codes)[same])


def test_values_constructed_just_across_each_boundary_follow_the_rollout():
    # A 6 closes each block of 16 (rows of 32): block scale 448, and y = x to within an ulp of
    # the scale's reciprocal.
    delta = 0.03
    offsets = torch.tensor([0.02, 0.005, 0.001])  # grid units, all inside delta
    width = torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0])
    b = torch.tensor(E2M1_BOUNDARIES)
    above = (b[:, None] + offsets[None] * width[:, None]).flatten()  # 21 values
    below = (b[:, None] - offsets[None] * width[:, None]).flatten()
    tested = torch.cat((torch.arange(15), torch.arange(16, 22)))  # columns of the 21 values

    def row(values):
        out = torch.zeros(32)
        out[tested], out[15], out[31] = values, 6.0, 6.0
        return out

    rollout_x = torch.stack([row(above), row(-below)])
    local_x = torch.stack([row(below), row(-above)])
    rollout = R.quantize(rollout_x, scaling="row")
    assert torch.allclose(scaled(rollout_x, rollout), rollout_x, rtol=1e-6, atol=0)
    record = G.sparse(rollout_x, rollout, delta)
    recorded, _ = record.expand()
    assert recorded[:, tested].all() and recorded.sum() == 2 * 21
    nearest = R.quantize(local_x, scaling="row")
    assert (signed(nearest.codes)[:, tested] != signed(rollout.codes)[:, tested]).all()
    got = G.round_guided_sparse(local_x, record)
    assert torch.equal(signed(got.codes), signed(rollout.codes))
    # Outside delta the record says nothing: nearest, one step off the rollout.
    far = G.sparse(rollout_x, rollout, 0.0005)
    assert torch.equal(G.round_guided_sparse(local_x, far).codes, nearest.codes)


def token_major(seed: int = 1):
    x = torch.randn(7, 3, 32, generator=torch.Generator().manual_seed(seed)) * 3
    t = R.quantize(x, scaling="row")
    return x, t, G.sparse(x, t, 0.1)


def same_record(a, b) -> bool:
    """Same type, shapes, dtypes and bits, member by member."""
    return type(a) is type(b) and all(
        p.dtype == q.dtype
        and p.shape == q.shape
        and torch.equal(p.view(torch.uint8), q.view(torch.uint8))
        for p, q in zip(a.tensors(), b.tensors(), strict=True)
    )


def test_rows_cat_and_select_keep_each_row_with_its_values():
    x, t, s = token_major()
    for a, b in ((0, 7), (0, 3), (3, 4), (5, 7), (2, 2)):
        want = G.sparse(x[a:b], t.map(lambda m, a=a, b=b: m[a:b]), 0.1)
        assert same_record(record_rows(s, a, b), want), (a, b)
    pieces = [record_rows(s, a, b) for a, b in ((0, 2), (2, 3), (3, 7))]
    assert same_record(record_cat(pieces), s)
    index = torch.tensor([20, 0, 5, 5, 13])
    flat_t = t.map(lambda m: m.reshape(-1, m.shape[-1])[index])
    assert same_record(s.select_rows(index), G.sparse(x.reshape(-1, 32)[index], flat_t, 0.1))


def test_malformed_records_fail_with_what_is_wrong():
    x, t, s = token_major()
    with pytest.raises(ValueError, match=r"counts sum to \d+ but it holds \d+ entries"):
        G.SparseCodes(s.counts, s.entries[:-1], s.block_scale, s.global_scale).expand()
    bad = s.entries.clone()
    bad[0] = 200  # column 100 of rows of 32
    with pytest.raises(ValueError, match=r"column outside \[0, 32\)"):
        G.SparseCodes(s.counts, bad, s.block_scale, s.global_scale).expand()
    with pytest.raises(TypeError, match="counts and entries must be"):
        G.SparseCodes(s.counts.int(), s.entries, s.block_scale, s.global_scale)
    with pytest.raises(ValueError, match="do not match block_scale"):
        G.SparseCodes(s.counts[:, :2], s.entries, s.block_scale, s.global_scale)
    with pytest.raises(ValueError, match=r"sparse guidance of shape \(7, 3, 32\) for x"):
        G.round_guided_sparse(x[:, :, :16], s)
    with pytest.raises(ValueError, match="delta must be in"):
        G.sparse(x, t, 0.7)


@pytest.mark.parametrize("delta", [0, 0.6, -0.1, math.nan, True, "0.1"])
def test_engine_sparse_delta_is_checked(delta):
    with pytest.raises(ValueError, match=rf"engine.sparse_delta must be .*got {delta!r}"):
        EngineConfig(guidance="sparse", sparse_delta=delta)


def test_step_capture_needs_the_sites_values_for_sparse_guidance():
    cap = StepCapture(routing=False, guidance="sparse", keep={(1, "k")}, sparse_delta=0.1)
    assert cap.keeps_values
    x, t, s = token_major()
    cap.record(1, "k", t, x)
    assert same_record(cap.sites[(1, "k")], s)
    with pytest.raises(ValueError, match="values of layers.1 site 'k'"):
        cap.record(1, "k", t)
    with pytest.raises(ValueError, match="needs sparse_delta"):
        StepCapture(routing=False, guidance="sparse", keep=set())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gives_the_cpu_references_bits():
    from fp4rl import ops

    g = torch.Generator().manual_seed(4)
    rollout_x = (torch.randn(64, 2, 128, generator=g) * 2).bfloat16()
    local_x = (
        rollout_x.float() * (1 + 2e-3 * torch.randn(rollout_x.shape, generator=g))
    ).bfloat16()
    rollout = R.quantize(rollout_x, scaling="row")
    record = G.sparse(rollout_x, rollout, 0.05)
    on_gpu = G.sparse(rollout_x.cuda(), ops.quantize(rollout_x.cuda(), scaling="row"), 0.05)
    assert same_record(on_gpu.__class__(*(t.cpu() for t in on_gpu.tensors())), record)
    want = G.round_guided_sparse(local_x, record)
    assert ops.quantize_site(local_x.cuda(), guidance=on_gpu).map(lambda m: m.cpu()).equal(want)
    fake = ops.fake_quantize(local_x.cuda(), guidance=on_gpu)
    assert torch.equal(fake.cpu(), R.dequantize(want, torch.bfloat16))
    rows = torch.randperm(128, generator=g).cuda()
    picked = on_gpu.select_rows(rows)
    assert same_record(
        picked.__class__(*(t.cpu() for t in picked.tensors())), record.select_rows(rows.cpu())
    )
