"""The decode-size projection kernel against float64, against itself at other batches, and
against cuBLAS.

What each output is held to:
- against the float64 product of the same BF16 (FP16) values, ``ref = x.double() @ W.double().T``:
  the kernel's FP32 sum ``s`` of exact products is within ``e = K * 2**-23 * (|x| @ |W|.T)`` of
  ref (K additions of at most one FP32 ulp each: twice the round-to-nearest bound, which allows
  for the tensor cores' own rounding of their sums), and its one rounding adds at most
  ``u * |s|`` (u = 2**-8 for BF16, 2**-11 for FP16) or, below the normal range, half the
  subnormal spacing ``tiny / 2``, so ``|y - ref| <= u * |ref| + (1 + u) * e + tiny / 2``.
  Where ``e <= 2**-9 * |ref|`` (half an ulp of ref at most) y is at most one unit in the last
  place from ``dtype(ref)``; in practice most outputs equal ``dtype(ref)`` (the test asks 90 %:
  the FP32 error is ~1e-7 of the output, so only outputs that near a rounding boundary differ);
- against itself: a row's bits do not depend on M, on the other rows, on where the row sits, or
  on the tile (bitwise, NaN rows included), with K split across programs or not; a launch
  leaves its counters at 0, so the next one gives the same bits; a K of one slice gives the bits
  of the unsplit kernel;
- against ``torch.nn.functional.linear`` on the GPU (cuBLAS, FP32 reductions): within the sum of
  both sides' bounds above, and at least 95 % bitwise equal.

A split sum (slices of K added in order) has at most K additions too: the bound is the same.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from fp4rl import ops  # noqa: E402
from fp4rl.kernels import skinny_gemm  # noqa: E402
from fp4rl.kernels.skinny_gemm import MAX_ROWS, SkinnyTile  # noqa: E402

INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def inputs(M: int, K: int, Ns, device, seed: int, dtype=torch.bfloat16):
    """x ``[M, K]`` and weights ``[N_i, K]``, Gaussian with the weights' scale of a trained
    projection (outputs of order one)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    weights = [(torch.randn(n, K, generator=g) * K**-0.5).to(dtype) for n in Ns]
    return x.to(device), [w.to(device) for w in weights]


def with_cancelling_products(x, weights):
    """x and weights with two pairs of large products that cancel exactly (columns 0 and K/2 + 44,
    in different BLOCK_K steps at K = 512, and 5 and 100): each FP32 sum then rounds at
    ``2**-24 * 2**14`` of its terms before they cancel, so that its order shows in about one
    BF16 output in ten (summed in steps of 128 instead of 256: 11 % differ). With Gaussian rows
    alone another order would change a few outputs in 10**4."""
    x, weights = x.clone(), [w.clone() for w in weights]
    K = x.shape[1]
    for a, b in ((0, K // 2 + 44), (5, 100)):
        x[:, a] = x[:, b] = 2.0**14
        for w in weights:
            w[:, b] = -w[:, a]
    return x, weights


def ordered(t: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers in the order of their values (±0 both 0)."""
    bits = t.view(INT_OF[t.dtype]).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered(a) - ordered(b)).abs()


def fp32_sum_bound(x, w) -> tuple[torch.Tensor, torch.Tensor]:
    """(ref, e): the float64 product and the FP32 accumulation bound of the docstring."""
    ref = x.double() @ w.double().T
    return ref, x.shape[1] * 2.0**-23 * (x.double().abs() @ w.double().abs().T)


def assert_fp32_accumulated(y, x, w, what: str, most_equal: float = 0.9) -> None:
    """y within the docstring's bound of the float64 product, one ulp from its rounding where
    the FP32 sum is closer than half an ulp, and mostly equal to it."""
    u = UNIT_ROUNDOFF[y.dtype]
    ref, e = fp32_sum_bound(x, w)
    tiny = torch.finfo(y.dtype).smallest_normal * torch.finfo(y.dtype).eps
    bound = u * ref.abs() + (1 + u) * e + tiny / 2
    err = (y.double() - ref).abs()
    bad = ~(err <= bound)  # NaN fails
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} outputs outside the bound; worst excess "
        f"{float((err - bound).max()):.3g}"
    )
    rounded = ref.to(y.dtype)
    close = e <= 2.0**-9 * ref.abs()
    far = close & (ulp_distance(y, rounded) > 1)
    assert not far.any(), f"{what}: {int(far.sum())} outputs more than one ulp from {y.dtype}(ref)"
    equal = (y == rounded).double().mean().item()
    assert equal >= most_equal, f"{what}: only {equal:.4f} equal to {y.dtype}(ref)"


def assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    bad = got.view(INT_OF[got.dtype]) != want.view(INT_OF[want.dtype])
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} outputs differ"


# (K, N of each weight): one to three weights; N not a multiple of BLOCK_N is masked (N = 1 too:
# the launch never specializes it); K = 512 takes two steps of BLOCK_K = 256, so the accumulator
# carries across steps.
SHAPES = [(32, (16,)), (64, (48, 1)), (128, (64, 24, 40)), (512, (32, 16, 16))]


@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("K,Ns", SHAPES, ids=str)
def test_matches_float64(device, M, K, Ns):
    x, weights = inputs(M, K, Ns, device, seed=M * 1000 + K)
    outs = skinny_gemm.launch(x, weights)
    assert len(outs) == len(weights)
    for i, (y, w) in enumerate(zip(outs, weights, strict=True)):
        assert y.shape == (M, w.shape[0]) and y.dtype == x.dtype
        assert_fp32_accumulated(y.cpu(), x.cpu(), w.cpu(), f"M={M} K={K} weight {i}")


def test_fp16(device):
    x, weights = inputs(5, 128, (32, 48), device, seed=3, dtype=torch.float16)
    for i, (y, w) in enumerate(zip(skinny_gemm.launch(x, weights), weights, strict=True)):
        assert y.dtype == torch.float16
        assert_fp32_accumulated(y.cpu(), x.cpu(), w.cpu(), f"fp16 weight {i}")


def test_rows_do_not_depend_on_the_batch(device):
    """Row r of a 64-row launch has the bits of row r launched alone, of the same row in the
    first M rows (M across the tile buckets' bounds), and of the row at another position."""
    K, Ns = 512, (64, 24, 40)
    x, weights = with_cancelling_products(*inputs(MAX_ROWS, K, Ns, device, seed=11))
    full = skinny_gemm.launch(x, weights)
    for M in (7, 16, 17, 33):
        for i, y in enumerate(skinny_gemm.launch(x[:M].contiguous(), weights)):
            assert_bits(y, full[i][:M], f"rows 0..{M - 1}, weight {i}")
    flipped = skinny_gemm.launch(x.flip(0).contiguous(), weights)
    for i, y in enumerate(flipped):
        assert_bits(y, full[i].flip(0), f"reversed rows, weight {i}")
    for r in range(MAX_ROWS):
        for i, y in enumerate(skinny_gemm.launch(x[r : r + 1].contiguous(), weights)):
            assert_bits(y, full[i][r : r + 1], f"row {r} alone, weight {i}")


@pytest.mark.parametrize(
    "tile",
    [
        SkinnyTile(block_m=16, block_n=16, num_warps=4, num_stages=1),  # 3 row tiles at M = 40
        SkinnyTile(block_m=16, block_n=32, num_warps=2, num_stages=3),
        SkinnyTile(block_m=64, block_n=16, num_warps=8, num_stages=2),
    ],
    ids=str,
)
def test_tiles_give_the_same_bits(device, tile):
    x, weights = with_cancelling_products(*inputs(40, 512, (64, 24, 40), device, seed=12))
    for i, (got, want) in enumerate(
        zip(skinny_gemm.launch(x, weights, tile), skinny_gemm.launch(x, weights), strict=True)
    ):
        assert_bits(got, want, f"tile {tile}, weight {i}")


def test_configs_share_one_reduction_step():
    """Every tile the launcher picks sums in the same order: one block_k and one slice_k,
    BLOCK_N <= 32."""
    assert {tile.block_k for _, tile in skinny_gemm.CONFIGS} == {skinny_gemm.BLOCK_K}
    assert {tile.slice_k for _, tile in skinny_gemm.CONFIGS} == {skinny_gemm.SLICE_K}
    assert {tile.block_n for _, tile in skinny_gemm.CONFIGS} <= {16, 32}
    assert skinny_gemm.CONFIGS[-1][0] == MAX_ROWS
    assert [skinny_gemm.tile_for(m) for m in (1, 16, 17, 33, 64)] == [
        skinny_gemm.CONFIGS[i][1] for i in (0, 0, 1, 2, 2)
    ]
    assert [skinny_gemm.block_k_for(k) for k in (16, 48, 256, 384, 2048)] == [16, 16, 256, 128, 256]
    # Qwen3-30B-A3B: q/k/v (K = 2048) in 4 slices, o (K = 4096) in 8; one slice up to SLICE_K.
    assert [skinny_gemm.slices_for(k) for k in (16, 512, 528, 2048, 4096)] == [1, 1, 2, 4, 8]
    assert skinny_gemm.slices_for(4096, 0) == 1


def test_a_nan_row_stays_in_its_row(device):
    x, weights = inputs(9, 128, (32, 16), device, seed=13)
    clean = skinny_gemm.launch(x, weights)
    x[4, 17] = float("nan")
    x[6, 3] = float("inf")
    poisoned = skinny_gemm.launch(x, weights)
    for i, (got, want) in enumerate(zip(poisoned, clean, strict=True)):
        assert got[4].isnan().all(), f"weight {i}: the NaN row is not all NaN"
        assert not got[6].isfinite().any(), f"weight {i}: the inf row has finite outputs"
        others = [r for r in range(9) if r not in (4, 6)]
        assert_bits(got[others], want[others], f"weight {i}: the other rows")


def test_no_rows(device):
    x, weights = inputs(0, 64, (16, 32), device, seed=14)
    outs = skinny_gemm.launch(x, weights)
    assert [tuple(y.shape) for y in outs] == [(0, 16), (0, 32)]


def _bad_inputs(device):
    """(what is wrong, x, weights, a fragment the error must contain)."""
    x, (w,) = inputs(4, 64, (16,), device, seed=15)
    return [
        ("fp32 x", x.float(), [w.float()], "torch.float32"),
        ("1-D x", x[0], [w], "shape (64,)"),
        ("too many rows", x.repeat(17, 1), [w], "M=68"),
        ("K not a multiple of 16", x[:, :40], [w[:, :40]], "K=40"),
        ("strided x", x[:, ::2], [w[:, :32]], "contiguous"),
        ("no weights", x, [], "got 0"),
        ("four weights", x, [w] * 4, "got 4"),
        ("a tensor, not a list", x, w, "got Tensor"),
        ("weight dtype", x, [w, w.half()], "weights[1] must have x_MK's dtype"),
        ("weight K", x, [w[:, :48].contiguous()], "got shape (16, 48)"),
        ("strided weight", x, [w.t().contiguous().t()], "weights[0] must be contiguous"),
        ("weight device", x, [w.to("meta")], "meta"),
    ]


@pytest.mark.parametrize("case", range(12))
def test_bad_inputs_raise_naming_the_value(device, case):
    what, x, weights, fragment = _bad_inputs(device)[case]
    assert not skinny_gemm.supported(x, weights), what
    with pytest.raises(ValueError) as err:
        skinny_gemm.launch(x, weights)
    assert fragment in str(err.value), f"{what}: {err.value}"


def test_bad_tiles_raise():
    with pytest.raises(ValueError, match="block_n must be 16 or 32; got 64"):
        SkinnyTile(block_m=16, block_n=64, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16; got 8"):
        SkinnyTile(block_m=8, block_n=16, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16; got 96"):
        SkinnyTile(block_m=16, block_n=16, num_warps=4, num_stages=2, block_k=96)
    with pytest.raises(
        ValueError, match="slice_k must be 0 or a power of two >= block_k=256; got 128"
    ):
        SkinnyTile(block_m=16, block_n=16, num_warps=4, num_stages=2, slice_k=128)
    with pytest.raises(
        ValueError, match="slice_k must be 0 or a power of two >= block_k=32; got 96"
    ):
        SkinnyTile(block_m=16, block_n=16, num_warps=4, num_stages=2, block_k=32, slice_k=96)


def test_ops_project_is_none_off_the_gpu():
    x, weights = inputs(2, 64, (16, 16), "cpu", seed=16)
    assert ops.project(x, weights) is None


def test_one_weight_takes_the_kernel_at_fewer_rows():
    """Several weights of one input go to the kernel up to MAX_ROWS rows (one launch for all);
    one weight only up to MAX_ROWS_ONE_WEIGHT, past which cuBLAS measured faster."""
    assert skinny_gemm.preferred(MAX_ROWS, 3) and skinny_gemm.preferred(MAX_ROWS, 2)
    assert skinny_gemm.preferred(skinny_gemm.MAX_ROWS_ONE_WEIGHT, 1)
    assert not skinny_gemm.preferred(skinny_gemm.MAX_ROWS_ONE_WEIGHT + 1, 1)
    assert not skinny_gemm.preferred(MAX_ROWS + 1, 3)


# ---- K split across programs, at sizes the interpreter runs quickly ----------------------------

# Steps of 32 in slices of 64: K = 256 in 4 slices, 192 in 3, 160 in 3 (the last one step).
SPLIT = dict(block_k=32, slice_k=64)
SPLIT_SHAPES = [(256, (48,)), (160, (16, 32)), (192, (48, 1, 24))]


def split_tile(block_m: int = 16, block_n: int = 16, num_warps: int = 4) -> SkinnyTile:
    return SkinnyTile(block_m, block_n, num_warps, num_stages=2, **SPLIT)


@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("K,Ns", SPLIT_SHAPES, ids=str)
def test_split_matches_float64(device, M, K, Ns):
    tile = split_tile()
    assert skinny_gemm.slices_for(K, tile.slice_k) == -(-K // 64)
    x, weights = inputs(M, K, Ns, device, seed=M * 1000 + K + 1)
    for i, (y, w) in enumerate(zip(skinny_gemm.launch(x, weights, tile), weights, strict=True)):
        assert y.shape == (M, w.shape[0]) and y.dtype == x.dtype
        assert_fp32_accumulated(y.cpu(), x.cpu(), w.cpu(), f"split M={M} K={K} weight {i}")


def test_split_rows_do_not_depend_on_the_batch(device):
    """With K split, row r has the same bits whatever M, the row tile, the column tile and the
    warps: the 64-row launch of one tile against fewer rows and single rows by others."""
    K, Ns = 256, (48, 16)
    x, weights = with_cancelling_products(*inputs(MAX_ROWS, K, Ns, device, seed=21))
    full = skinny_gemm.launch(x, weights, split_tile(block_m=64, block_n=32))
    tiles = {7: split_tile(), 17: split_tile(32, 16, 2), 33: split_tile(64, 16, 8)}
    for M, tile in tiles.items():
        for i, y in enumerate(skinny_gemm.launch(x[:M].contiguous(), weights, tile)):
            assert_bits(y, full[i][:M], f"rows 0..{M - 1}, tile {tile}, weight {i}")
    for r in (0, 13, MAX_ROWS - 1):
        for i, y in enumerate(skinny_gemm.launch(x[r : r + 1].contiguous(), weights, split_tile())):
            assert_bits(y, full[i][r : r + 1], f"row {r} alone, weight {i}")


def test_split_leaves_its_counters_at_zero(device):
    """The last slice of each output tile resets its counter: the next launch counts from 0 and
    gives the same bits (the tiles of 3 row blocks x 3 + 2 column blocks use 15 counters)."""
    x, weights = with_cancelling_products(*inputs(40, 256, (48, 32), device, seed=22))
    tile = split_tile()
    first = skinny_gemm.launch(x, weights, tile)
    assert not skinny_gemm.counters(x.device).any(), "a counter is not back at 0"
    for i, (again, y) in enumerate(zip(skinny_gemm.launch(x, weights, tile), first, strict=True)):
        assert_bits(again, y, f"second launch, weight {i}")
    assert not skinny_gemm.counters(x.device).any(), "a counter is not back at 0"


def test_counters_grow_zeroed_and_keep_the_old_buffer(device):
    before = skinny_gemm.counters(torch.device(device))
    grown = skinny_gemm.counters(torch.device(device), before.numel() + 1)
    assert grown.numel() > before.numel() and not grown.any()
    assert skinny_gemm.counters(torch.device(device)) is grown
    assert any(t is before for t in skinny_gemm._COUNTERS[torch.device(device)])


@pytest.mark.parametrize("K,Ns", [(128, (48, 1)), (512, (32, 16, 16))], ids=str)
def test_one_slice_is_the_unsplit_kernel(device, K, Ns):
    """A K of at most one slice is not split: the bits of the kernel without a split (slice_k 0,
    the M <= 16 tile before the split), by default and with a tile whose slice is K."""
    x, weights = with_cancelling_products(*inputs(9, K, Ns, device, seed=23))
    assert skinny_gemm.slices_for(K) == 1
    unsplit = skinny_gemm.launch(x, weights, SkinnyTile(16, 32, 4, 4, slice_k=0))
    one_slice = SkinnyTile(16, 16, 2, 2, block_k=min(K, skinny_gemm.BLOCK_K), slice_k=K)
    for tile in (None, one_slice):
        for i, (y, want) in enumerate(
            zip(skinny_gemm.launch(x, weights, tile), unsplit, strict=True)
        ):
            assert_bits(y, want, f"tile {tile}, weight {i}")


# ---- on the GPU, at Qwen3-30B-A3B's attention shapes -------------------------------------------

QKV = (2048, (4096, 512, 512))
O = (4096, (2048,))


@pytest.fixture
def fp32_cublas_reductions():
    """cuBLAS reductions in FP32: torch otherwise lets a split-K BF16 GEMM add its partial
    sums in BF16, outside the bound of an FP32 sum."""
    saved = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    yield
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64])
@pytest.mark.parametrize("K,Ns", [QKV, O], ids=["qkv", "o"])
def test_real_shapes_on_gpu(M, K, Ns, fp32_cublas_reductions):
    """The kernel at every row count it takes, and `ops.project` taking it exactly where it is
    preferred (o, one weight: up to `skinny_gemm.MAX_ROWS_ONE_WEIGHT` rows), with its bits."""
    x, weights = inputs(M, K, Ns, "cuda", seed=M + K)
    outs = skinny_gemm.launch(x, weights)
    routed = ops.project(x, weights)
    assert (routed is not None) == skinny_gemm.preferred(M, len(Ns)), f"M={M}, {len(Ns)} weights"
    for i, (got, y) in enumerate(zip(routed or [], outs, strict=False)):
        assert_bits(got, y, f"ops.project, M={M} K={K} weight {i}")
    for i, (y, w) in enumerate(zip(outs, weights, strict=True)):
        what = f"M={M} K={K} weight {i}"
        assert_fp32_accumulated(y, x, w, what)
        cublas = torch.nn.functional.linear(x, w)
        ref, e = fp32_sum_bound(x, w)
        both = 2 * (2.0**-8 * ref.abs() + (1 + 2.0**-8) * e)
        assert ((y.double() - cublas.double()).abs() <= both).all(), f"{what}: vs F.linear"
        same = (y == cublas).double().mean().item()
        assert same >= 0.95, f"{what}: only {same:.4f} equal to F.linear"


@pytest.mark.gpu
@pytest.mark.parametrize("K,Ns", [QKV, O], ids=["qkv", "o"])
def test_batch_invariant_at_real_shapes_on_gpu(K, Ns):
    x, weights = with_cancelling_products(*inputs(MAX_ROWS, K, Ns, "cuda", seed=K))
    full = skinny_gemm.launch(x, weights)
    for M in (8, 16, 17, 33):
        for i, y in enumerate(skinny_gemm.launch(x[:M].contiguous(), weights)):
            assert_bits(y, full[i][:M], f"rows 0..{M - 1}, weight {i}")
    for r in range(MAX_ROWS):
        for i, y in enumerate(skinny_gemm.launch(x[r : r + 1].contiguous(), weights)):
            assert_bits(y, full[i][r : r + 1], f"row {r} alone, weight {i}")


@pytest.mark.gpu
def test_ops_project_on_gpu():
    x, weights = inputs(4, 256, (64, 32), "cuda", seed=17)
    for got, want in zip(ops.project(x, weights), skinny_gemm.launch(x, weights), strict=True):
        assert_bits(got, want, "ops.project")
    big, _ = inputs(MAX_ROWS + 1, 256, (), "cuda", seed=18)
    assert ops.project(big, weights) is None
    one, _ = inputs(skinny_gemm.MAX_ROWS_ONE_WEIGHT + 1, 256, (), "cuda", seed=19)
    assert ops.project(one, weights[:1]) is None
    assert_bits(ops.project(one[:4], weights[:1])[0], skinny_gemm.launch(one[:4], weights[:1])[0],
                "ops.project, one weight")  # fmt: skip
    assert ops.project(x.float(), [w.float() for w in weights]) is None
    assert ops.project(x[:, :40].contiguous(), [w[:, :40].contiguous() for w in weights]) is None


@pytest.mark.gpu
@pytest.mark.parametrize("K,Ns", [QKV, O], ids=["qkv", "o"])
def test_split_is_deterministic_on_gpu(K, Ns):
    """Launches back to back (the programs of each racing to add their tile's slices) give the
    same bits and leave every counter at 0."""
    assert skinny_gemm.slices_for(K) > 1
    for M in (1, 64):
        x, weights = with_cancelling_products(*inputs(M, K, Ns, "cuda", seed=K + M))
        first = skinny_gemm.launch(x, weights)
        runs = [skinny_gemm.launch(x, weights) for _ in range(50)]
        for n, run in enumerate(runs):
            for i, (y, want) in enumerate(zip(run, first, strict=True)):
                assert_bits(y, want, f"M={M} launch {n + 1}, weight {i}")
        assert not skinny_gemm.counters(x.device).any(), f"M={M}: a counter is not back at 0"


@pytest.mark.gpu
@pytest.mark.parametrize("K,Ns", [QKV, O], ids=["qkv", "o"])
def test_captured_in_a_cuda_graph_without_a_sync(K, Ns):
    x, weights = inputs(8, K, Ns, "cuda", seed=19)
    skinny_gemm.launch(x, weights)  # compile and size the counters outside the capture
    fresh = [inputs(8, K, Ns, "cuda", seed=s)[0] for s in (20, 21)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # nothing below may read a value back
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = skinny_gemm.launch(x, weights)
        replays = []
        for new_x in fresh:
            x.copy_(new_x)
            graph.replay()
            replays.append((new_x, [y.clone() for y in outs]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for new_x, got in replays:
        for i, (y, want) in enumerate(zip(got, skinny_gemm.launch(new_x, weights), strict=True)):
            assert_bits(y, want, f"replay, weight {i}")
