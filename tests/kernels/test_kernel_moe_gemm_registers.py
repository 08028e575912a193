"""The register expert GEMM (`moe_gemm_registers`, through `moe_gemm.launch(registers=...)`)
against the same checks as `moe_gemm`'s program (test_kernel_moe_gemm.py): the weights entering
the products bitwise through one-hot rows, general rows within the float64 bound, gathered rows
bitwise the gathered product. The kernel is Gluon, compiled only: its tests run on the GPU,
under both of its decodes; on the CPU only the checks and tile rules run.
"""

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from test_kernel_moe_gemm import (  # noqa: E402
    QWEN3_SHAPES,
    assert_fp32_accumulated,
    assert_weights_bitwise,
    bf16_weights,
    every_byte_weights,
    onehot_rows,
    random_weights,
    routed,
)

from fp4rl.fp4.format import MIN_GLOBAL_SCALE  # noqa: E402
from fp4rl.fp4.tensor import NVFP4Tensor  # noqa: E402
from fp4rl.kernels import moe_gemm, moe_tiles  # noqa: E402
from fp4rl.kernels.moe_tiles import GemmTile  # noqa: E402

REGISTER_TILES = [
    None,  # the launcher's own choice
    GemmTile(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=2),
    GemmTile(block_m=8, block_n=64, block_k=256, num_warps=4, num_stages=2),
    GemmTile(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=1),
    GemmTile(block_m=32, block_n=128, block_k=32, num_warps=8, num_stages=2),
    GemmTile(block_m=16, block_n=32, block_k=64, num_warps=2, num_stages=2),
    # K split across warps: each of 4 (2) warps takes its own 64 (128) of a step's K.
    GemmTile(block_m=16, block_n=16, block_k=64, num_warps=4, num_stages=2, split_k=4),
    GemmTile(block_m=8, block_n=32, block_k=128, num_warps=4, num_stages=1, split_k=2),
    GemmTile(block_m=16, block_n=64, block_k=64, num_warps=8, num_stages=2, split_k=2),
    # Rows past an expert's last read it again, unmasked.
    GemmTile(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=2, clamp_rows=True),
]
SPLIT_TILE = REGISTER_TILES[6]
CLAMPED_TILE = REGISTER_TILES[9]


DECODES = pytest.mark.parametrize("lookup", [False, True], ids=["arithmetic", "lookup"])


@pytest.fixture
def decode(lookup, monkeypatch):
    """The register kernel's decode: by arithmetic per code, or by byte-table lookup."""
    from fp4rl.kernels import moe_gemm_registers

    monkeypatch.setattr(moe_gemm_registers, "LOOKUP", lookup)
    return lookup


@pytest.mark.gpu
@DECODES
@pytest.mark.parametrize("shape", list(QWEN3_SHAPES), ids=str)
def test_registers_weights_bitwise_on_gpu(shape, decode):
    """Every weight of four experts, read off the register kernel with one-hot rows: the
    contract's bits, through the permuted K of each tile."""
    n, k = QWEN3_SHAPES[shape]
    w = random_weights(128, n, k, "cuda", seed=17)
    experts = [0, 5, 77, 127]
    x, counts = onehot_rows(k, experts, 128, "cuda")
    for tile in REGISTER_TILES:
        y = moe_gemm.launch(x, w, counts, config=tile, registers=True)
        assert_weights_bitwise(y, w, experts, f"{shape}, register tile {tile}")


# The recipe's smallest global scale and one just above it (the lookup's doubled table entries
# are exact from there up, test_kernel_fragments.py), and the largest from finite input.
EDGE_GLOBAL_SCALES = (MIN_GLOBAL_SCALE, 2.0**116, 0.0, 1.5 * MIN_GLOBAL_SCALE)


@pytest.mark.gpu
@DECODES
@pytest.mark.parametrize("scales", ["usual", "edges"])
def test_registers_every_byte_bitwise_on_gpu(decode, scales):
    """Every code byte, every finite block-scale byte and global scales from 2**-110 to 2**100
    (and 0), then at the recipe's edges: the register kernel's weights are bitwise the
    reference's."""
    e, n, k = 4, 64, 256
    if scales == "edges":
        w = every_byte_weights(e, n, k, seed=4, global_scales=EDGE_GLOBAL_SCALES)
    else:
        w = every_byte_weights(e, n, k, seed=3)
    experts = [0, 1, 3]
    x, counts = onehot_rows(k, experts, e, "cuda")
    for tile in REGISTER_TILES:  # narrowed to N = 64, with as many warps as fit
        y = moe_gemm.launch(x, w.map(lambda t: t.cuda()), counts, config=tile, registers=True)
        assert_weights_bitwise(y, w, experts, f"register tile {tile}, {scales} global scales")


@pytest.mark.gpu
@DECODES
@pytest.mark.parametrize("shape", list(QWEN3_SHAPES), ids=str)
@pytest.mark.parametrize("tokens", [1, 8, 64, 128, 256, 1024, 4096])
def test_registers_qwen3_shapes_on_gpu(shape, tokens, decode):
    n, k = QWEN3_SHAPES[shape]
    g = torch.Generator().manual_seed(tokens)
    w = random_weights(128, n, k, "cuda", seed=tokens)
    counts = routed(tokens, 128, 8, g)
    x = torch.randn(int(counts.sum()), k, generator=g).to(torch.bfloat16).cuda()
    for tile in (None, REGISTER_TILES[2], SPLIT_TILE, CLAMPED_TILE):
        y = moe_gemm.launch(x, w, counts.cuda(), config=tile, registers=True)
        assert_fp32_accumulated(y, x, w, counts, f"registers {shape} {tokens} tokens {tile}")


def dispatched(tokens, top_k, seed):
    """(generator, w2-shaped weights of 128 experts, x [tokens, K], the dispatch order, the
    expert counts) of random top-k routing, on the GPU."""
    n, k = QWEN3_SHAPES["w2"]
    g = torch.Generator().manual_seed(seed)
    w = random_weights(128, n, k, "cuda", seed=seed)
    ids = torch.randn(tokens, 128, generator=g).topk(top_k, dim=-1).indices
    order = torch.argsort(ids.flatten(), stable=True).cuda()
    counts = torch.bincount(ids.flatten(), minlength=128).cuda()
    x = torch.randn(tokens, k, generator=g).to(torch.bfloat16).cuda()
    return g, w, x, order, counts


def assert_poison_reaches_exactly_its_outputs(rows, w: NVFP4Tensor, counts, config=None):
    """With a NaN global scale (the first expert with rows) and a NaN block scale (column 5 of
    every later expert), the register programs' NaN outputs are exactly `moe_gemm`'s program's:
    the first expert's rows and column 5."""
    global_scale = w.global_scale.clone()
    block_scale = w.block_scale.clone()
    first = int(torch.nonzero(counts)[0])
    global_scale[first] = math.nan
    block_scale.view(torch.uint8)[first + 1 :, 5, 3] = 0x7F
    poisoned = NVFP4Tensor(w.codes, block_scale, global_scale)
    y = moe_gemm.launch(rows, poisoned, counts, config=config, registers=True)
    assert torch.equal(y.isnan(), moe_gemm.launch(rows, poisoned, counts, registers=False).isnan())
    assert y[: int(counts[first])].isnan().all() and y[:, 5].isnan().all()


@pytest.mark.gpu
@DECODES
def test_registers_gather_poison_and_graph_on_gpu(decode):
    """Rows read through the dispatch order are bitwise the gathered rows' product; NaN scales
    poison exactly the outputs they touch; a captured launch follows new counts and rows."""
    tokens, top_k = 37, 8
    g, w, x, order, counts = dispatched(tokens, top_k, seed=23)
    k = x.shape[1]
    for tile in (None, SPLIT_TILE, CLAMPED_TILE):
        got = moe_gemm.launch(x, w, counts, order_A=order, top_k=top_k, config=tile,
                              registers=True)  # fmt: skip
        rows = x[order // top_k].contiguous()
        want = moe_gemm.launch(rows, w, counts, config=tile, registers=True)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), tile

    rows = x[order // top_k].contiguous()
    assert_poison_reaches_exactly_its_outputs(rows, w, counts)

    rows_in = torch.zeros(tokens * top_k, k, dtype=torch.bfloat16, device="cuda")
    counts_in = torch.zeros(128, dtype=torch.int64, device="cuda")
    rows_in.copy_(rows)
    counts_in.copy_(counts)
    moe_gemm.launch(rows_in, w, counts_in, registers=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.launch(rows_in, w, counts_in, registers=True)
    for _ in range(2):
        rows_in.copy_(torch.randn(rows_in.shape, generator=g).to(torch.bfloat16))
        counts_in.copy_(routed(tokens, 128, top_k, g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, moe_gemm.launch(rows_in, w, counts_in, registers=True))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [REGISTER_TILES[1], REGISTER_TILES[2], SPLIT_TILE], ids=str)
def test_clamped_rows_store_the_masked_tiles_bits_on_gpu(tile):
    """A tile with its rows clamped stores bitwise what the same tile with masked rows stores
    (each output column is one row's), gathered or not, with experts' rows ending mid-tile."""
    top_k = 8
    _, w, x, order, counts = dispatched(45, top_k, seed=31)
    clamped = dataclasses.replace(tile, clamp_rows=True)
    gathered = {"order_A": order, "top_k": top_k}
    for rows, how in ((x, gathered), (x[order // top_k].contiguous(), {})):
        masked_y, clamped_y = (
            moe_gemm.launch(rows, w, counts, config=t, registers=True, **how)
            for t in (tile, clamped)
        )
        assert torch.equal(clamped_y.view(torch.int16), masked_y.view(torch.int16)), (tile, how)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(QWEN3_SHAPES), ids=str)
def test_permuted_rows_give_the_real_orders_bits_on_gpu(shape):
    """x's rows stored in `permuted_rows`' order (``x_permuted_by``) give bitwise the product of
    the rows in real order, under register tiles of K steps from 32 to 256 (each its own), split
    and clamped among them, gathered or not, with experts' rows ending mid-tile; a captured
    launch follows new permuted rows."""
    from fp4rl.kernels.launch import permuted_rows

    n, k = QWEN3_SHAPES[shape]
    top_k = 8
    g = torch.Generator().manual_seed(41)
    w = random_weights(128, n, k, "cuda", seed=41)
    ids = torch.randn(45, 128, generator=g).topk(top_k, dim=-1).indices
    order = torch.argsort(ids.flatten(), stable=True).cuda()
    counts = torch.bincount(ids.flatten(), minlength=128).cuda()
    x = torch.randn(45, k, generator=g).to(torch.bfloat16).cuda()
    rows = x[order // top_k].contiguous()
    auto = moe_tiles.register_config_for(rows.shape[0], 128, k)  # the launcher's own tile
    tiles = (REGISTER_TILES[2], REGISTER_TILES[3], REGISTER_TILES[4], SPLIT_TILE, REGISTER_TILES[7],
             CLAMPED_TILE)  # fmt: skip
    for tile in (auto, *tiles):
        step = tile.fitted(n, k).block_k
        for rows_in, how in ((x, {"order_A": order, "top_k": top_k}), (rows, {})):
            want = moe_gemm.launch(rows_in, w, counts, config=tile, registers=True, **how)
            got = moe_gemm.launch(permuted_rows(rows_in, step), w, counts, config=tile,
                                  registers=True, x_permuted_by=step, **how)  # fmt: skip
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (tile, how)

    step = auto.fitted(n, k).block_k
    rows_in = permuted_rows(rows, step)
    moe_gemm.launch(rows_in, w, counts, x_permuted_by=step)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.launch(rows_in, w, counts, x_permuted_by=step)
    fresh = torch.randn(rows.shape, generator=g).to(torch.bfloat16).cuda()
    rows_in.copy_(permuted_rows(fresh, step))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, moe_gemm.launch(fresh, w, counts))


def test_permuted_rows_put_each_lanes_pieces_side_by_side():
    """`permuted_rows`' order is the kernel's: the place the kernel reads real k from (its
    pointer formula, restated) holds k, every step of every row, and a quad's four lanes read
    one 64-byte stretch per piece."""
    from fp4rl.kernels.launch import permuted_rows

    for block_k in (32, 64, 128, 256):
        k = 3 * block_k
        x = torch.arange(2 * k, dtype=torch.float32).reshape(2, k)
        got = permuted_rows(x, block_k)
        q = block_k // 4
        real = torch.arange(block_k)
        # Where the kernel reads real k from, as `_moe_gemm_registers_kernel` computes it.
        place = 8 * (4 * ((real % q) // 8) + real // q) + real % 8
        assert sorted(place.tolist()) == list(range(block_k)), block_k
        for step in range(3):
            for row in range(2):
                want = x[row, step * block_k + real]
                assert torch.equal(got[row, step * block_k + place], want), (block_k, step)
        # Lane c's piece j (real k from c * q + 8 * j): the four lanes' pieces are adjacent.
        for j in range(q // 8):
            starts = [int(place[c * q + 8 * j]) for c in range(4)]
            assert starts == [32 * j + 8 * c for c in range(4)], (block_k, j, starts)
    assert permuted_rows(x[:, :32], 32).equal(x[:, :32])  # one piece a lane: the real order
    with pytest.raises(ValueError, match="permuted_by must be a power of two >= 32; got 48"):
        permuted_rows(x, 48)
    with pytest.raises(ValueError, match="rows of 96 values cannot be permuted in steps of 64"):
        permuted_rows(x[:, :96], 64)


@pytest.mark.gpu
def test_decode_batches_take_the_register_kernel_on_gpu():
    """Left to the launcher, packed weights take the register kernel up to
    REGISTERS_MAX_ROWS_PER_EXPERT rows per expert and `moe_gemm`'s program above, except on
    Hopper, whose register programs (the warpgroup MMA's tiles) take every batch; a tile or the
    accumulator's scale asked for keeps `moe_gemm`'s program."""
    from fp4rl.kernels.launch import wgmma_refusal

    n, k = QWEN3_SHAPES["w2"]
    g = torch.Generator().manual_seed(29)
    w = random_weights(128, n, k, "cuda", seed=29)
    bound = int(moe_tiles.REGISTERS_MAX_ROWS_PER_EXPERT * 128) // 8
    hopper = wgmma_refusal(w.codes.device) is None
    for tokens, registers in ((8, True), (bound, True), (bound + 1, hopper)):
        counts = routed(tokens, 128, 8, g).cuda()
        x = torch.randn(tokens * 8, k, generator=g).to(torch.bfloat16).cuda()
        want = moe_gemm.launch(x, w, counts, registers=registers)
        other = moe_gemm.launch(x, w, counts, registers=not registers)
        got = moe_gemm.launch(x, w, counts)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), tokens
        assert not torch.equal(got.view(torch.int16), other.view(torch.int16)), tokens
    tile = moe_tiles.config_for(64, 128)
    got = moe_gemm.launch(x[:64], w, counts, config=tile)
    assert torch.equal(got, moe_gemm.launch(x[:64], w, counts, config=tile, registers=False))


def test_register_tiles_by_rows_per_expert():
    """The register kernel's tile: 8 rows up to 5.5 rows per expert, below half a row (one
    token at top-8 of 128) split across two warps per column for w13's long K; 16 rows and 128
    columns up to 12, then the wide tile; the launcher's own choice reaches as far as
    REGISTERS_MAX_ROWS_PER_EXPERT."""
    for rows in (1, 8, 63):
        assert moe_tiles.register_config_for(rows, 128) == moe_tiles.REGISTERS_SHORT_TILE
        assert moe_tiles.register_config_for(rows, 128, k=768) == moe_tiles.REGISTERS_SHORT_TILE
        assert moe_tiles.register_config_for(rows, 128, k=2048) == moe_tiles.REGISTERS_SPLIT_TILE
    assert moe_tiles.register_config_for(64, 128, k=2048) == moe_tiles.REGISTERS_SHORT_TILE
    for rows in (64, 512, 704):  # 8 to 88 tokens
        assert moe_tiles.register_config_for(rows, 128) == moe_tiles.REGISTERS_SHORT_TILE
    for rows in (705, 768, 1024, 1280, 1536):  # 89 to 192 tokens
        assert moe_tiles.register_config_for(rows, 128) == moe_tiles.REGISTERS_MEDIUM_TILE
    assert moe_tiles.register_config_for(1537, 128) == moe_tiles.REGISTERS_WIDE_TILE
    assert moe_tiles.REGISTERS_SHORT_TILE.block_m == 8
    assert moe_tiles.register_config_for(8192, 128) == moe_tiles.REGISTERS_WIDE_TILE
    assert moe_tiles.REGISTERS_MAX_ROWS_PER_EXPERT * 128 >= 8192  # 1,024 tokens at top-8


def test_registers_checks_name_the_values(device):
    from fp4rl.kernels import moe_gemm_registers

    w = random_weights(4, 32, 64, device, seed=3)
    counts = torch.tensor([1, 0, 0, 0], device=device)
    x = torch.randn(1, 64, device=device).to(torch.bfloat16)
    if device == "cpu":
        with pytest.raises(
            ValueError, match=r"registers \(x_AK.s device\) runs on a CUDA GPU only; got cpu"
        ):
            moe_gemm.launch(x, w, counts, registers=True)
    with pytest.raises(ValueError, match="registers is for NVFP4 weights; w is bfloat16"):
        moe_gemm.launch(x, bf16_weights(4, 32, 64, device, 3), counts, registers=True)
    with pytest.raises(ValueError, match="global_scale_on_accumulator is not supported there"):
        moe_gemm.launch(x, w, counts, registers=True, global_scale_on_accumulator=True)
    with pytest.raises(ValueError, match="block_m=8: 8 rows are for the register kernel only"):
        moe_gemm.launch(x, w, counts, config=GemmTile(8, 32, 64, 4, 2))
    with pytest.raises(ValueError, match="x_permuted_by=64: .*; this launch runs moe_gemm's"):
        moe_gemm.launch(x, w, counts, registers=False, x_permuted_by=64)
    if device == "cuda":
        tile = GemmTile(16, 32, 32, 2, 2)
        with pytest.raises(ValueError, match=r"x_permuted_by=64: .* runs it with GemmTile\("):
            moe_gemm.launch(x, w, counts, config=tile, registers=True, x_permuted_by=64)
    check = moe_gemm_registers.check_tile
    with pytest.raises(ValueError, match="block_m must be at least 8 .*; got 4"):
        check(4, 64, 64, 4, 64, 64)
    with pytest.raises(ValueError, match="block_n=32 must be at least 16 x num_warps=4"):
        check(16, 32, 64, 4, 64, 64)
    with pytest.raises(ValueError, match="block_k must be at least 32; got 16"):
        check(16, 64, 16, 4, 64, 64)
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4 or 8; got 3"):
        check(16, 64, 64, 3, 64, 64)
    with pytest.raises(ValueError, match=r"must divide the weight's N=96 and K=64"):
        check(16, 64, 64, 4, 96, 64)
    with pytest.raises(ValueError, match=r"split_k=2: .* must divide the weight's N=64 and K=192"):
        check(16, 64, 64, 4, 64, 192, split_k=2)
    with pytest.raises(ValueError, match=r"split_k must be 1, 2, 4 or 8 and divide num_warps=2"):
        check(16, 64, 64, 2, 64, 64, split_k=4)
    with pytest.raises(ValueError, match=r"block_n=16 must be at least 16 x num_warps=4 // split"):
        check(16, 16, 64, 4, 64, 64, split_k=2)
    check(16, 16, 64, 4, 64, 256, split_k=4)
    with pytest.raises(ValueError, match="split_k=2: splitting K is for the register kernel only"):
        moe_gemm.launch(x, w, counts, config=GemmTile(16, 32, 32, 4, 2, split_k=2), registers=False)


def test_split_tiles_fit_the_weight():
    """A split tile's step (block_k x split_k) narrows to divide K: its K step first, down to
    64, then its split; a split must be a power of two dividing the warps."""
    tile = GemmTile(block_m=16, block_n=16, block_k=256, num_warps=4, num_stages=2, split_k=4)
    assert tile.fitted(1536, 2048) == tile
    assert tile.fitted(2048, 768) == GemmTile(16, 16, 64, 4, 2, split_k=4)  # 3 steps of 256
    assert tile.fitted(64, 64) == GemmTile(16, 16, 64, 4, 2, split_k=1)
    assert GemmTile(16, 16, 32, 4, 2, split_k=2).fitted(64, 96) == GemmTile(16, 16, 32, 4, 2)
    for split_k in (0, 3, 8):
        with pytest.raises(ValueError, match=f"split_k must be a power of two dividing "
                                             f"num_warps=4; got {split_k}"):  # fmt: skip
            GemmTile(16, 16, 64, 4, 2, split_k=split_k)
