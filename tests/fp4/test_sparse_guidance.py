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

from fp4rl.fp4 import ragged
from fp4rl.fp4 import reference as R
from fp4rl.fp4 import sparse_guidance as G
from fp4rl.fp4.format import E2M1_BOUNDARIES
from fp4rl.records import (
    record_cat,
    record_gather,
    record_gather_packed,
    record_nbytes,
    record_num_rows,
    record_pack,
    record_rows,
    record_unpack,
)
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


def test_scale_boundary_distance_is_relative_to_the_e4m3_midpoint():
    # 1 and 1.125 are adjacent E4M3 values (midpoint 1.0625); 2**-9 the least subnormal.
    r = torch.tensor([1.0625, 1.0625 * 1.01, 1.0625 * 0.98, 1.0, 448.0, 500.0, 0.0, 2.0**-10])
    got = G.scale_boundary_distance(torch.cat((r, torch.tensor([math.nan]))))
    torch.testing.assert_close(got[:3], torch.tensor([0.0, 0.01, 0.02]), rtol=1e-6, atol=1e-7)
    assert got[3:7].isinf().all() and got[7] == 0 and got[8].isinf()


def test_e4m3_bracket_holds_the_ratio_between_adjacent_values():
    g = torch.Generator().manual_seed(5)
    ratio = torch.cat((torch.rand(4000, generator=g) * 460, torch.rand(1000, generator=g) * 1e-2))
    lo, hi = G.e4m3_bracket(ratio)
    f32 = [t.view(torch.float8_e4m3fn).float() for t in (lo, hi)]
    inside = ratio <= 448
    assert (f32[0] <= ratio)[inside].all() and (ratio <= f32[1])[inside].all()
    assert ((hi - lo) <= 1).all() and (lo[~inside] == 0x7E).all() and (hi[~inside] == 0x7E).all()
    nearest = R.e4m3_rne_satfinite(ratio).view(torch.uint8)
    assert ((nearest == lo) | (nearest == hi)).all()


def test_recorded_exactly_the_values_and_blocks_within_delta():
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    t = R.quantize(x, scaling="row")
    near = G.boundary_distance(scaled(x, t))
    ratio = R.block_scale_ratio(x.unflatten(-1, (-1, 16)).abs().amax(-1), t.global_scale)
    for delta in (0.0, 0.01, 0.1, 0.5):
        s = G.sparse(x, t, delta)
        recorded, bit = s.expand()
        assert torch.equal(recorded, near <= delta)
        assert torch.equal(bit[recorded], R.unpack_e2m1(t.codes)[recorded] & 1)
        blocks, block_bit = s.expand_blocks()
        scale_delta = delta * G.SCALE_DELTA_PER_GRID_UNIT
        assert torch.equal(blocks, G.scale_boundary_distance(ratio) <= scale_delta)
        assert torch.equal(block_bit[blocks], t.block_scale.view(torch.uint8)[blocks] & 1)
        assert s.entries.dtype == s.counts.dtype == torch.uint8  # K = 64
        assert torch.equal(s.row_amax, x.abs().amax(-1, keepdim=True))
        members = (s.counts, s.entries, s.block_counts, s.block_entries)
        want = sum(m.numel() for m in members) + 6 * 4
        assert record_nbytes(s) == s.nbytes == want
        # Following its own record, the rollout's values round to its own codes and scales.
        assert G.round_guided_sparse(x, s).equal(t)
    # A relative window of 1 records every block whose ratio is not an E4M3 value (the row
    # maximum's is 448 to an ulp or exactly).
    lo, hi = G.e4m3_bracket(ratio)
    assert torch.equal(G.sparse(x, t, 0.5, scale_delta=1.0).expand_blocks()[0], lo != hi)


special = st.sampled_from([0.0, -0.0, 1e-38, -3e-39, 6.0, -448.0, 3e38, 1.0])
row_values = st.one_of(
    st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32),
    st.floats(min_value=-(2.0**-100), max_value=2.0**-100, allow_nan=False, width=32),
    special,
)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.lists(row_values, min_size=32, max_size=32), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    poison=st.sampled_from([None, math.nan, math.inf, -math.inf]),
)
def test_the_trainer_derives_the_rollouts_scales_bitwise(rows, dtype, poison):
    """The global scale from the recorded row maximum, by the recipe's own function, is the
    rollout's bitwise; with the trainer's values equal to the rollout's, so is every block
    scale and code (whatever delta records), poisoned rows included. The recorded maximum is
    the recipe's `row_amax`, the value KV pages keep (the canonical NaN for an infinite row)."""
    x = torch.tensor(rows, dtype=torch.float32).to(dtype)
    if poison is not None:
        x[0, 3] = poison
    t = R.quantize(x, scaling="row")
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for delta in (0.0, 0.02, 0.5):
        s = G.sparse(x, t, delta)
        assert s.row_amax.dtype == dtype
        assert torch.equal(s.row_amax.view(bits), R.row_amax(x).view(bits))
        derived = R.global_scale_from_amax(s.row_amax)
        assert torch.equal(derived.view(torch.int32), t.global_scale.view(torch.int32))
        assert G.round_guided_sparse(x, s).equal(t)
        assert G.round_guided_sparse(x, s.pack().unpack()).equal(t)


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
    assert torch.equal(got.global_scale.view(torch.int32), rollout.global_scale.view(torch.int32))

    # Block scales: the recipe's from the local block maxima and the rollout's global scale;
    # at a recorded block whose local ratio lies in the rollout's E4M3 bracket, the rollout's.
    def ratio(x):
        return R.block_scale_ratio(x.unflatten(-1, (-1, 16)).abs().amax(-1), rollout.global_scale)

    blocks, _ = record.expand_blocks()
    own = R.block_scale_from_amax(
        local_x.unflatten(-1, (-1, 16)).abs().amax(-1), rollout.global_scale
    ).view(torch.uint8)
    sf = got.block_scale.view(torch.uint8)
    assert torch.equal(sf[~blocks], own[~blocks])
    same_bracket = torch.stack(G.e4m3_bracket(ratio(rollout_x))) == torch.stack(
        G.e4m3_bracket(ratio(local_x))
    )
    followed = blocks & same_bracket.all(0)
    assert torch.equal(sf[followed], rollout.block_scale.view(torch.uint8)[followed])

    # Codes, under the scales the trainer took.
    recorded, _ = record.expand()
    nearest = nearest_under(local_x, got)
    codes = R.unpack_e2m1(got.codes)
    # Not recorded: nearest rounding of the local value, bitwise.
    assert torch.equal(codes[~recorded], nearest[~recorded])
    # Recorded, in a block with the rollout's scale and in the rollout's bracket (also just
    # across the boundary): its codeword.
    y_r, y_l = scaled(rollout_x, rollout), scaled(local_x, got)
    lo_r, hi_r = G.e2m1_bracket(y_r)
    lo_l, hi_l = G.e2m1_bracket(y_l)
    same_scale = (sf == rollout.block_scale.view(torch.uint8)).repeat_interleave(16, -1)
    same = recorded & same_scale & (lo_r == lo_l) & (hi_r == hi_l)
    same &= torch.signbit(y_r) == torch.signbit(y_l)
    assert torch.equal(signed(got.codes)[same], signed(rollout.codes)[same])


def test_a_block_scale_just_across_its_boundary_follows_the_rollout():
    # Row maximum 6 (block 1) fixes the global scale at 6 / 2688; block 0's maximum m gives the
    # ratio 448 m / 6 (to an ulp). m = 0.14105 and 0.1402 put it at 10.532 and 10.468, either
    # side of the E4M3 boundary 10.5 between 10 and 11, 0.3 % from it.
    rollout_x, local_x = torch.zeros(1, 32), torch.zeros(1, 32)
    rollout_x[0, 16] = local_x[0, 16] = 6.0
    rollout_x[0, :16] = torch.linspace(-0.14105, 0.14105, 16)
    local_x[0, :16] = torch.linspace(-0.1402, 0.1402, 16)
    rollout = R.quantize(rollout_x, scaling="row")
    nearest = R.quantize(local_x, scaling="row")
    assert rollout.block_scale[0, 0].float() == 11 and nearest.block_scale[0, 0].float() == 10
    record = G.sparse(rollout_x, rollout, 0.02)  # relative window 0.01
    assert record.expand_blocks()[0].tolist() == [[True, False]]
    got = G.round_guided_sparse(local_x, record)
    assert torch.equal(got.block_scale.view(torch.uint8), rollout.block_scale.view(torch.uint8))
    # A narrower window leaves the block to the local recipe: one E4M3 step off.
    far = G.sparse(rollout_x, rollout, 0.02, scale_delta=0.001)
    assert far.block_counts.sum() == 0
    off = G.round_guided_sparse(local_x, far)
    assert torch.equal(off.block_scale.view(torch.uint8), nearest.block_scale.view(torch.uint8))


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
    """Same type, width, shapes, dtypes and bits, member by member."""
    return (
        type(a) is type(b)
        and a.columns == b.columns
        and all(
            p.dtype == q.dtype
            and p.shape == q.shape
            and torch.equal(p.flatten().view(torch.uint8), q.flatten().view(torch.uint8))
            for p, q in zip(a.tensors(), b.tensors(), strict=True)
        )
    )


def test_rows_cat_and_select_keep_each_row_with_its_values():
    x, t, s = token_major()
    assert s.block_counts.sum() > 0  # the blocks' records are cut too
    for a, b in ((0, 7), (0, 3), (3, 4), (5, 7), (2, 2)):
        want = G.sparse(x[a:b], t.map(lambda m, a=a, b=b: m[a:b]), 0.1)
        assert same_record(record_rows(s, a, b), want), (a, b)
        assert same_record(record_rows(s.pack(), a, b), want.pack()), (a, b)
    pieces = [record_rows(s, a, b) for a, b in ((0, 2), (2, 3), (3, 7))]
    assert same_record(record_cat(pieces), s)
    assert same_record(record_cat([p.pack() for p in pieces]), s.pack())
    spans = [(5, 7), (0, 2), (3, 4)]
    assert same_record(
        record_gather(s, spans), record_cat([record_rows(s, a, b) for a, b in spans])
    )
    assert same_record(record_gather(s.pack(), spans), record_gather(s, spans).pack())
    # Each sequence's rows packed, all sequences at once, as the engine cuts its steps' records.
    parts = [[(5, 7), (0, 2)], [], [(3, 4)], [(0, 7)]]
    wanted = [record_gather(s, p).pack() if p else record_rows(s, 0, 0).pack() for p in parts]
    for got, want in zip(record_gather_packed(s, parts), wanted, strict=True):
        assert same_record(got, want)
    index = torch.tensor([20, 0, 5, 5, 13])
    flat_t = t.map(lambda m: m.reshape(-1, m.shape[-1])[index])
    assert same_record(s.select_rows(index), G.sparse(x.reshape(-1, 32)[index], flat_t, 0.1))


def test_packed_form_restores_the_record_without_row_counts():
    x = (torch.randn(40, 2, 128, generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
    t = R.quantize(x, scaling="row")
    for delta in (0.0, 0.01, 0.1, 0.5):
        s = G.sparse(x, t, delta)
        p = s.pack()
        assert same_record(record_unpack(p), s) and record_unpack(s) is s
        assert same_record(record_pack(s), p) and record_num_rows(p) == 40
        assert p.shape == s.shape == x.shape and record_nbytes(p) == p.nbytes
        n, m = int(s.counts.sum()), int(s.block_counts.sum())
        # One byte per position while gaps stay below 64, never more than 5; no counts.
        assert n + m <= p.values.numel() + p.blocks.numel() <= 5 * (n + m)
        assert p.nbytes == p.values.numel() + p.blocks.numel() + 80 * 2
    # Many records in one pass, empty ones among them, as the rows concatenated.
    s = G.sparse(x, t, 0.05)
    cuts = [(0, 7), (7, 7), (7, 8), (8, 30), (30, 40)]
    pieces = [record_rows(s, a, b) for a, b in cuts]
    assert any(int(p.counts.sum()) == 0 for p in pieces[1:3])
    assert same_record(G.PackedSparse.unpack_cat([p.pack() for p in pieces]), s)
    codes = torch.tensor([0, 1, 127, 128, 16383, 16384, 2**35 - 1])
    stream = ragged.encode_varint(codes)
    assert stream.tolist()[:4] == [0, 1, 127, 0x80] and stream.numel() == 1 + 1 + 1 + 2 + 2 + 3 + 5
    assert torch.equal(ragged.decode_varint(stream), codes)


def test_malformed_packed_records_fail_with_what_is_wrong():
    x, t, s = token_major()
    p = s.pack()
    cut = G.PackedSparse(p.row_amax, p.values[:-1].clone(), p.blocks, p.columns)
    cut.values[-1] |= 0x80
    with pytest.raises(ValueError, match="ends inside a position"):
        cut.unpack()
    past = G.PackedSparse(p.row_amax[:3], p.values, p.blocks, p.columns)
    with pytest.raises(ValueError, match=r"value positions past its 9 rows of 32"):
        past.unpack()
    long = torch.tensor([0x80] * 5 + [1], dtype=torch.uint8)
    with pytest.raises(ValueError, match="longer than 5 B"):
        G.PackedSparse(p.row_amax, long, p.blocks, p.columns).unpack()
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 2\*\*35\)"):
        ragged.encode_varint(torch.tensor([2**35]))
    with pytest.raises(TypeError, match="streams must be uint8"):
        G.PackedSparse(p.row_amax, p.values.int(), p.blocks, p.columns)


def test_malformed_records_fail_with_what_is_wrong():
    x, t, s = token_major()
    rest = (s.block_counts, s.block_entries, s.row_amax, s.columns)
    with pytest.raises(ValueError, match=r"value counts sum to \d+ but it holds \d+ entries"):
        G.SparseCodes(s.counts, s.entries[:-1], *rest).expand()
    bad = s.entries.clone()
    bad[0] = 200  # column 100 of rows of 32
    with pytest.raises(ValueError, match=r"value index outside \[0, 32\)"):
        G.SparseCodes(s.counts, bad, *rest).expand()
    bad = s.block_entries.clone()
    bad[0] = 6  # block 3 of rows of 2
    with pytest.raises(ValueError, match=r"block index outside \[0, 2\)"):
        G.SparseCodes(s.counts, s.entries, s.block_counts, bad, s.row_amax, 32).expand_blocks()
    with pytest.raises(TypeError, match="counts and entries must be"):
        G.SparseCodes(s.counts.int(), s.entries, *rest)
    with pytest.raises(ValueError, match="do not describe rows"):
        G.SparseCodes(s.counts[:, :2], s.entries, *rest)
    with pytest.raises(ValueError, match="columns must be a positive multiple of 16"):
        G.SparseCodes(s.counts, s.entries, *rest[:-1], 24)
    with pytest.raises(ValueError, match=r"sparse guidance of shape \(7, 3, 32\) for x"):
        G.round_guided_sparse(x[:, :, :16], s)
    with pytest.raises(ValueError, match="delta must be in"):
        G.sparse(x, t, 0.7)
    with pytest.raises(ValueError, match="scale_delta must be in"):
        G.sparse(x, t, 0.1, scale_delta=-1)
    # Codes quantized with other than per-row scales from the row maxima cannot be derived.
    with pytest.raises(ValueError, match="one global scale per row"):
        G.sparse(x, R.quantize(x), 0.1)
    halved = R.quantize(x, scaling="row", global_scale=t.global_scale * 0.5)
    with pytest.raises(ValueError, match="derives each row's global scale from its maximum"):
        G.sparse(x, halved, 0.1)


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
    assert same_record(on_gpu.to("cpu"), record)
    assert same_record(on_gpu.pack().to("cpu"), record.pack())
    want = G.round_guided_sparse(local_x, record)
    assert ops.quantize_site(local_x.cuda(), guidance=on_gpu).map(lambda m: m.cpu()).equal(want)
    fake = ops.fake_quantize(local_x.cuda(), guidance=on_gpu)
    assert torch.equal(fake.cpu(), R.dequantize(want, torch.bfloat16))
    rows = torch.randperm(128, generator=g).cuda()
    picked = on_gpu.select_rows(rows)
    assert same_record(picked.to("cpu"), record.select_rows(rows.cpu()))
