"""The register decode attention (`paged_attention_registers`, through a registers `DecodeTile`)
against the same checks as `paged_attention`'s program (test_kernel_paged_attention.py): outputs
within the float64 bound, V rows bitwise through contexts of one token (every code and scale
byte), NaN confined to its sequence's KV-head group, padding never read, CUDA-graph replays
that follow new tables. The kernel is Gluon, compiled only: its tests run on the GPU; on the
CPU only the checks and tile rules run.
"""

import math

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from test_kernel_paged_attention import (  # noqa: E402
    QWEN3_D,
    QWEN3_HEADS,
    QWEN3_PAGE,
    Scene,
    assert_graph_replay_follows,
    assert_nan_confined,
    assert_within,
    every_byte_pages,
    ragged,
)

from fp4rl.kernels import attention_tiles, paged_attention  # noqa: E402
from fp4rl.kernels.attention_tiles import DecodeTile  # noqa: E402

REGISTER_TILES = {
    "16": DecodeTile(block_n=16, num_warps=1, num_stages=2, registers=True),
    "32": DecodeTile(block_n=32, num_warps=1, num_stages=2, registers=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("tile", list(REGISTER_TILES))
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_registers_at_qwen3_shapes_on_gpu(tile, batch):
    """Ragged contexts from 1 to 4,096 tokens in shuffled pages, one stretch, the launcher's
    split and an odd one."""
    scene = Scene("nvfp4", ragged(batch, batch), heads=QWEN3_HEADS, dim=QWEN3_D,
                  page=QWEN3_PAGE, seed=batch, device="cuda", q_dtype=torch.bfloat16,
                  scale=2.0)  # fmt: skip
    config = REGISTER_TILES[tile]
    for splits in (None, 1, 3):
        out = scene.launch(config=config, num_splits=splits)
        assert out.dtype == torch.bfloat16 and out.shape == scene.q_BHD.shape
        assert_within(out, scene, f"registers {tile}, batch {batch}, splits {splits}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads, dim, page",
    [((8, 4), 128, 16), ((16, 2), 128, 8), ((6, 3), 128, 32), ((8, 1), 128, 64), ((5, 5), 128, 4)],
    ids=str,
)
def test_registers_other_groups_dims_and_pages_on_gpu(heads, dim, page):
    """Groups of 1 to 8 query heads, pages shorter and longer than a step."""
    scene = Scene("nvfp4", [1, 31, 32, 33, 300, 17], heads=heads, dim=dim, page=page, seed=dim,
                  device="cuda", q_dtype=torch.bfloat16)  # fmt: skip
    for tile in REGISTER_TILES.values():
        for splits in (1, 3):
            out = scene.launch(config=tile, num_splits=splits)
            assert_within(out, scene, f"{heads} heads of {dim}, page {page}, {tile}")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", list(REGISTER_TILES))
def test_registers_context_of_one_returns_the_v_rows_bitwise_on_gpu(tile):
    """Pages of one token, 16 sequences of context 1: every V row comes back bitwise through the
    register decode, every block-scale byte (NaN ones included) and every code."""
    B, Hq, K, D = 16, 4, 2, 128
    scene = Scene("nvfp4", [1] * B, heads=(Hq, K), dim=D, page=1, seed=7, device="cuda",
                  q_dtype=torch.bfloat16)  # fmt: skip
    pages = scene.cache.layers[0].v
    rows = every_byte_pages(pages.codes.numel() * 2 // D, D, seed=8)
    for page, value in zip(pages.tensors(), rows.tensors(), strict=True):
        page.copy_(value.view(page.shape))
    _, v_BCKD, _ = scene.read()
    want = v_BCKD[:, 0].repeat_interleave(Hq // K, dim=1)  # [B, Hq, D]: head h reads h // G
    got = scene.launch(config=REGISTER_TILES[tile])
    assert torch.equal(got.isnan(), want.isnan()), "NaN positions"
    same = (got == want) | want.isnan()
    assert same.all(), f"{int((~same).sum())} of {same.numel()} V values differ"


@pytest.mark.gpu
def test_registers_every_key_byte_within_the_bound_on_gpu():
    """K pages of every code byte, every block-scale byte but NaN ones and global scales from
    2**-110 up (and one flushed to 0 below 2**-117): the scores take each through the register
    decode (checked against float64 over the values ``KVCache.read`` returns). Queries are
    scaled down to keep the scores within +-16: no probability reaches the subnormals, where
    float64 and FP32 exp part ways."""
    scene = Scene("nvfp4", [40, 1, 77, 16], heads=(8, 1), dim=128, page=16, seed=9,
                  device="cuda", q_dtype=torch.bfloat16)  # fmt: skip
    scene.q_BHD.mul_(2.0**-14)
    pages = scene.cache.layers[0].k
    rows = every_byte_pages(pages.codes.numel() * 2 // 128, 128, seed=10)
    scale = rows.block_scale.view(torch.uint8)
    scale[(scale & 0x7F) == 0x7F] = 0x38  # E4M3 NaN -> 1.0: NaN scores would hide the rest
    rows.amax.nan_to_num_(nan=2688.0).clamp_(max=2.0 * 2688)  # scores in exp's range
    rows.amax[0] = 2.0**-110 * 2688
    for page, value in zip(pages.tensors(), rows.tensors(), strict=True):
        page.copy_(value.view(page.shape))
    for tile in REGISTER_TILES.values():
        assert_within(scene.launch(config=tile, num_splits=1), scene, f"every K byte, {tile}")


@pytest.mark.gpu
def test_registers_nan_stays_in_its_sequence_and_padding_is_never_read_on_gpu():
    scene = Scene("nvfp4", [1, 5, 12, 40, 3, 4], heads=(8, 2), dim=128, page=4, seed=11,
                  device="cuda", q_dtype=torch.bfloat16)  # fmt: skip
    # Sequence 3's row at offset 2 of its sixth page: query heads 4-7 turn NaN.
    assert_nan_confined(scene, REGISTER_TILES["16"], sequence=3, block=5)


@pytest.mark.gpu
def test_registers_graph_replay_follows_tables_and_contexts_on_gpu():
    scene = Scene("nvfp4", ragged(64, 2), heads=QWEN3_HEADS, dim=QWEN3_D, page=QWEN3_PAGE,
                  seed=2, device="cuda", q_dtype=torch.bfloat16)  # fmt: skip
    assert_graph_replay_follows(scene, "registers, replayed", config=REGISTER_TILES["32"])


def test_registers_checks_name_the_values(device):
    scene = Scene("nvfp4", [1, 40], heads=(8, 2), dim=128, page=16, seed=5, device=device,
                  q_dtype=torch.bfloat16)  # fmt: skip
    q, (k, v), table, ctx = scene.q_BHD, scene.pages(), scene.block_table_BN, scene.context_B
    tile = REGISTER_TILES["16"]
    launch = paged_attention.launch
    with pytest.raises(ValueError, match=r"runs one warp with the next step in flight"):
        DecodeTile(block_n=32, num_warps=4, num_stages=2, registers=True)
    if device == "cpu":
        with pytest.raises(
            ValueError, match=r"\(q_BHD.s device\) runs on a CUDA GPU only; got cpu"
        ):
            launch(q, k, v, table, ctx, config=tile)
    with pytest.raises(ValueError, match=r"takes bfloat16 queries.*got torch.float32, D=128, G=4"):
        launch(q.float(), k, v, table, ctx, config=tile)
    with pytest.raises(ValueError, match=r"got torch.bfloat16, D=128, G=16"):
        launch(torch.cat([q] * 4, 1), k, v, table, ctx, config=tile)
    wide = Scene("nvfp4", [1, 40], heads=(8, 2), dim=256, page=16, seed=5, device=device,
                 q_dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match=r"got torch.bfloat16, D=256, G=4"):
        wide.launch(config=tile)
    bf16 = Scene("bf16 pages", [1, 40], heads=(8, 2), dim=128, page=16, seed=5, device=device,
                 q_dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match=r"is for NVFP4 pages"):
        bf16.launch(config=tile)


def test_registers_refuse_caches_of_2_32_rows():
    """A step's cache row is computed in 32 bits: a cache of 2**32 rows (slots x KV heads) is
    refused before anything is launched (shapes only, nothing allocated at that size)."""
    from types import SimpleNamespace

    from fp4rl.kernels import paged_attention_registers

    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    for blocks, refused in ((2**26, True), (2**26 - 1, False)):
        pages = SimpleNamespace(shape=(blocks, 16, 4, 128))  # blocks x 16 slots x 4 heads
        if refused:
            with pytest.raises(ValueError, match=r"under 2\*\*32 cache rows; got 4294967296"):
                paged_attention_registers.launch_kernel(
                    (1, 1, 1), q, pages, pages, None, None, None, None, block_n=16
                )  # fmt: skip
        else:  # past the check: the stand-in pages have no members to launch with
            with pytest.raises(AttributeError):
                paged_attention_registers.launch_kernel(
                    (1, 1, 1), q, pages, pages, None, None, None, None, block_n=16
                )  # fmt: skip


def test_launcher_takes_the_register_kernel_above_small_launches(device, monkeypatch):
    """`page_format` names the register kernel for NVFP4 pages under BF16 queries at head dim
    128 on a GPU; its plan keeps the Triton program's tiles up to SMALL_LAUNCH sequence-heads."""
    monkeypatch.setattr(attention_tiles, "multiprocessors", lambda device: 132)
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16, device=device)
    fmt = attention_tiles.page_format(q, True, 128, 8)
    assert fmt == ("registers" if device == "cuda" else "nvfp4")
    assert attention_tiles.page_format(q, False, 128, 8) == "bf16"
    assert attention_tiles.page_format(q.float(), True, 128, 8) == "nvfp4"
    assert attention_tiles.page_format(q, True, 128, 16) == "nvfp4"
    cuda = torch.device("cuda")
    small = attention_tiles.plan_for("registers", 16, 4096, cuda)
    assert small == attention_tiles.plan_for("nvfp4", 16, 4096, cuda)
    assert not small[0].registers
    assert attention_tiles.plan_for("registers", 20, 4096, cuda) == (
        attention_tiles.REGISTERS_TILE,
        None,
    )


def test_launcher_passes_the_register_kernel_its_arguments_by_name(device, monkeypatch):
    """On any machine, with the kernel replaced by a recorder: each of the launcher's tensors and
    sizes reaches the kernel parameter of its name (the GPU tests cannot tell a swapped pair of
    same-shaped arguments, e.g. K's and V's scales, from a numerics bug)."""
    from fp4rl.kernels import paged_attention_registers as registers

    class Recorder:
        def __getitem__(self, grid):
            self.grid = grid
            return self

        def __call__(self, *args, **kwargs):
            self.args, self.kwargs = args, kwargs

    recorder = Recorder()
    # The parameters the launcher's positional arguments bind to, as Triton binds them.
    arg_names = [n for n in registers._paged_decode_registers_kernel.arg_names if not n.isupper()]
    monkeypatch.setattr(registers, "_paged_decode_registers_kernel", recorder)
    monkeypatch.setattr(registers, "check_launch", lambda *args: None)
    scene = Scene("nvfp4", [1, 40, 17], heads=(8, 2), dim=128, page=16, seed=5, device=device,
                  q_dtype=torch.bfloat16)  # fmt: skip
    k, v = scene.pages()
    out = scene.launch(config=attention_tiles.REGISTERS_TILE, num_splits=1)
    bound = dict(zip(arg_names, recorder.args, strict=True)) | recorder.kwargs
    assert recorder.grid == (3 * 2, 1)
    assert bound["q_BHD"] is scene.q_BHD and bound["out_BHD"] is out
    for name, pages in (("k", k), ("v", v)):
        codes, scales, amax = (bound[f"{name}_{m}"] for m in
                               ("pages", "block_scale", "amax"))  # fmt: skip
        assert codes.dtype == torch.int32 and codes.data_ptr() == pages.codes.data_ptr(), name
        assert scales.dtype == torch.uint8 and scales.data_ptr() == pages.block_scale.data_ptr()
        assert amax is pages.amax, name
    assert bound["table_BN"] is scene.block_table_BN and bound["context_B"] is scene.context_B
    assert all(bound[p] is out for p in ("part_m", "part_l", "part_o"))  # unsplit: not written
    assert bound["softmax_scale"] == 1 / math.sqrt(128) and bound["num_kv_heads"] == 2
    assert bound["table_cols"] == scene.block_table_BN.shape[1]
    assert (bound["G"], bound["D"], bound["PAGE"], bound["BLOCK_N"]) == (4, 128, 16, 16)
    assert bound["SPLIT"] is False and bound["num_warps"] == 1
    assert bound["enable_fp_fusion"] is False


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_global_scales_are_the_quantizers_for_every_amax_on_gpu(dtype):
    """`kv_page_registers.global_scales` (Markstein's quotient for BF16 and FP16
    amaxes, ``div.rn`` for FP32) against `reference.global_scale_from_amax` on the CPU: every
    BF16 and FP16 bit pattern, and FP32 ones at random and around the flush, bit for bit but
    for NaN payloads."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from fp4rl.fp4.reference import global_scale_from_amax
    from fp4rl.kernels import kv_page_registers

    @gluon.jit
    def scales_kernel(amax, out, n, BLOCK: gl.constexpr):
        i = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, gl.BlockedLayout([1], [32], [4], [0]))
        ok = i < n
        gl.store(
            out + i, kv_page_registers.global_scales(gl.load(amax + i, mask=ok, other=0.0)), mask=ok
        )

    if dtype == torch.float32:
        g = torch.Generator().manual_seed(0)
        bits = torch.randint(-(2**31), 2**31 - 1, (1 << 22,), generator=g, dtype=torch.int32)
        near = torch.tensor(2688 * 2.0**-117).view(torch.int32) + torch.arange(-4096, 4096)
        amax = torch.cat([bits, near.to(torch.int32)]).view(torch.float32)
    else:
        amax = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    out = torch.empty(amax.shape, dtype=torch.float32, device="cuda")
    scales_kernel[(-(-amax.numel() // 512),)](amax.cuda(), out, amax.numel(), BLOCK=512,
                                              num_warps=4)  # fmt: skip
    got, want = out.cpu(), global_scale_from_amax(amax)
    assert torch.equal(got.isnan(), want.isnan()), "NaN positions"
    finite = ~want.isnan()
    differ = got[finite].view(torch.int32) != want[finite].view(torch.int32)
    examples = amax[finite][differ][:4].tolist()
    assert not differ.any(), f"{int(differ.sum())} scales differ, e.g. for amaxes {examples}"
