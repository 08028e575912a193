"""Paged decode attention (BF16 and NVFP4 pages) against its spec, ``attend_fp32`` over
``KVCache.read``, and against float64.

What each output is held to:
- the V values entering the kernel: bitwise those ``KVCache.read`` returns, read off contexts of
  one token (the softmax weight is then exactly 1, so the output is the V row; -0 and +0 are
  not told apart, NaN positions must match);
- outputs: float64 attention over the same K/V values (as ``KVCache.read`` returns them) is
  ``o64``, with ``mag = sum_c p_c |v_c|`` the scale of each output. FP32 sums in another order
  and the GPU's exp approximation move an output by ~1e-7 to 1e-6 of ``mag``; the bound is
  ``|o - o64| <= 2**-16 * mag``, plus ``2**-8 * |o64|`` for BF16 queries (one rounding of the
  output to BF16: half an ulp of an 8-bit significand). The spec itself is held to the same
  bound, so the bound is honest;
- ``reference_decode`` equals ``attend_fp32`` over ``KVCache.read`` bitwise (the same ops);
- NaN: a poisoned row inside a context makes its sequence's KV-head group NaN and nothing
  else; pages outside the contexts are never read (NaN there changes no bit of the output).
"""

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import (  # noqa: E402
    assert_attention_within,
    assert_bitwise,
    dealt_tables,
    random_paged_cache,
)

from fp4rl import kernels, ops  # noqa: E402
from fp4rl.fp4.tensor import NVFP4Rows  # noqa: E402
from fp4rl.kernels import attention_tiles, paged_attention  # noqa: E402
from fp4rl.kernels.attention_tiles import DecodeTile  # noqa: E402
from fp4rl.kernels.paged_attention import reference_decode  # noqa: E402
from fp4rl.rollout.attention import AttentionMetadata, Segment, attend_fp32  # noqa: E402

# Steps of 16 tokens (several per context at these sizes) and stretches of 16 when split.
TINY = DecodeTile(block_n=16, num_warps=4, num_stages=2, min_split_tokens=16)
PAGE_FORMATS = {  # name -> (cache format, page dtype)
    "bf16 pages": ("bf16", torch.bfloat16),
    "fp32 pages": ("bf16", torch.float32),  # a float32 model's "bf16" layer: cast on read
    "nvfp4": ("nvfp4", torch.bfloat16),
}


class Scene:
    """One layer's cache holding ragged contexts in interleaved, out-of-order blocks, plus the
    engine's view of the same step (`AttentionMetadata`) for the spec."""

    def __init__(self, fmt, contexts, *, heads, dim, page, seed, device, q_dtype, scale=1.0):
        self.fmt, page_dtype = PAGE_FORMATS[fmt]
        Hq, K = heads
        g = torch.Generator().manual_seed(seed)
        per_seq = [-(-c // page) for c in contexts]
        num_blocks = sum(per_seq) + 2  # two blocks no sequence owns (padding targets)
        self.cache = random_paged_cache(self.fmt, page_dtype, num_blocks, page, K, dim,
                                        seed=seed, device=device, scale=scale)  # fmt: skip
        order = torch.randperm(num_blocks, generator=g).tolist()
        tables = dealt_tables(per_seq, order)
        # One column more than the longest table, padded with a block no sequence owns.
        width = max(per_seq) + 1
        self.tables = tables
        self.block_table_BN = torch.tensor(
            [t + [order[-1]] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        )
        self.context_B = torch.tensor(contexts, dtype=torch.int32, device=device)
        self.q_BHD = torch.randn(len(contexts), Hq, dim, generator=g).to(q_dtype).to(device)
        self.page, self.device = page, device

    def pages(self):
        layer = self.cache.layers[0]
        return (layer.k, layer.v) if self.fmt == "nvfp4" else (layer.k_NBKD, layer.v_NBKD)

    def launch(self, **kw):
        return paged_attention.launch(
            self.q_BHD, *self.pages(), self.block_table_BN, self.context_B, **kw
        )

    def read(self):
        """K/V ``[B, C, K, D]`` as the engine gathers them for this step's decode segments."""
        contexts = self.context_B.tolist()
        segments = [Segment(t, c - 1, 1) for t, c in zip(self.tables, contexts, strict=True)]
        meta = AttentionMetadata.build(segments, self.page, self.device)
        k, v = self.cache.read(0, meta.decode_slots_BC, self.q_BHD.dtype)
        return k, v, meta

    def spec(self):
        """``PagedAttention.attend``'s decode path today: attend_fp32 over KVCache.read."""
        k, v, meta = self.read()
        positions = meta.decode_context_B - 1
        o = attend_fp32(self.q_BHD[:, None], k, v, positions[:, None], meta.decode_context_B)
        return o[:, 0].to(self.q_BHD.dtype)

    def float64(self):
        """(o64, mag) over the values ``KVCache.read`` returns."""
        k, v, meta = self.read()
        B, Hq, D = self.q_BHD.shape
        K = k.shape[2]
        q = self.q_BHD.double().view(B, K, Hq // K, D)
        scores = torch.einsum("bkgd,bckd->bkgc", q, k.double()) / math.sqrt(D)
        visible_BC = torch.arange(k.shape[1], device=k.device) < meta.decode_context_B[:, None]
        p = torch.softmax(scores.masked_fill(~visible_BC[:, None, None], -math.inf), dim=-1)
        v = v.double().masked_fill(~visible_BC[:, :, None, None], 0)
        o = torch.einsum("bkgc,bckd->bkgd", p, v).reshape(B, Hq, D)
        mag = torch.einsum("bkgc,bckd->bkgd", p, v.abs()).reshape(B, Hq, D)
        return o, mag


def assert_within(got, scene: Scene, what: str):
    """``got`` within the module docstring's bound of float64 attention."""
    assert_attention_within(got, *scene.float64(), what)


SHAPES = {  # name -> (Hq, K), D, page, contexts
    "G=3 D=16 P=4": ((6, 2), 16, 4, [1, 5, 12, 17, 3, 4]),
    "G=4 D=32 P=16": ((4, 1), 32, 16, [1, 16, 17, 40, 33]),
    # From D = 64 NVFP4 block scales are read as int32 words of 4 (`_block_scales`).
    "G=2 D=64 P=8": ((4, 2), 64, 8, [1, 9, 30, 8]),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", list(PAGE_FORMATS))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("keys_first", [False, True], ids=["rows first", "keys first"])
def test_matches_spec_and_float64(device, shape, fmt, q_dtype, keys_first):
    heads, dim, page, contexts = SHAPES[shape]
    scene = Scene(fmt, contexts, heads=heads, dim=dim, page=page, seed=len(fmt) + dim,
                  device=device, q_dtype=q_dtype)  # fmt: skip
    assert_within(scene.spec(), scene, "attend_fp32 over KVCache.read (the spec)")
    tile = dataclasses.replace(TINY, keys_first=keys_first)
    if fmt == "nvfp4" and q_dtype == torch.bfloat16:
        # Reductions of 16 over decoded values miscompile on sm_90: refused everywhere.
        with pytest.raises(ValueError, match="need head dim and block_n >= 32"):
            scene.launch(config=tile, num_splits=1)
        if dim < 32:
            return
        tile = DecodeTile(block_n=32, num_warps=4, num_stages=2, min_split_tokens=16,
                          keys_first=keys_first)  # fmt: skip
    runs = [("one stretch", dict(config=tile, num_splits=1)),
            ("three stretches", dict(config=tile, num_splits=3))]  # fmt: skip
    if dim == 32 and not keys_first:  # the default tile: one step covers every context here
        runs.append(("launcher's choice", {}))
    for label, kw in runs:
        out = scene.launch(**kw)
        assert out.dtype == q_dtype and out.shape == scene.q_BHD.shape
        assert_within(out, scene, f"kernel, {label}")


@pytest.mark.parametrize("fmt", list(PAGE_FORMATS))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_decode_is_attend_fp32_over_cache_read(fmt, q_dtype):
    heads, dim, page, contexts = SHAPES["G=3 D=16 P=4"]
    scene = Scene(fmt, contexts, heads=heads, dim=dim, page=page, seed=3, device="cpu",
                  q_dtype=q_dtype)  # fmt: skip
    got = reference_decode(scene.q_BHD, *scene.pages(), scene.block_table_BN, scene.context_B)
    assert_bitwise(got, scene.spec(), f"reference_decode, {fmt}")


def every_byte_pages(rows: int, dim: int, seed: int) -> NVFP4Rows:
    """``rows`` token-heads of random code bytes, block-scale bytes cycling through all 256
    patterns (NaN ones included) and BF16 amaxes whose global scales run from 0 (a zero amax,
    and one just below the recipe's smallest scale, 2**-117) through that smallest scale and
    one just above it to 2**100, with an inf and a NaN amax among them."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, dim // 2), generator=g, dtype=torch.uint8)
    block_bytes = (torch.arange(rows * dim // 16) % 256).to(torch.uint8).view(rows, dim // 16)
    amax = torch.rand(rows, 1, generator=g) * 3 * 2688
    amax[:9, 0] = torch.tensor([0.0, 2.0**-110, 2.0**100, 1.7e-3, 2.0**-117, 1.5 * 2.0**-117,
                                2.0**-117.5, math.inf, math.nan]) * 2688  # fmt: skip
    return NVFP4Rows(codes, block_bytes.view(torch.float8_e4m3fn), amax.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["bf16 pages", "nvfp4"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_context_of_one_returns_the_v_rows_bitwise(device, fmt, q_dtype):
    """Pages of one token, 16 sequences of context 1: every row of V, as KVCache.read gives it,
    comes back through the kernel's decode (for NVFP4: every block-scale byte, every code)."""
    B, Hq, K, D = 16, 4, 2, 128
    scene = Scene(fmt, [1] * B, heads=(Hq, K), dim=D, page=1, seed=7, device=device,
                  q_dtype=q_dtype)  # fmt: skip
    if fmt == "nvfp4":
        pages = scene.cache.layers[0].v
        rows = every_byte_pages(pages.codes.numel() * 2 // D, D, seed=8)
        for page, value in zip(pages.tensors(), rows.tensors(), strict=True):
            page.copy_(value.view(page.shape))
    else:
        v = scene.cache.layers[0].v_NBKD
        v.view(-1)[::7] = -0.0
    _, v_BCKD, _ = scene.read()
    want = v_BCKD[:, 0].repeat_interleave(Hq // K, dim=1)  # [B, Hq, D]: head h reads h // G
    got = scene.launch()
    assert torch.equal(got.isnan(), want.isnan()), "NaN positions"
    same = (got == want) | want.isnan()
    assert same.all(), f"{int((~same).sum())} of {same.numel()} V values differ"


def assert_nan_confined(scene: Scene, config: DecodeTile, sequence: int, block: int) -> None:
    """NaN in every slot no context covers changes no bit of the output (split or not); NaN in
    one row inside ``sequence``'s context (its table's ``block``-th page, KV head 1) turns that
    sequence's KV-head-1 group NaN and nothing else."""
    page, device, K = scene.page, scene.device, scene.pages()[0].shape[2]
    contexts = scene.context_B.tolist()
    clean = {n: scene.launch(config=config, num_splits=n).cpu() for n in (1, 3)}
    covered = torch.zeros(scene.cache.num_blocks * page, dtype=torch.bool)
    for table, c in zip(scene.tables, contexts, strict=True):
        covered[[table[t // page] * page + t % page for t in range(c)]] = True

    def poison(where_T, head):
        for t in scene.pages():
            if isinstance(t, NVFP4Rows):
                t.amax.flatten(0, 1)[where_T.to(device), head] = math.nan
            else:
                t.flatten(0, 1)[where_T.to(device), head] = math.nan

    for head in range(K):
        poison(~covered, head)
    assert_bitwise(scene.launch(config=config, num_splits=3), clean[3], "NaN padding")
    row = torch.zeros_like(covered)
    row[scene.tables[sequence][block] * page + 2] = True
    poison(row, 1)
    G = scene.q_BHD.shape[1] // K
    nan = torch.zeros(scene.q_BHD.shape, dtype=torch.bool)
    nan[sequence, G : 2 * G] = True
    for n in (1, 3):
        got = scene.launch(config=config, num_splits=n).cpu()
        assert torch.equal(got.isnan(), nan), f"NaN positions, {n} stretches"
        assert_bitwise(got[~nan], clean[n][~nan], "outside the poisoned group")


@pytest.mark.parametrize("fmt", list(PAGE_FORMATS))
def test_nan_stays_in_its_sequence_and_padding_is_never_read(device, fmt):
    heads, dim, page, contexts = SHAPES["G=3 D=16 P=4"]
    scene = Scene(fmt, contexts, heads=heads, dim=dim, page=page, seed=11, device=device,
                  q_dtype=torch.float32)  # fmt: skip
    # Sequence 3's row at offset 2 of its second page: query heads 3-5 turn NaN.
    assert_nan_confined(scene, TINY, sequence=3, block=1)


def test_checks_name_the_values(device):
    heads, dim, page, contexts = SHAPES["G=3 D=16 P=4"]
    scene = Scene("nvfp4", contexts, heads=heads, dim=dim, page=page, seed=5, device=device,
                  q_dtype=torch.bfloat16)  # fmt: skip
    q, (k, v), table, ctx = scene.q_BHD, scene.pages(), scene.block_table_BN, scene.context_B
    launch = paged_attention.launch
    with pytest.raises(ValueError, match=r"bfloat16 or float32 tensor \[B, Hq, D\]; got "
                       r"torch.float16 of shape \(6, 6, 16\)"):  # fmt: skip
        launch(q.half(), k, v, table, ctx)
    with pytest.raises(ValueError, match=r"q_BHD must be contiguous; got shape \(6, 6, 8\)"):
        launch(q[..., ::2], k, v, table, ctx)
    with pytest.raises(ValueError, match=r"head dim D=16 but q_BHD is \[B, Hq, D\]=\(6, 6, 32\)"):
        launch(torch.cat([q, q], -1), k, v, table, ctx)
    with pytest.raises(ValueError, match=r"Hq=3 must be a multiple of the pages' KV heads K=2"):
        launch(q[:, :3].contiguous(), k, v, table, ctx)
    with pytest.raises(ValueError, match=r"block_table_BN must be int32 of shape \(6, N\); got "
                       r"torch.int64 of shape \(6, 6\)"):  # fmt: skip
        launch(q, k, v, table.long(), ctx)
    with pytest.raises(ValueError, match=r"of shape \(6, N\); got torch.int32 of shape \(5, 6\)"):
        launch(q, k, v, table[:5], ctx)
    with pytest.raises(ValueError, match=r"context_B must be int32 of shape \(6,\); got "
                       r"torch.int64 of shape \(6,\)"):  # fmt: skip
        launch(q, k, v, table, ctx.long())
    with pytest.raises(ValueError, match=r"k.codes must be contiguous"):
        strided = k.codes.transpose(0, 1).contiguous().transpose(0, 1)
        launch(q, NVFP4Rows(strided, k.block_scale, k.amax), v, table, ctx)
    with pytest.raises(ValueError, match=r"k.amax must be contiguous"):
        strided = k.amax.transpose(0, 1).contiguous().transpose(0, 1)
        launch(q, NVFP4Rows(k.codes, k.block_scale, strided), v, table, ctx)
    shifted = torch.zeros(k.amax.numel() + 1, dtype=k.amax.dtype, device=device)[1:]
    with pytest.raises(ValueError, match=r"k.amax must lie in whole 4-byte words"):
        launch(q, NVFP4Rows(k.codes, k.block_scale, shifted.view(k.amax.shape)), v, table, ctx)
    with pytest.raises(TypeError, match=r"one format; got NVFP4Rows/Tensor"):
        launch(q, k, torch.zeros(k.shape, device=device), table, ctx)
    with pytest.raises(ValueError, match=r"both be \[num_blocks, P, K, D\]; got \(.*, 4, 2, 16\) "
                       r"and \(.*, 2, 2, 16\)"):  # fmt: skip
        launch(q, k, v.map(lambda t: t[:, :2].contiguous()), table, ctx)
    with pytest.raises(ValueError, match=r"head dim D=48 must be a power of two >= 16"):
        wide = torch.zeros(3, 4, 2, 48, device=device)
        launch(torch.zeros(6, 6, 48, dtype=torch.bfloat16, device=device), wide, wide, table, ctx)
    with pytest.raises(ValueError, match=r"block_n must be a power of two >= 16; got 24"):
        DecodeTile(block_n=24, num_warps=4, num_stages=1)


# ---- real shapes, compiled (Qwen3-30B-A3B attention: 32 query / 4 KV heads of 128) ----------

QWEN3_HEADS, QWEN3_D, QWEN3_PAGE = (32, 4), 128, 16


def ragged(batch: int, seed: int) -> list[int]:
    """Contexts 1..4096: one of each end, the rest uniform."""
    if batch == 1:
        return [4096]
    g = torch.Generator().manual_seed(seed)
    return [1, 4096, *torch.randint(1, 4097, (batch - 2,), generator=g).tolist()]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16 pages", "nvfp4"])
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_qwen3_shapes_on_gpu(fmt, batch):
    scene = Scene(fmt, ragged(batch, batch), heads=QWEN3_HEADS, dim=QWEN3_D, page=QWEN3_PAGE,
                  seed=batch, device="cuda", q_dtype=torch.bfloat16, scale=2.0)  # fmt: skip
    assert_within(scene.launch(), scene, f"{fmt}, batch {batch}")
    if batch == 7:
        assert_within(scene.launch(num_splits=1), scene, f"{fmt}, batch 7, one stretch")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16 pages", "nvfp4"])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("tile", ["64:4:3", "128:8:3", "64:8:3"])
def test_keys_first_at_qwen3_shapes_on_gpu(fmt, batch, tile):
    block_n, warps, stages = (int(v) for v in tile.split(":"))
    config = DecodeTile(block_n, warps, stages, keys_first=True)
    scene = Scene(fmt, ragged(batch, batch), heads=QWEN3_HEADS, dim=QWEN3_D, page=QWEN3_PAGE,
                  seed=batch, device="cuda", q_dtype=torch.bfloat16, scale=2.0)  # fmt: skip
    assert_within(scene.launch(config=config), scene, f"{fmt}, batch {batch}, {tile} keys first")
    assert_within(scene.launch(config=config, num_splits=1), scene, f"{fmt}, one stretch")
    fp32 = Scene(fmt, ragged(batch, batch), heads=QWEN3_HEADS, dim=QWEN3_D, page=QWEN3_PAGE,
                 seed=batch, device="cuda", q_dtype=torch.float32)  # fmt: skip
    assert_within(fp32.launch(config=config), fp32, f"{fmt}, FP32 queries, {tile} keys first")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16 pages", "nvfp4"])
def test_fp32_queries_on_gpu(fmt):
    scene = Scene(fmt, ragged(7, 1), heads=QWEN3_HEADS, dim=QWEN3_D, page=QWEN3_PAGE, seed=1,
                  device="cuda", q_dtype=torch.float32)  # fmt: skip
    assert_within(scene.launch(), scene, f"{fmt}, FP32 queries")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16 pages", "nvfp4"])
def test_graph_replay_follows_tables_and_contexts_on_gpu(fmt):
    """Captured once, the launch follows new queries, block tables and contexts copied into
    the captured buffers (no host copy of either is taken)."""
    scene = Scene(fmt, ragged(64, 2), heads=QWEN3_HEADS, dim=QWEN3_D, page=QWEN3_PAGE, seed=2,
                  device="cuda", q_dtype=torch.bfloat16)  # fmt: skip
    assert_graph_replay_follows(scene, f"{fmt}, replayed")


def assert_graph_replay_follows(scene: Scene, what: str, **launch_kw) -> None:
    """Capture ``scene.launch(**launch_kw)`` once, then twice permute the sequences' tables and
    contexts and draw new queries in place: each replay equals a fresh launch, within the
    bound."""
    scene.launch(**launch_kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = scene.launch(**launch_kw)
    g = torch.Generator().manual_seed(3)
    batch = scene.q_BHD.shape[0]
    for _ in range(2):
        perm = torch.randperm(batch, generator=g).cuda()
        scene.block_table_BN.copy_(scene.block_table_BN[perm])
        scene.context_B.copy_(scene.context_B[perm])
        scene.tables = [scene.tables[i] for i in perm.tolist()]
        scene.q_BHD.copy_(torch.randn(scene.q_BHD.shape, generator=g).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, scene.launch(**launch_kw))
        assert_within(out, scene, what)


def test_small_launches_cover_the_gpu_once_with_one_step_each(monkeypatch):
    """At most SMALL_LAUNCH sequence-heads: about one stretch per multiprocessor (a power of
    two), each one step of a tile as long as the stretch (32 to 128 tokens); more: `CONFIGS`'
    tile and `stretches_for`'s choice."""
    monkeypatch.setattr(attention_tiles, "multiprocessors", lambda device: 132)
    plan = attention_tiles.plan_for
    small = attention_tiles.SMALL_TILES["nvfp4"]
    cuda = torch.device("cuda")
    for table, block in ((1024, 32), (2048, 64), (4096, 128), (40960, 128), (64, 32)):
        assert plan("nvfp4", 4, table, cuda) == (small[block], 32), table
    assert plan("bf16", 8, 1024, cuda) == (attention_tiles.SMALL_TILES["bf16"][64], 16)
    assert plan("nvfp4", 16, 4096, cuda) == (small[128], 8)
    assert plan("nvfp4", 17, 4096, cuda) == (attention_tiles.config_for("nvfp4", 17), None)
    tile, stretches = plan("nvfp4", 4, 1024, cuda)
    assert attention_tiles.stretches_for(4, 1024, tile, cuda, stretches) == 32


def test_each_tile_splits_contexts_to_its_own_programs_per_multiprocessor(monkeypatch):
    """Batch 64 of 4 KV heads at 4k (256 programs): the BF16 pages' tile aims at 4 programs a
    multiprocessor, 2 stretches (its measured best), the NVFP4 tiles at 8, 4 stretches; batch
    256 runs unsplit either way."""
    monkeypatch.setattr(attention_tiles, "multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    for fmt, stretches in (("bf16", 2), ("nvfp4", 4), ("registers", 4)):
        tile, planned = attention_tiles.plan_for(fmt, 256, 4096, cuda)
        assert planned is None and tile == attention_tiles.config_for(fmt, 256)
        assert attention_tiles.stretches_for(256, 4096, tile, cuda) == stretches, fmt
        assert attention_tiles.stretches_for(1024, 2048, tile, cuda) == 1, fmt


def test_the_engine_asks_the_kernels_whether_they_take_its_pages(monkeypatch):
    """`ops.paged_decode_kernel_runs`, which the engine asks on the GPU only (whether its graphs
    may capture the kernel), walked on the CPU with the kernels made available: BF16 queries
    over NVFP4 pages are taken from head dim 32 (the shortest tile's reduction) and refused
    below; other pages and FP32 queries are taken."""
    monkeypatch.setattr(ops, "_kernels", lambda q: kernels)
    for dim, want in ((16, False), (32, True), (128, True)):
        q = torch.zeros(2, 8, dim, dtype=torch.bfloat16)
        assert ops.paged_decode_kernel_runs(q, True) is want, dim
        assert ops.paged_decode_kernel_runs(q, False) is True, dim
        assert ops.paged_decode_kernel_runs(q.float(), True) is True, dim


@pytest.mark.parametrize("kernel", ["program", "registers"])
@pytest.mark.parametrize("fmt", ["bf16 pages", "nvfp4"])
def test_each_context_is_cut_into_the_stretches_not_the_table(device, monkeypatch, fmt, kernel):
    """A block table four times wider than its longest context (the engine's graphs take the
    longest a sequence may grow to), cut into 4 stretches: each sequence's own context is
    shared out, a stretch of whole steps to each program until it runs out (with 16-token steps,
    context 64: all four stretches hold tokens, 48: three, 17: two, 1: one), where cutting the
    table would leave every token to the first. The outputs stay within the bound."""
    if kernel == "registers" and (device != "cuda" or fmt != "nvfp4"):
        pytest.skip("the register kernel: NVFP4 pages under BF16 queries, on the GPU")
    contexts = [64, 48, 17, 1]
    scene = Scene(fmt, contexts, heads=(8, 2), dim=128 if kernel == "registers" else 32, page=16,
                  seed=7, device=device, q_dtype=torch.bfloat16)  # fmt: skip
    spare = scene.block_table_BN[:, -1:]  # a block no sequence owns
    scene.block_table_BN = torch.cat([scene.block_table_BN, spare.expand(-1, 11)], 1).contiguous()
    assert scene.block_table_BN.shape[1] * 16 == 4 * 64
    real, seen = paged_attention._combine_splits_kernel, {}

    class Recorder:
        def __getitem__(self, grid):
            def launch(part_m, part_l, *args, **kwargs):
                seen["part_l"] = part_l.cpu()
                return real[grid](part_m, part_l, *args, **kwargs)

            return launch

    monkeypatch.setattr(paged_attention, "_combine_splits_kernel", Recorder())
    tile = TINY if kernel == "program" else attention_tiles.REGISTERS_TILE
    if fmt == "nvfp4" and kernel == "program":
        tile = DecodeTile(block_n=32, num_warps=4, num_stages=2, min_split_tokens=16)
    out = scene.launch(config=tile, num_splits=4)
    step = tile.block_n
    filled = seen["part_l"].view(len(contexts), 8, 4) > 0  # [sequence, query head, stretch]
    for b, c in enumerate(contexts):
        stretch = math.ceil(math.ceil(c / 4) / step) * step
        want = [s * stretch < c for s in range(4)]
        assert filled[b].eq(torch.tensor(want)).all(), (c, filled[b, 0].tolist(), want)
    assert_within(out, scene, f"{fmt}, a table wider than its contexts")
