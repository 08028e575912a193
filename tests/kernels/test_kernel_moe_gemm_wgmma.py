"""The warpgroup-MMA expert GEMMs (`moe_gemm_wgmma`, a ``wgmma`` `GemmTile` through
`moe_gemm.launch(registers=...)`, and its warp-specialized form `moe_gemm_specialized`, a tile
with ``decoders``) against the register kernel's checks: the weights entering
the products bitwise through one-hot rows (every code and scale byte too), general rows within
the float64 bound, gathered rows bitwise the gathered product, NaN scales poisoning exactly
their outputs, and a CUDA-graph replay. The kernel is Gluon for Hopper, compiled only: its
tests run on an sm_90 GPU; on the CPU the checks and tile rules run.
"""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from test_kernel_moe_gemm import (  # noqa: E402
    QWEN3_SHAPES,
    assert_fp32_accumulated,
    assert_weights_bitwise,
    every_byte_weights,
    onehot_rows,
    random_weights,
    routed,
)
from test_kernel_moe_gemm_registers import (  # noqa: E402
    EDGE_GLOBAL_SCALES,
    assert_poison_reaches_exactly_its_outputs,
    dispatched,
)

from fp4rl.kernels import moe_gemm, moe_tiles  # noqa: E402
from fp4rl.kernels.moe_tiles import GemmTile  # noqa: E402

WGMMA_TILES = [
    *(tile for _, tile in moe_tiles.WGMMA_TILES),
    GemmTile(block_m=8, block_n=64, block_k=64, num_warps=4, num_stages=2, wgmma=True),
    GemmTile(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=2, wgmma=True),
    GemmTile(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=2, wgmma=True),
    # Warp-specialized: 8 decoder warps (a 2- and a 3-buffer ring), and 4.
    GemmTile(16, 128, 128, num_warps=4, num_stages=2, wgmma=True, decoders=8),
    GemmTile(32, 128, 64, num_warps=4, num_stages=3, wgmma=True, decoders=8),
    GemmTile(16, 64, 128, num_warps=4, num_stages=2, wgmma=True, decoders=4),
]


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


HOPPER = pytest.mark.skipif(not hopper(), reason="wgmma is Hopper's (sm_90)")


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("shape", list(QWEN3_SHAPES), ids=str)
def test_wgmma_weights_bitwise_on_gpu(shape):
    """Every weight of four experts, read off each wgmma tile with one-hot rows: the contract's
    bits, through the permuted K of the weights and of x in shared memory."""
    n, k = QWEN3_SHAPES[shape]
    w = random_weights(128, n, k, "cuda", seed=19)
    experts = [0, 5, 77, 127]
    x, counts = onehot_rows(k, experts, 128, "cuda")
    for tile in WGMMA_TILES:
        y = moe_gemm.launch(x, w, counts, config=tile, registers=True)
        assert_weights_bitwise(y, w, experts, f"{shape}, wgmma tile {tile}")


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("scales", ["usual", "edges"])
def test_wgmma_every_byte_bitwise_on_gpu(scales):
    """Every code byte, every finite block-scale byte, and global scales across the range and at
    the recipe's edges: the wgmma tiles' weights are bitwise the reference's (narrowed to N =
    64: one warpgroup)."""
    e, n, k = 4, 64, 256
    if scales == "edges":
        w = every_byte_weights(e, n, k, seed=5, global_scales=EDGE_GLOBAL_SCALES)
    else:
        w = every_byte_weights(e, n, k, seed=6)
    experts = [0, 1, 3]
    x, counts = onehot_rows(k, experts, e, "cuda")
    for tile in WGMMA_TILES:
        y = moe_gemm.launch(x, w.map(lambda t: t.cuda()), counts, config=tile, registers=True)
        assert_weights_bitwise(y, w, experts, f"wgmma tile {tile}, {scales} global scales")


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("shape", list(QWEN3_SHAPES), ids=str)
@pytest.mark.parametrize("tokens", [1, 64, 256, 512, 2048, 4096])
def test_wgmma_qwen3_shapes_on_gpu(shape, tokens):
    """Random rows at Qwen3-30B-A3B's shapes, the launcher's choice and each wgmma tile, within
    the float64 bound of FP32 accumulation."""
    n, k = QWEN3_SHAPES[shape]
    g = torch.Generator().manual_seed(tokens + 1)
    w = random_weights(128, n, k, "cuda", seed=tokens + 1)
    counts = routed(tokens, 128, 8, g)
    x = torch.randn(int(counts.sum()), k, generator=g).to(torch.bfloat16).cuda()
    for tile in (None, *WGMMA_TILES):
        y = moe_gemm.launch(x, w, counts.cuda(), config=tile, registers=True)
        assert_fp32_accumulated(y, x, w, counts, f"wgmma {shape} {tokens} tokens {tile}")


@pytest.mark.gpu
@HOPPER
def test_wgmma_gather_poison_and_graph_on_gpu():
    """Rows read through the dispatch order are bitwise the gathered rows' product; NaN scales
    poison exactly the outputs they touch; the launcher's launch at 300 tokens (a wgmma tile),
    captured in a graph, follows new counts and rows."""
    tokens, top_k = 300, 8
    g, w, x, order, counts = dispatched(tokens, top_k, seed=41)
    k = x.shape[1]
    rows = x[order // top_k].contiguous()
    for tile in WGMMA_TILES:
        got = moe_gemm.launch(x, w, counts, order_A=order, top_k=top_k, config=tile,
                              registers=True)  # fmt: skip
        want = moe_gemm.launch(rows, w, counts, config=tile, registers=True)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), tile

    for tile in WGMMA_TILES:
        assert_poison_reaches_exactly_its_outputs(rows, w, counts, tile)

    rows_in = rows.clone()
    counts_in = counts.clone()
    own = moe_tiles.register_config_for(tokens * top_k, 128, k, wgmma=True)
    assert own.wgmma
    moe_gemm.launch(rows_in, w, counts_in)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.launch(rows_in, w, counts_in)
    for _ in range(2):
        rows_in.copy_(torch.randn(rows_in.shape, generator=g).to(torch.bfloat16))
        counts_in.copy_(routed(tokens, 128, top_k, g))
        graph.replay()
        torch.cuda.synchronize()
        want = moe_gemm.launch(rows_in, w, counts_in, config=own, registers=True)
        assert torch.equal(y, want)


@pytest.mark.gpu
@HOPPER
def test_small_weights_keep_the_register_tiles_on_gpu():
    """A weight whose N or K is not a multiple of 64 (a tiny model's w2, K = 32) never gets a
    wgmma tile from the launcher: at any batch it runs as on other GPUs, within the bound."""
    g = torch.Generator().manual_seed(43)
    for n, k in ((64, 32), (32, 64), (64, 64)):
        w = random_weights(8, n, k, "cuda", seed=43)
        for tokens in (4, 256, 1024):
            counts = routed(tokens, 8, 2, g)
            x = torch.randn(int(counts.sum()), k, generator=g).to(torch.bfloat16).cuda()
            y = moe_gemm.launch(x, w, counts.cuda())
            assert_fp32_accumulated(y, x, w, counts, f"[{n}, {k}], {tokens} tokens")


def test_wgmma_tiles_by_rows_per_expert():
    """With the warpgroup MMA, past 5.5 rows per expert (88 tokens at top-8 of 128): 16 rows up
    to 12 rows per expert, 32 up to 24, 64 up to 128, 128 rows on two warpgroups above; below,
    and without it, the register kernel's tiles as before."""

    def tile(rows):
        return moe_tiles.register_config_for(rows, 128, 2048, wgmma=True)

    for rows in (1, 64, 704):
        assert tile(rows) == moe_tiles.register_config_for(rows, 128, 2048)
        assert not tile(rows).wgmma
    bounds = [(705, 1536), (1537, 3072), (3073, 16384), (16385, 10**6)]
    for (first, last), (_, want) in zip(bounds, moe_tiles.WGMMA_TILES, strict=True):
        assert tile(first) == tile(last) == want
    assert moe_tiles.register_config_for(1536, 128) == moe_tiles.REGISTERS_MEDIUM_TILE
    assert moe_tiles.register_config_for(4096, 128) == moe_tiles.REGISTERS_WIDE_TILE


def test_wgmma_checks_name_the_values(device):
    from fp4rl.kernels import moe_gemm_wgmma

    w = random_weights(4, 64, 64, device, seed=3)
    counts = torch.tensor([1, 0, 0, 0], device=device)
    x = torch.randn(1, 64, device=device).to(torch.bfloat16)
    tile = GemmTile(16, 64, 64, 4, 2, wgmma=True)
    if device == "cpu":
        with pytest.raises(
            ValueError, match=r"a wgmma tile \(x_AK.s device\) runs on a CUDA GPU only; got cpu"
        ):
            moe_gemm.launch(x, w, counts, config=tile, registers=True)
    with pytest.raises(ValueError, match=r"a wgmma tile is for the register programs"):
        moe_gemm.launch(x, w, counts, config=tile, registers=False)
    for extra in ({"split_k": 2}, {"clamp_rows": True}):
        with pytest.raises(ValueError, match="GemmTile.wgmma takes neither split_k nor clamp"):
            GemmTile(16, 64, 64, 4, 2, wgmma=True, **extra)
    check = moe_gemm_wgmma.check_tile
    with pytest.raises(ValueError, match="num_warps must be 4 or 8 .*; got 2"):
        check(16, 64, 64, 2, 2, 64, 64)
    with pytest.raises(ValueError, match="block_n=64 must be a multiple of 16 x num_warps=8"):
        check(16, 64, 64, 8, 2, 64, 64)
    with pytest.raises(ValueError, match=r"block_m must be at most 256 .*; got 512"):
        check(512, 64, 64, 4, 2, 64, 64)
    with pytest.raises(ValueError, match="block_k must be at least 64; got 32"):
        check(16, 64, 32, 4, 2, 64, 64)
    with pytest.raises(ValueError, match="num_stages must be 2 .*; got 3"):
        check(16, 64, 64, 4, 3, 64, 64)
    with pytest.raises(ValueError, match=r"must divide the weight's N=96 and K=64"):
        check(16, 64, 64, 4, 2, 96, 64)
    check(16, 64, 64, 4, 2, 64, 64)


def test_specialized_checks_name_the_values():
    from fp4rl.kernels import moe_gemm_specialized

    with pytest.raises(ValueError, match="GemmTile.decoders is for wgmma tiles; got 8"):
        GemmTile(16, 128, 128, 4, 2, decoders=8)
    check = moe_gemm_specialized.check_tile
    with pytest.raises(ValueError, match=r"num_warps must be 4 \(the MMA warpgroup\); got 8"):
        check(16, 128, 128, 8, 2, 8, 128, 256)
    with pytest.raises(ValueError, match="decoders must be 4 or 8, .*block_n=64.*; got 8"):
        check(16, 64, 128, 4, 2, 8, 64, 256)
    with pytest.raises(ValueError, match="decoders must be 4 or 8.*; got 2"):
        check(16, 128, 128, 4, 2, 2, 128, 256)
    with pytest.raises(ValueError, match="block_n x block_m must be at most 4096 .*; got 128x64"):
        check(64, 128, 64, 4, 2, 8, 128, 64)
    for block_k in (32, 256):
        with pytest.raises(ValueError, match=f"block_k must be 64 or 128; got {block_k}"):
            check(16, 128, block_k, 4, 2, 8, 128, 256)
    with pytest.raises(ValueError, match=r"num_stages=1 must be 2 or more"):
        check(16, 128, 128, 4, 1, 8, 128, 256)
    with pytest.raises(ValueError, match=r"num_stages=7 .*ring \(\d+ bytes\) fit"):
        check(16, 128, 128, 4, 7, 8, 128, 1024)
    with pytest.raises(ValueError, match=r"must divide the weight's N=192 and K=256"):
        check(16, 128, 128, 4, 2, 8, 192, 256)
    with pytest.raises(ValueError, match=r"K=128 must hold num_stages=3 steps of block_k=64"):
        check(16, 128, 64, 4, 3, 8, 128, 128)
    check(16, 128, 128, 4, 2, 8, 128, 256)
