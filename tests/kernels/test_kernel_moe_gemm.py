"""The NVFP4-weight grouped GEMM against its twin and against float64.

What each output is held to:
- the weights entering the dot products: bitwise ``dequantize(w, bf16)``, read off the GEMM with
  one-hot rows of x (each output is then one weight times 1.0, exact in FP32 and in BF16);
- products of general rows: FP32 accumulation of exact BF16 products, then one rounding to BF16.
  Against the float64 product of the same BF16 values, each output is within
  ``2**-8 * |ref|`` (the BF16 rounding: half an ulp of an 8-bit significand) plus
  ``K * 2**-23 * (|x| @ |W|.T)`` (the FP32 sum: K additions of at most an ulp each, a bound
  that allows for the tensor cores' own rounding; typically ~1e-6 * sqrt(K) relative).
"""

import math

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import cpu  # noqa: E402

from fp4rl import kernels  # noqa: E402
from fp4rl.fp4 import reference as R  # noqa: E402
from fp4rl.fp4.tensor import NVFP4Tensor  # noqa: E402
from fp4rl.kernels import moe_gemm, moe_tiles  # noqa: E402
from fp4rl.kernels.moe_gemm import reference_gemm  # noqa: E402
from fp4rl.kernels.moe_tiles import GemmTile  # noqa: E402

# Tiles a CPU run can afford that still cover both block-scale load paths (bytes below
# BLOCK_K = 64, int32 words from 64 up), several row tiles per expert and partial ones.
TINY_TILES = [
    None,  # the launcher's own choice
    GemmTile(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2),
    GemmTile(block_m=32, block_n=32, block_k=64, num_warps=4, num_stages=3),
]


def random_weights(e: int, n: int, k: int, device: str, seed: int) -> NVFP4Tensor:
    """Weights drawn on ``device`` and quantized there, one global scale per expert."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(e, n, k, generator=g, device=device) * 0.05).to(torch.bfloat16)
    return kernels.quantize(w, scaling=2) if device == "cuda" else R.quantize(w, scaling=2)


def bf16_weights(e: int, n: int, k: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(e, n, k, generator=g, device=device) * 0.05).to(torch.bfloat16)


def float64_reference(x_AK, w_ENK, counts_E):
    """(x @ W_e.T, |x| @ |W_e|.T) per expert's rows, in float64."""
    x = x_AK.double()
    ref = torch.zeros(x.shape[0], w_ENK.shape[1], dtype=torch.float64, device=x.device)
    magnitude = torch.zeros_like(ref)
    start = 0
    for e, count in enumerate(counts_E.tolist()):
        rows = slice(start, start + count)
        w = w_ENK[e].double()
        ref[rows], magnitude[rows] = x[rows] @ w.T, x[rows].abs() @ w.abs().T
        start += count
    return ref, magnitude


def assert_fp32_accumulated(y, x_AK, w: NVFP4Tensor, counts_E, what: str, dtype=torch.bfloat16):
    """y (BF16) within the module docstring's bound of the float64 product with the weights
    ``dequantize(w, dtype)``."""
    # The GPU's dequantize equals the reference bit for bit (test_kernel_dequantize) and is
    # much faster at real shapes.
    w_ENK = kernels.dequantize(w, dtype) if w.codes.is_cuda else R.dequantize(w, dtype)
    assert_within_float64(y, x_AK, w_ENK, counts_E, what)


def assert_within_float64(y, x_AK, w_ENK, counts_E, what: str):
    """y (BF16) within the module docstring's bound of the float64 product with ``w_ENK``."""
    ref, magnitude = float64_reference(x_AK, w_ENK, counts_E)
    k = x_AK.shape[1]
    bound = 2.0**-8 * ref.abs() + k * 2.0**-23 * magnitude
    err = (y.double() - ref).abs()
    bad = ~(err <= bound)  # NaN fails
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} outputs outside the bound; worst excess "
        f"{float((err - bound).max()):.3g}"
    )
    # The BF16 rounding dominates: a relative Frobenius error near 2**-8 / sqrt(3) ~ 2e-3.
    rel = float((y.double() - ref).norm() / ref.norm().clamp_min(1e-300))
    assert rel < 2.0**-8, f"{what}: relative error {rel:.3g} vs float64"


def onehot_rows(k: int, experts: list[int], e: int, device: str):
    """K one-hot rows per listed expert (none for the others): row i of an expert's group picks
    weight column i, so the GEMM returns that expert's dequantized weight, transposed."""
    counts = torch.zeros(e, dtype=torch.int64)
    counts[experts] = k
    x = torch.eye(k, dtype=torch.bfloat16).repeat(len(experts), 1)
    return x.to(device), counts.to(device)


def assert_weights_bitwise(y, w: NVFP4Tensor, experts: list[int], what: str):
    """Each output equals the weight it picked: values bitwise (a -0 weight gives +0, the sum
    with the other products, which are +0), NaN where the weight is NaN."""
    w_ENK = R.dequantize(cpu(w.map(lambda t: t[experts])), torch.bfloat16)
    want = torch.cat(list(w_ENK.transpose(1, 2))).float()
    got = y.cpu().float()
    nan = want.isnan()
    bad = torch.where(nan, ~got.isnan(), got != want)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} weights differ"


def every_byte_weights(
    e: int, n: int, k: int, seed: int, global_scales=(2.0**-110, 0.0, 1.7e-3, 2.0**100)
) -> NVFP4Tensor:
    """Every code byte, every finite block-scale byte (0x7F and 0xFF are NaN, tested apart) and
    ``global_scales`` cycled over the experts: by default from 0 and 2**-110 (products down to
    2**-120) to 2**100."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    blocks = e * n * k // 16
    scale_bytes = finite[torch.arange(blocks) % len(finite)].view(e, n, k // 16)
    global_scale = torch.tensor(global_scales)[torch.arange(e) % len(global_scales)]
    return NVFP4Tensor(codes, scale_bytes.view(torch.float8_e4m3fn), global_scale.view(e, 1, 1))


def test_tiles_narrow_only_where_the_grid_leaves_sms_idle():
    """One token's w13 (24 column tiles x 8 experts = 192 programs) on 132 SMs gets 32-wide
    tiles; its w2 (256 programs), four tokens and an unknown SM count keep the bucket's."""
    bucket = moe_tiles.config_for(8, 128)
    assert bucket.block_n == 64
    assert moe_tiles.config_for(8, 128, n=1536, sms=132).block_n == 32
    assert moe_tiles.config_for(8, 128, n=2048, sms=132) == bucket
    assert moe_tiles.config_for(32, 128, n=1536, sms=132).block_n == 64
    assert moe_tiles.config_for(8, 128, n=1536) == bucket
    assert moe_tiles.config_for(1, 128, n=64, sms=132).block_n == 32  # never below 32
    bf16 = moe_tiles.BF16_CONFIGS[0][1]  # BF16 weights: the sweep's own tiles, never narrowed
    assert moe_tiles.config_for(8, 128, n=1536, sms=132, bf16=True) == bf16


# With the global scale on the accumulator, a one-hot row's sum is one exact product
# e2m1 * sf, and times the global scale it rounds as the contract's weight does: the same bits.
# (Compiled, that path decodes two codes per instruction: `packed_words.packed_pair`.)
SCALE_PLACES = pytest.mark.parametrize("acc", [False, True], ids=["contract", "on_accumulator"])


@SCALE_PLACES
@pytest.mark.parametrize("tile", TINY_TILES, ids=str)
def test_weights_enter_the_dot_bitwise(device, tile, acc):
    e, n, k = 4, 32, 64
    w = every_byte_weights(e, n, k, seed=0)
    experts = [0, 1, 3]  # expert 2 has no rows
    x, counts = onehot_rows(k, experts, e, device)
    y = moe_gemm.launch(
        x, w.map(lambda t: t.to(device)), counts, config=tile, global_scale_on_accumulator=acc
    )
    assert_weights_bitwise(y, w, experts, f"tile {tile}")


def test_poisoned_expert_gives_nan_rows_only(device):
    """A NaN global scale (a poisoned expert) or NaN block scale makes NaN outputs in the rows
    and columns it touches, never plausible numbers, and leaves the other experts alone."""
    e, n, k = 4, 32, 64
    w = random_weights(e, n, k, "cpu", seed=1)
    global_scale = w.global_scale.clone()
    global_scale[1] = math.nan
    block_scale = w.block_scale.clone()
    block_scale.view(torch.uint8)[2, 5, 3] = 0x7F  # expert 2, output column 5
    w = NVFP4Tensor(w.codes, block_scale, global_scale)
    counts = torch.tensor([3, 2, 4, 0])
    x = torch.randn(9, k).to(torch.bfloat16)
    y = moe_gemm.launch(x.to(device), w.map(lambda t: t.to(device)), counts.to(device)).cpu()
    nan = torch.zeros(9, n, dtype=torch.bool)
    nan[3:5] = True
    nan[5:9, 5] = True
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y.isnan(), reference_gemm(x, w, counts).isnan())


@pytest.mark.parametrize(
    "counts",
    [[5, 0, 17, 1], [0, 0, 0, 3], [33, 0, 0, 0], [1, 1, 1, 1], [16, 32, 0, 48]],
    ids=str,
)
def test_random_rows_against_twin_and_float64(device, counts):
    e, n, k = 4, 32, 64
    w = random_weights(e, n, k, "cpu", seed=2)
    w_bf16 = bf16_weights(e, n, k, "cpu", seed=12)  # the BF16 engine's experts: same program
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), k).to(torch.bfloat16)
    for tile in TINY_TILES:
        y = moe_gemm.launch(
            x.to(device), w.map(lambda t: t.to(device)), counts.to(device), config=tile
        )
        assert_fp32_accumulated(y.cpu(), x, w, counts, f"kernel, tile {tile}")
        y = moe_gemm.launch(x.to(device), w_bf16.to(device), counts.to(device), config=tile)
        assert_within_float64(y.cpu(), x, w_bf16, counts, f"BF16 weights, tile {tile}")
    assert_fp32_accumulated(reference_gemm(x, w, counts), x, w, counts, "twin")


@pytest.mark.parametrize("tile", TINY_TILES, ids=str)
def test_tokens_gathered_by_the_dispatch_order(device, tile):
    """With the dispatch's order the kernel reads token rows where they lie: bitwise the
    product of the gathered rows ``x[order // top_k]``."""
    e, k_top, tokens = 4, 2, 9
    w = random_weights(e, 32, 64, "cpu", seed=7).map(lambda t: t.to(device))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, e, (tokens, k_top), generator=g)
    order = torch.argsort(ids.flatten(), stable=True)
    counts = torch.bincount(ids.flatten(), minlength=e)
    x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16).to(device)
    order, counts = order.to(device), counts.to(device)
    got = moe_gemm.launch(x, w, counts, config=tile, order_A=order, top_k=k_top)
    want = moe_gemm.launch(x[order // k_top].contiguous(), w, counts, config=tile)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match=r"order_A must be a 1-D int64 tensor; got torch.int32"):
        moe_gemm.launch(x, w, counts, order_A=order.to(torch.int32), top_k=k_top)
    with pytest.raises(ValueError, match="top_k must be a positive int; got 0"):
        moe_gemm.launch(x, w, counts, order_A=order, top_k=0)


def test_global_scale_on_accumulator(device):
    """The measured alternative: BF16 ``e2m1 * block_scale`` into the dot, the global scale on
    the FP32 sum. Its weights are the exact products, so its float64 reference is taken with
    the FP32 dequantized weights (within 2**-24 of exact, inside the bound's slack)."""
    w = random_weights(4, 32, 64, "cpu", seed=6)
    counts = torch.tensor([5, 0, 17, 1])
    x = torch.randn(int(counts.sum()), 64).to(torch.bfloat16)
    y = moe_gemm.launch(
        x.to(device), w.map(lambda t: t.to(device)), counts.to(device),
        global_scale_on_accumulator=True,
    )  # fmt: skip
    assert_fp32_accumulated(y.cpu(), x, w, counts, "scale on accumulator", torch.float32)


def test_no_rows(device):
    w = random_weights(4, 32, 64, "cpu", seed=3).map(lambda t: t.to(device))
    for a, counts in ((0, [0, 0, 0, 0]), (2, [0, 0, 0, 0])):
        x = torch.randn(a, 64).to(torch.bfloat16).to(device)
        y = moe_gemm.launch(x, w, torch.tensor(counts).to(device))
        assert y.shape == (a, 32) and y.dtype == torch.bfloat16


def test_counts_past_the_rows_touch_nothing_beyond(device):
    """counts_E summing to more than A (a caller's bug the launcher cannot see without a sync)
    neither reads nor writes past row A: rows within A get their expert's product."""
    w = random_weights(4, 32, 64, "cpu", seed=4)
    x = torch.randn(6, 64).to(torch.bfloat16)
    y = moe_gemm.launch(
        x.to(device), w.map(lambda t: t.to(device)), torch.tensor([4, 0, 9, 0]).to(device)
    ).cpu()
    want = reference_gemm(x, w, torch.tensor([4, 0, 2, 0]))
    assert torch.allclose(y.float(), want.float(), rtol=2**-7, atol=1e-6)


def test_checks_name_the_values(device):
    w = random_weights(4, 32, 64, "cpu", seed=5).map(lambda t: t.to(device))
    x = torch.randn(3, 64).to(torch.bfloat16).to(device)
    counts = torch.tensor([1, 2, 0, 0]).to(device)
    with pytest.raises(ValueError, match=r"bfloat16 tensor; got torch.float32 of shape \(3, 64\)"):
        moe_gemm.launch(x.float(), w, counts)
    with pytest.raises(ValueError, match=r"K=48 columns but w is \[E, N, K\]=\(4, 32, 64\)"):
        moe_gemm.launch(x[:, :48].contiguous(), w, counts)
    with pytest.raises(ValueError, match=r"x_AK must be contiguous; got shape \(3, 32\)"):
        moe_gemm.launch(x[:, ::2], w, counts)
    with pytest.raises(ValueError, match=r"counts_E must be int32 or int64 of shape \(4,\); got "):
        moe_gemm.launch(x, w, counts[:3])
    with pytest.raises(ValueError, match=r"got torch.float32 of shape \(4,\)"):
        moe_gemm.launch(x, w, counts.float())
    narrow = w.map(lambda t: t[:, :24].contiguous())
    with pytest.raises(ValueError, match=r"N=24 must be a multiple of 16"):
        moe_gemm.launch(x, narrow, counts)
    strided = NVFP4Tensor(w.codes.transpose(0, 1).contiguous().transpose(0, 1), *w.tensors()[1:])
    with pytest.raises(ValueError, match=r"codes must be contiguous; got shape \(4, 32, 32\)"):
        moe_gemm.launch(x, strided, counts)
    with pytest.raises(ValueError, match=r"w must be \[E, N, K\]; got shape \(128, 64\)"):
        flat = NVFP4Tensor(
            w.codes.flatten(0, 1), w.block_scale.flatten(0, 1), torch.ones(128, 1, device=device)
        )
        moe_gemm.launch(x, flat, counts)
    with pytest.raises(ValueError, match=r"block_k must be a power of two >= 16; got 48"):
        GemmTile(block_m=16, block_n=16, block_k=48, num_warps=4, num_stages=1)


# ---- BF16 weights (the BF16 engine's experts): the same program, weight tiles as loaded ------


@pytest.mark.parametrize("tile", TINY_TILES, ids=str)
def test_bf16_weights_enter_the_dot_bitwise_and_rows_gather(device, tile):
    """One-hot rows give back every BF16 weight of the listed experts; token rows read through
    the dispatch order give the gathered rows' product bitwise."""
    e, n, k = 4, 32, 64
    w = bf16_weights(e, n, k, "cpu", seed=13)
    w[1, 3, ::5] = -0.0
    experts = [1, 3]
    x, counts = onehot_rows(k, experts, e, device)
    y = moe_gemm.launch(x, w.to(device), counts, config=tile).cpu()
    want = torch.cat(list(w[experts].transpose(1, 2)))
    assert torch.equal(y.float(), want.float()), "BF16 weights through one-hot rows"
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, e, (9, 2), generator=g)
    order = torch.argsort(ids.flatten(), stable=True).to(device)
    counts = torch.bincount(ids.flatten(), minlength=e).to(device)
    x = torch.randn(9, k, generator=g).to(torch.bfloat16).to(device)
    got = moe_gemm.launch(x, w.to(device), counts, config=tile, order_A=order, top_k=2)
    gathered = moe_gemm.launch(x[order // 2].contiguous(), w.to(device), counts, config=tile)
    assert torch.equal(got.view(torch.int16), gathered.view(torch.int16))


def test_bf16_weight_checks_name_the_values(device):
    w = bf16_weights(4, 32, 64, "cpu", seed=14).to(device)
    x = torch.randn(3, 64).to(torch.bfloat16).to(device)
    counts = torch.tensor([1, 2, 0, 0]).to(device)
    with pytest.raises(ValueError, match=r"NVFP4Tensor or a bfloat16 tensor; got torch.float32"):
        moe_gemm.launch(x, w.float(), counts)
    with pytest.raises(ValueError, match=r"w must be contiguous"):
        moe_gemm.launch(x, w.transpose(1, 2).contiguous().transpose(1, 2), counts)
    with pytest.raises(ValueError, match=r"global_scale_on_accumulator is for NVFP4 weights"):
        moe_gemm.launch(x, w, counts, global_scale_on_accumulator=True)


# ---- real shapes, compiled (Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, intermediate 768)

QWEN3_SHAPES = {"w13": (1536, 2048), "w2": (2048, 768)}  # (N, K)


def routed(tokens: int, e: int, top_k: int, generator: torch.Generator):
    """Expert counts of ``tokens`` tokens routed to their top-k of random router logits."""
    logits = torch.randn(tokens, e, generator=generator)
    ids = logits.topk(top_k, dim=-1).indices
    return torch.bincount(ids.flatten(), minlength=e)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(QWEN3_SHAPES), ids=str)
@pytest.mark.parametrize("tokens", [1, 8, 64, 256, 4096])
def test_qwen3_shapes_on_gpu(shape, tokens):
    n, k = QWEN3_SHAPES[shape]
    g = torch.Generator().manual_seed(tokens)
    w = random_weights(128, n, k, "cuda", seed=tokens)
    counts = routed(tokens, 128, 8, g)
    x = torch.randn(int(counts.sum()), k, generator=g).to(torch.bfloat16).cuda()
    counts = counts.cuda()
    y = moe_gemm.launch(x, w, counts)
    assert_fp32_accumulated(y, x, w, counts.cpu(), f"{shape} {tokens} tokens")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(QWEN3_SHAPES), ids=str)
@pytest.mark.parametrize("tokens", [1, 8, 64, 256])
def test_qwen3_shapes_bf16_weights_on_gpu(shape, tokens):
    n, k = QWEN3_SHAPES[shape]
    g = torch.Generator().manual_seed(tokens)
    w = bf16_weights(128, n, k, "cuda", seed=tokens)
    counts = routed(tokens, 128, 8, g)
    x = torch.randn(int(counts.sum()), k, generator=g).to(torch.bfloat16).cuda()
    for tile in (None, *(tile for _, tile in moe_tiles.CONFIGS[:3])):
        y = moe_gemm.launch(x, w, counts.cuda(), config=tile)
        assert_within_float64(y, x, w, counts, f"BF16 {shape} {tokens} tokens, tile {tile}")


@pytest.mark.gpu
def test_bf16_experts_take_the_kernel_in_inference_mode_only_on_gpu():
    """`ops.grouped_mm` on BF16 weights: the kernel's bits in inference mode (the engine's
    steps) up to BF16_KERNEL_MAX_ROWS rows, `torch._grouped_mm`'s elsewhere (training, with or
    without gradients, and longer chunks)."""
    from fp4rl import ops

    n, k = QWEN3_SHAPES["w2"]
    g = torch.Generator().manual_seed(21)
    w = bf16_weights(128, n, k, "cuda", seed=21)
    for tokens in (8, ops.BF16_KERNEL_MAX_ROWS // 8 + 1):
        counts = routed(tokens, 128, 8, g).cuda()
        x = torch.randn(tokens * 8, k, generator=g).to(torch.bfloat16).cuda()
        offsets = counts.cumsum(0).to(torch.int32)
        cublas = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        kernel = moe_gemm.launch(x, w, counts)
        with torch.inference_mode():
            got = ops.grouped_mm(x, w, counts)
        want = kernel if tokens * 8 <= ops.BF16_KERNEL_MAX_ROWS else cublas
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), tokens
        with torch.no_grad():
            got = ops.grouped_mm(x, w, counts)
        assert torch.equal(got.view(torch.int16), cublas.view(torch.int16)), tokens


@pytest.mark.gpu
def test_packed_experts_take_the_fused_kernel_up_to_the_devices_bound_on_gpu():
    """`ops.grouped_mm` on packed weights: the fused kernel's bits up to FUSED_GEMM_MAX_ROWS rows
    (FUSED_GEMM_MAX_ROWS_WGMMA where it runs on Hopper's warpgroup MMA), past it every expert
    dequantized and `torch._grouped_mm`'s bits."""
    from fp4rl import ops

    n, k = QWEN3_SHAPES["w2"]
    g = torch.Generator().manual_seed(22)
    w = random_weights(128, n, k, "cuda", seed=22)
    probe = torch.empty(0, k, dtype=torch.bfloat16, device="cuda")
    wgmma = kernels.grouped_mm_on_warpgroup_mma(probe, w)
    bound = ops.FUSED_GEMM_MAX_ROWS_WGMMA if wgmma else ops.FUSED_GEMM_MAX_ROWS
    dequantized = kernels.dequantize(w, torch.bfloat16).transpose(-2, -1)
    for tokens in sorted({ops.FUSED_GEMM_MAX_ROWS // 8 + 1, bound // 8, bound // 8 + 1}):
        counts = routed(tokens, 128, 8, g).cuda()
        x = torch.randn(tokens * 8, k, generator=g).to(torch.bfloat16).cuda()
        offsets = counts.cumsum(0).to(torch.int32)
        fused = tokens * 8 <= bound
        if fused:
            want = moe_gemm.launch(x, w, counts)
        else:
            want = torch._grouped_mm(x, dequantized, offs=offsets)
        with torch.inference_mode():
            got = ops.grouped_mm(x, w, counts)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (tokens, fused)


@pytest.mark.gpu
@SCALE_PLACES
@pytest.mark.parametrize("shape", list(QWEN3_SHAPES), ids=str)
def test_qwen3_weights_bitwise_on_gpu(shape, acc):
    """One-hot rows read every weight of four experts through the compiled kernel; the others
    (zero rows) are not read at all."""
    n, k = QWEN3_SHAPES[shape]
    w = random_weights(128, n, k, "cuda", seed=7)
    experts = [0, 5, 77, 127]
    x, counts = onehot_rows(k, experts, 128, "cuda")
    for tile in (None, *(tile for _, tile in moe_tiles.CONFIGS)):
        y = moe_gemm.launch(x, w, counts, config=tile, global_scale_on_accumulator=acc)
        assert_weights_bitwise(y, w, experts, f"{shape}, tile {tile}")


@pytest.mark.gpu
def test_graph_replay_follows_the_counts_on_gpu():
    """The launch holds no host copy of the routing: captured once in a CUDA graph, it follows
    new counts and rows copied into the captured buffers."""
    n, k = QWEN3_SHAPES["w2"]
    g = torch.Generator().manual_seed(11)
    w = random_weights(128, n, k, "cuda", seed=11)
    tokens = 64
    x = torch.empty(tokens * 8, k, dtype=torch.bfloat16, device="cuda")
    counts = torch.empty(128, dtype=torch.int64, device="cuda")
    x.copy_(torch.randn(x.shape, generator=g).to(torch.bfloat16))
    counts.copy_(routed(tokens, 128, 8, g))
    moe_gemm.launch(x, w, counts)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe_gemm.launch(x, w, counts)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=g).to(torch.bfloat16))
        counts.copy_(routed(tokens, 128, 8, g))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, moe_gemm.launch(x, w, counts))
