"""Paged prefill attention (BF16 and NVFP4 pages) against its spec, ``attend_fp32`` over
``KVCache.read`` one segment at a time, and against float64.

The bound is the decode kernel's (test_kernel_paged_attention.py): float64 attention over the
same K/V values is ``o64``, ``mag = sum_c p_c |v_c|`` the scale of each output, and
``|o - o64| <= 2**-16 * mag`` (FP32 sums in another order, the GPU's exp), plus ``2**-8 *
|o64|`` for BF16 queries (the one rounding of the output). The spec is held to it too.
"""

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

from fp4rl.fp4.tensor import NVFP4Rows  # noqa: E402
from fp4rl.kernels import paged_prefill  # noqa: E402
from fp4rl.kernels.paged_prefill import PrefillTile, reference_prefill  # noqa: E402
from fp4rl.rollout.attention import attend_fp32  # noqa: E402

PAGE_FORMATS = {  # name -> (cache format, page dtype)
    "bf16 pages": ("bf16", torch.bfloat16),
    "fp32 pages": ("bf16", torch.float32),
    "nvfp4": ("nvfp4", torch.bfloat16),
}


class Scene:
    """One layer's cache holding the contexts of a step's prefill segments in interleaved,
    out-of-order blocks; the step's queries are the segments' rows, one after another, behind
    ``lead`` rows no segment owns (a decode, say)."""

    def __init__(self, fmt, chunks, *, heads, dim, page, seed, device, q_dtype, lead=1,
                 scale=1.0):  # fmt: skip
        """``chunks``: (start, num) per segment: ``num`` new tokens after ``start`` cached."""
        self.fmt, page_dtype = PAGE_FORMATS[fmt]
        Hq, K = heads
        g = torch.Generator().manual_seed(seed)
        per_seq = [-(-(s + n) // page) for s, n in chunks]
        num_blocks = sum(per_seq) + 1
        self.cache = random_paged_cache(self.fmt, page_dtype, num_blocks, page, K, dim,
                                        seed=seed, device=device, scale=scale)  # fmt: skip
        order = torch.randperm(num_blocks, generator=g).tolist()
        self.tables = dealt_tables(per_seq, order)
        self.segments, row = [], lead
        for start, num in chunks:
            self.segments.append((row, start, num))
            row += num
        self.rows = torch.arange(lead, row)
        self.q_THD = torch.randn(row, Hq, dim, generator=g).to(q_dtype).to(device)
        self.page, self.device, self.group = page, device, Hq // K

    def pages(self):
        layer = self.cache.layers[0]
        return (layer.k, layer.v) if self.fmt == "nvfp4" else (layer.k_NBKD, layer.v_NBKD)

    def launch(self, tile=None):
        """The kernel's prefill rows (the others are left as they were: NaN here)."""
        plan = paged_prefill.plan(self.segments, self.tables, self.group, self.device, tile=tile)
        out = torch.full_like(self.q_THD, math.nan)
        paged_prefill.launch(self.q_THD, *self.pages(), plan, out)
        assert out[: self.rows[0]].isnan().all(), "rows outside the segments were written"
        return out[self.rows[0] :]

    def spec(self):
        return reference_prefill(self.q_THD, *self.pages(), self.segments, self.tables)

    def float64(self):
        """(o64, mag) per prefill row over the values ``KVCache.read`` returns."""
        outs, mags = [], []
        D = self.q_THD.shape[-1]
        for (row, start, num), table in zip(self.segments, self.tables, strict=True):
            c = torch.arange(start + num)
            slots = torch.tensor(table)[c // self.page] * self.page + c % self.page
            k, v = self.cache.read(0, slots.to(self.device), self.q_THD.dtype)
            K = k.shape[1]
            q = self.q_THD[row : row + num].double().view(num, K, self.group, D)
            scores = torch.einsum("qkgd,ckd->qkgc", q, k.double()) / math.sqrt(D)
            visible = c[None, :] <= torch.arange(start, start + num)[:, None]
            p = torch.softmax(scores.masked_fill(~visible.to(q.device)[:, None, None], -math.inf),
                              dim=-1)  # fmt: skip
            outs.append(torch.einsum("qkgc,ckd->qkgd", p, v.double()).reshape(num, -1, D))
            mags.append(torch.einsum("qkgc,ckd->qkgd", p, v.double().abs()).reshape(num, -1, D))
        return torch.cat(outs), torch.cat(mags)


def assert_within(got, scene: Scene, what: str):
    """``got`` within the module docstring's bound of float64 attention."""
    assert_attention_within(got, *scene.float64(), what)


SHAPES = {  # name -> (Hq, K), D, page, (start, num) per segment
    "G=3 D=16 P=4": ((6, 2), 16, 4, [(0, 7), (5, 9), (0, 2)]),
    "G=4 D=32 P=16": ((4, 1), 32, 16, [(0, 40), (17, 3), (0, 1)]),
    # From D = 64 NVFP4 block scales are read as int32 words of 4.
    "G=2 D=64 P=8": ((4, 2), 64, 8, [(3, 12), (0, 30)]),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("fmt", list(PAGE_FORMATS))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_spec_and_float64(device, shape, fmt, q_dtype):
    heads, dim, page, chunks = SHAPES[shape]
    scene = Scene(fmt, chunks, heads=heads, dim=dim, page=page, seed=len(fmt) + dim,
                  device=device, q_dtype=q_dtype)  # fmt: skip
    assert_within(scene.spec(), scene, "attend_fp32 over KVCache.read (the spec)")
    # Tiles of a few query tokens and context steps of 16 or 32: several of each per segment.
    tile = PrefillTile(rows=16, block_n=16, num_warps=4, num_stages=2)
    if fmt == "nvfp4" and q_dtype == torch.bfloat16:
        with pytest.raises(ValueError, match="need head dim and block_n >= 32"):
            scene.launch(tile)
        if dim < 32:
            return
        tile = PrefillTile(rows=16, block_n=32, num_warps=4, num_stages=2)
    for label, t in (("small tiles", tile), ("the default tile", None)):
        if t is None and dim < 32 and fmt == "nvfp4":
            continue
        out = scene.launch(t)
        assert out.dtype == q_dtype
        assert_within(out, scene, f"kernel, {label}")


@pytest.mark.parametrize("fmt", list(PAGE_FORMATS))
def test_reference_prefill_is_attend_fp32_over_cache_read(fmt):
    """The spec is what `PagedAttention.attend` runs for a prefill segment off the GPU."""
    heads, dim, page, chunks = SHAPES["G=3 D=16 P=4"]
    scene = Scene(fmt, chunks, heads=heads, dim=dim, page=page, seed=3, device="cpu",
                  q_dtype=torch.float32)  # fmt: skip
    want = []
    for (row, start, num), table in zip(scene.segments, scene.tables, strict=True):
        c = torch.arange(start + num)
        slots = torch.tensor(table)[c // page] * page + c % page
        k, v = scene.cache.read(0, slots, torch.float32)
        positions = torch.arange(start, start + num)[None]
        q = scene.q_THD[None, row : row + num]
        o = attend_fp32(q, k[None], v[None], positions, torch.tensor([start + num]))
        want.append(o[0])
    assert_bitwise(scene.spec(), torch.cat(want), f"reference_prefill, {fmt}")


def poison(scene: Scene, slots: torch.Tensor, head: int) -> None:
    for t in scene.pages():
        if isinstance(t, NVFP4Rows):
            t.amax.flatten(0, 1)[slots.to(scene.device), head] = math.nan
        else:
            t.flatten(0, 1)[slots.to(scene.device), head] = math.nan


@pytest.mark.parametrize("fmt", list(PAGE_FORMATS))
def test_nan_reaches_later_rows_of_its_group_only(device, fmt):
    heads, dim, page, chunks = SHAPES["G=3 D=16 P=4"]
    scene = Scene(fmt, chunks, heads=heads, dim=dim, page=page, seed=11, device=device,
                  q_dtype=torch.float32)  # fmt: skip
    tile = PrefillTile(rows=16, block_n=16, num_warps=4, num_stages=2)
    clean = scene.launch(tile)
    # NaN in every slot no context covers: never read.
    covered = torch.zeros(scene.cache.num_blocks * page, dtype=torch.bool)
    for (_, start, num), table in zip(scene.segments, scene.tables, strict=True):
        covered[[table[t // page] * page + t % page for t in range(start + num)]] = True
    for head in range(heads[1]):
        poison(scene, ~covered, head)
    assert_bitwise(scene.launch(tile), clean.cpu(), "NaN outside the contexts")
    # Segment 1 (5 cached + 9 new: output rows 7..15, positions 5..13; tiles of 4 tokens, the
    # least that fills 16 rows over 4 padded heads), context position 10 of KV head 1: rows at
    # positions 10.. of query heads 3-5 turn NaN, and so does position 9's, which shares the
    # tile of positions 9-12 and meets the NaN V row with probability 0.
    row = torch.zeros_like(covered)
    row[scene.tables[1][10 // page] * page + 10 % page] = True
    poison(scene, row, 1)
    got = scene.launch(tile).cpu()
    nan = torch.zeros(got.shape, dtype=torch.bool)
    nan[7 + 4 : 7 + 9, 3:6] = True
    assert torch.equal(got.isnan(), nan), "NaN positions"
    assert_bitwise(got[~nan], clean.cpu()[~nan], "outside the poisoned rows")


def test_plan_and_launch_name_the_values(device):
    heads, dim, page, chunks = SHAPES["G=4 D=32 P=16"]
    scene = Scene("nvfp4", chunks, heads=heads, dim=dim, page=page, seed=5, device=device,
                  q_dtype=torch.bfloat16)  # fmt: skip
    plan = paged_prefill.plan
    with pytest.raises(ValueError, match=r"a segment is \(first row, start, num >= 1\); got "
                       r"\(0, 0, 0\)"):  # fmt: skip
        plan([(0, 0, 0)], [[0]], 4, device)
    with pytest.raises(ValueError, match=r"one block table per segment: 1 segments, 2 tables"):
        plan([(0, 0, 3)], [[0], [1]], 4, device)
    with pytest.raises(ValueError, match=r"group must be a positive number .* got 0"):
        plan([(0, 0, 3)], [[0]], 0, device)
    with pytest.raises(ValueError, match=r"PrefillTile.rows must be a power of two >= 16; got 8"):
        PrefillTile(rows=8, block_n=16, num_warps=4, num_stages=2)
    good = plan(scene.segments, scene.tables, 4, device)
    q, (k, v) = scene.q_THD, scene.pages()
    out = torch.empty_like(q)
    launch = paged_prefill.launch
    with pytest.raises(ValueError, match=r"bfloat16 or float32 tensor \[T, Hq, D\]; got "
                       r"torch.float16"):  # fmt: skip
        launch(q.half(), k, v, good, out.half())
    with pytest.raises(ValueError, match=r"out_THD must be like q_THD"):
        launch(q, k, v, good, out.float())
    with pytest.raises(ValueError, match=r"must give the plan's group of 2"):
        launch(q, k, v, plan(scene.segments, scene.tables, 2, device), out)
    with pytest.raises(ValueError, match=r"one format and both \[num_blocks, P, K, D\]"):
        launch(q, k, torch.zeros(k.shape, device=device), good, out)
    with pytest.raises(ValueError, match=r"need head dim and block_n >= 32 .* block_n=16"):
        short = PrefillTile(rows=16, block_n=16, num_warps=4, num_stages=2)
        launch(q, k, v, plan(scene.segments, scene.tables, 4, device, tile=short), out)


@pytest.mark.parametrize("fmt", ["bf16 pages", "nvfp4"])
def test_a_plan_padded_with_tiles_of_an_empty_segment_gives_the_same_rows(device, fmt):
    """`plan_over` (a graph's plan): the segments behind an empty row 0, the tiles of `plan`
    pointing one row further, and spare tiles naming row 0, which read and store nothing."""
    heads, dim, page, chunks = SHAPES["G=4 D=32 P=16"]
    scene = Scene(fmt, chunks, heads=heads, dim=dim, page=page, seed=3, device=device,
                  q_dtype=torch.float32)  # fmt: skip
    tile = PrefillTile(rows=16, block_n=32, num_warps=4, num_stages=2)
    want = scene.launch(tile)
    flat = paged_prefill.plan(scene.segments, scene.tables, scene.group, device, tile=tile)
    int32 = dict(dtype=torch.int32, device=device)
    segments = torch.cat([torch.zeros(1, 3, **int32), flat.segments_S3])
    table = torch.cat([torch.full((1, flat.table_SN.shape[1]), 7, **int32), flat.table_SN])
    tiles = flat.tiles_P2 + torch.tensor([1, 0], **int32)
    spare = torch.zeros(5, 2, **int32)
    tiles = torch.cat([tiles[:2], spare[:3], tiles[2:], spare[3:]])
    padded = paged_prefill.plan_over(segments, table, tiles, scene.group, tile=tile)
    assert padded.block_q == flat.block_q
    out = torch.full_like(scene.q_THD, math.nan)
    paged_prefill.launch(scene.q_THD, *scene.pages(), padded, out)
    assert out[: scene.rows[0]].isnan().all(), "a tile of the empty segment stored a row"
    assert_bitwise(out[scene.rows[0] :], want.cpu(), "padded plan against plan")


def test_plan_over_names_what_it_refuses(device):
    int32 = dict(dtype=torch.int32, device=device)
    segments, table, tiles = (torch.zeros(2, 3, **int32), torch.zeros(2, 4, **int32),
                              torch.zeros(5, 2, **int32))  # fmt: skip
    with pytest.raises(ValueError, match=r"segments_S3 must be an int32 \[rows, 3\] tensor; got "
                       r"torch.int64 \(2, 3\)"):  # fmt: skip
        paged_prefill.plan_over(segments.long(), table, tiles, 4)
    with pytest.raises(ValueError, match=r"tiles_P2 must be an int32 \[rows, 2\] tensor"):
        paged_prefill.plan_over(segments, table, tiles[:, :1], 4)
    with pytest.raises(ValueError, match="one table row per segment: 2 segments, 1 table rows"):
        paged_prefill.plan_over(segments, table[:1], tiles, 4)
    with pytest.raises(ValueError, match="table_SN must be contiguous"):
        paged_prefill.plan_over(segments, torch.zeros(4, 2, **int32).t(), tiles, 4)
    with pytest.raises(ValueError, match="group must be a positive number"):
        paged_prefill.plan_over(segments, table, tiles, 0)


def test_tiles_cover_each_segment_in_order():
    tile = PrefillTile(rows=64, block_n=64, num_warps=4, num_stages=2)
    p = paged_prefill.plan([(3, 0, 20), (23, 8, 5)], [[1, 2], [4]], 8, "cpu", tile=tile)
    assert p.block_q == 8  # 8 tokens x 8 heads: 64 rows
    assert p.tiles_P2.tolist() == [[0, 0], [0, 8], [0, 16], [1, 0]]
    assert p.segments_S3.tolist() == [[3, 0, 20], [23, 8, 5]]
    assert p.table_SN.tolist() == [[1, 2], [4, 0]]
    assert tile.block_q(3) == 16  # 4 padded heads
    assert tile.block_q(32) == 2
    assert tile.block_q(200) == 1  # 256 rows: one token at least


# ---- real shapes, compiled (Qwen3-30B-A3B attention: 32 query / 4 KV heads of 128) ----------


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16 pages", "nvfp4"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("tile", ["default", "128:64:8:2"])
def test_qwen3_shapes_on_gpu(fmt, q_dtype, tile):
    chunks = [(0, 512), (0, 2048), (1000, 300), (0, 2), (64, 1), (3000, 1)]  # decodes last
    scene = Scene(fmt, chunks, heads=(32, 4), dim=128, page=16, seed=1, device="cuda",
                  q_dtype=q_dtype, lead=3, scale=2.0)  # fmt: skip
    config = None if tile == "default" else PrefillTile(*(int(v) for v in tile.split(":")))
    assert_within(scene.launch(config), scene, f"{fmt}, {q_dtype}, tile {tile}")
