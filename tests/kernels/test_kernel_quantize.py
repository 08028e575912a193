"""Round-to-nearest quantize and its fused fake-quant against the reference, bit for bit."""

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import (  # noqa: E402
    DTYPES,
    assert_bitwise,
    assert_nvfp4_equal,
    assert_record_equal,
    assert_same_values,
    cpu,
    e4m3_edge_rows,
    near_boundary_rows,
    poisoned_rows,
    tie_rows,
)

from fp4rl import kernels  # noqa: E402
from fp4rl.fp4 import reference as R  # noqa: E402
from fp4rl.fp4.format import MIN_GLOBAL_SCALE  # noqa: E402
from fp4rl.fp4.tensor import NVFP4Rows  # noqa: E402
from fp4rl.kernels import launch, nearest  # noqa: E402

# (shape, scaling): rows 1, 3, 17, 33; per-expert [E, N, K] with 2 trailing dims; 4-D groups.
CASES = [
    ((1, 16), "row"),
    ((3, 64), "row"),
    ((17, 48), "row"),
    ((33, 160), "row"),
    ((1, 16), "tensor"),
    ((17, 48), "tensor"),
    ((33, 96), "tensor"),
    ((3, 5, 32), 2),
    ((2, 17, 48), 2),
    ((3, 5, 32), 1),
    ((3, 5, 32), "tensor"),
    ((2, 3, 4, 16), 2),
    ((2, 3, 4, 16), 3),
]


def check_quantize(x: torch.Tensor, scaling, global_scale=None) -> None:
    """quantize and fake_quantize of x (on the test device) against the reference."""
    x_cpu = x.cpu()
    gs_cpu = None if global_scale is None else global_scale.cpu()
    want = R.quantize(x_cpu, scaling=scaling, global_scale=gs_cpu)
    got = kernels.quantize(x, scaling=scaling, global_scale=global_scale)
    assert_nvfp4_equal(cpu(got), want, f"quantize {x.dtype} {tuple(x.shape)} {scaling!r}")
    fake = kernels.fake_quantize(x, scaling=scaling, global_scale=global_scale)
    assert_same_values(fake, R.dequantize(want, x.dtype), f"fake_quantize {scaling!r}")


def randn(shape, dtype, device, seed: int, spread: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Random magnitudes over several binades, so blocks differ in scale within a row.
    x = torch.randn(shape, generator=g) * torch.exp2(spread * 6 * torch.rand(shape, generator=g))
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "scaling"), CASES)
def test_random_inputs_match_reference(device, dtype, shape, scaling):
    check_quantize(randn(shape, dtype, device, seed=len(shape) * 100 + shape[-1]), scaling)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_e2m1_tie_and_its_neighbours(device, dtype):
    qs = (-4,) if dtype == torch.float16 else (-4, -117, 60)  # -117: MIN_GLOBAL_SCALE exactly
    for q in qs:
        x, ps = tie_rows(q, dtype)
        want = R.quantize(x, scaling="row")
        # The construction works: global scale 2**q, tie-block scale 2**p.
        assert (want.global_scale == 2.0**q).all()
        assert torch.equal(want.block_scale[:, 1].float(), torch.exp2(torch.tensor(ps)).float())
        for scaling in ("row", "tensor"):
            check_quantize(x.to(device), scaling)
        check_quantize(x.to(device), "row", global_scale=torch.tensor([[2.0**q]], device=device))


def test_values_one_ulp_around_every_boundary_under_uneven_scales(device):
    """Catches an inexact division or reciprocal (Triton's default fp32 `/` on the GPU)."""
    x = near_boundary_rows(24, torch.Generator().manual_seed(8))
    check_quantize(x.to(device), "row")


@pytest.mark.parametrize("dtype", DTYPES)
def test_e4m3_block_scale_ties_underflow_and_saturation(device, dtype):
    for q in (0,) if dtype == torch.float16 else (0, -117, -90, 100):
        x = e4m3_edge_rows(q, dtype).to(device)
        check_quantize(x, "row")
        check_quantize(x, "tensor")
        # A caller's scale 8x too small pushes ratios past 448: the clamp saturates them.
        check_quantize(x, "row", global_scale=torch.full((3, 1), 2.0 ** (q - 3), device=device))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_denormal_inputs_and_the_min_global_scale_flush(device, dtype):
    """Denormal x must not be flushed (the GPU's .ftz would); tiny groups flush to zero."""
    smallest = 2688.0 * MIN_GLOBAL_SCALE  # amax whose global scale is exactly MIN_GLOBAL_SCALE
    # Block 1 has ratio 2**-9: block scale 2**-9, reciprocal 2**126, so denormal x scale to
    # 0.25 .. 0.5 (codes 0 and 1).
    tiny = [6.0 * 2.0**-126, 2.0**-127, 3 * 2.0**-129, -(2.0**-128)]
    tiny += [2.0**-131 * i for i in range(12)]
    row = torch.tensor([smallest] + [0.0] * 15 + tiny, dtype=torch.float64)
    x = torch.stack([row, row * 0.99, row * 0.5, row * 2**-20]).to(dtype)
    want = R.quantize(x, scaling="row")
    assert want.global_scale[0].item() == MIN_GLOBAL_SCALE and want.global_scale[1].item() == 0
    assert R.unpack_e2m1(want.codes[0])[17:20].tolist() == [1, 1, 8]  # not flushed to zero
    check_quantize(x.to(device), "row")
    check_quantize(x.to(device), "tensor")


@pytest.mark.parametrize("dtype", DTYPES)
def test_zeros_signed_zeros_and_zero_blocks(device, dtype):
    x = randn((4, 64), dtype, device, seed=1)
    x[0] = 0.0  # all-zero row: zero scale, zero codes
    x[1] = -0.0  # negative zeros: zero scale, zero codes (no sign: the group is dead)
    x[2, 16:32] = 0.0  # a zero block in a live row
    x[3, ::3] = -0.0  # -0 inside live blocks keeps its sign bit
    check_quantize(x, "row")
    check_quantize(x, "tensor")
    check_quantize(torch.zeros(3, 32, dtype=dtype, device=device), "tensor")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_values_poison_their_group(device, dtype):
    g = torch.Generator().manual_seed(7)
    x = poisoned_rows(48, dtype, g).to(device)
    check_quantize(x, "row")
    got = kernels.quantize(x, scaling="row")
    assert (got.block_scale[:4].view(torch.uint8) == 0x7F).all() and (got.codes[:4] == 0).all()
    check_quantize(x, "tensor")
    check_quantize(x.view(5, 3, 16), 2)
    # A finite caller-given scale still poisons the blocks that hold inf or NaN.
    check_quantize(x, "row", global_scale=torch.full((5, 1), 0.01, device=device))


def paged(num_slots: int, heads: int, k: int, device, dtype=torch.bfloat16) -> NVFP4Rows:
    """Pages ``[num_slots / 4, 4, heads, k]`` filled with a recognisable pattern, their amaxes
    in ``dtype``."""
    lead = (num_slots // 4, 4, heads)
    fill = torch.arange(math.prod(lead) * k // 2, dtype=torch.int64) % 251
    return NVFP4Rows(
        codes=fill.to(torch.uint8).view(*lead, k // 2).to(device),
        block_scale=torch.full((*lead, k // 16), 0x38, dtype=torch.uint8)
        .view(torch.float8_e4m3fn)
        .to(device),
        amax=torch.full((*lead, 1), 7.0, dtype=dtype).to(device),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "k"), [(1, 4, 128), (5, 2, 32), (9, 3, 16)])
def test_quantize_into_pages_is_quantize_then_put(device, dtype, tokens, heads, k):
    """Rows written straight into the pages at the slots hold the bits of quantize + put,
    special rows included, and every other slot keeps what it held."""
    x = randn((tokens, heads, k), dtype, device, seed=tokens * heads + k)
    g = torch.Generator().manual_seed(k)
    x[0, 0] = poisoned_rows(k, dtype, g)[0].to(device)  # inf/NaN: the row's group is poisoned
    if tokens > 1:
        x[1] = 0.0
    # A strided view, as the engine's slots are (a row of its staged step buffer).
    slots = torch.randperm(8 * tokens + 8, generator=g)[:tokens]
    slots = torch.stack([slots, -slots], dim=1).to(device)[:, 0]
    assert slots.stride(0) == 2
    want = paged(8 * tokens + 8, heads, k, "cpu", dtype)
    R.quantize_into(x.cpu(), want, slots.cpu())
    got = paged(8 * tokens + 8, heads, k, device, dtype)
    kernels.quantize_into(x, got, slots)
    assert_nvfp4_equal(cpu(got), want, f"quantize_into {dtype} {tuple(x.shape)}")


def test_quantize_into_checks_name_the_values(device):
    x = randn((3, 2, 32), torch.bfloat16, device, seed=0)
    pages = paged(16, 2, 32, device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match=r"pages must be \[N, P, heads, K\] = \[N, P, 2, 32\]"):
        kernels.quantize_into(x, paged(16, 4, 32, device), slots)
    with pytest.raises(ValueError, match=r"x_TKD must be \[T, heads, K\]; got shape \(6, 32\)"):
        kernels.quantize_into(x.view(6, 32), pages, slots)
    with pytest.raises(ValueError, match=r"slots_T must be int64 of shape \(3,\); got torch.int32"):
        kernels.quantize_into(x, pages, slots.to(torch.int32))
    with pytest.raises(ValueError, match=r"pages keep torch.float32 amaxes but x_TKD is "
                                         r"torch.bfloat16"):  # fmt: skip
        kernels.quantize_into(x, paged(16, 2, 32, device, torch.float32), slots)


def random_pages(num_blocks: int, page: int, heads: int, k: int, device, seed: int, dtype):
    """Pages ``[num_blocks, page, heads, k]`` of random bytes, scales and ``dtype`` amaxes
    included: a slot written by mistake, or left unwritten, shows."""
    g = torch.Generator().manual_seed(seed)
    lead = (num_blocks, page, heads)

    def noise(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    return NVFP4Rows(
        codes=noise(*lead, k // 2).to(device),
        block_scale=noise(*lead, k // 16).view(torch.float8_e4m3fn).to(device),
        amax=noise(*lead, dtype.itemsize).view(dtype).to(device),
    )


def clone_pages(pages: NVFP4Rows) -> NVFP4Rows:
    return pages.map(torch.clone)


def check_pair_into(k, v, slots, k_pages, v_pages, what: str) -> None:
    """One paired launch stores, in pages of random bytes, what two single launches store and
    what the reference stores: K's rows into K's pages, V's into V's, nothing else touched."""
    want = [clone_pages(p).map(lambda m: m.cpu()) for p in (k_pages, v_pages)]
    R.quantize_into(k.cpu(), want[0], slots.cpu())
    R.quantize_into(v.cpu(), want[1], slots.cpu())
    single = [clone_pages(p) for p in (k_pages, v_pages)]
    kernels.quantize_into(k, single[0], slots)
    kernels.quantize_into(v, single[1], slots)
    assert kernels.quantize_into_pair(k, k_pages, v, v_pages, slots) == (None, None)
    for name, got, one, spec in zip("kv", (k_pages, v_pages), single, want, strict=True):
        assert_nvfp4_equal(cpu(got), cpu(one), f"{what} {name}: pair vs two launches")
        assert_nvfp4_equal(cpu(got), spec, f"{what} {name}: pair vs reference")
    # With records, the same pages and each site's record (its per-row quantization).
    for form in ("full", "compact"):
        pages = [clone_pages(p) for p in single]
        records = kernels.quantize_into_pair(k, pages[0], v, pages[1], slots, form)
        for name, x, got, record, spec in zip("kv", (k, v), pages, records, want, strict=True):
            assert_nvfp4_equal(cpu(got), spec, f"{what} {name}: pages with a {form} record")
            want_t = R.quantize(x.cpu(), scaling="row")
            assert_record_equal(record, want_t, form, f"{what} {name}: {form} record")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "k"), [(1, 4, 64), (5, 2, 32), (9, 3, 64)])
def test_quantize_into_pair_is_two_quantize_into(device, dtype, tokens, heads, k):
    """K and V in one launch (grid axis 1 picks the tensor) store the bits of two launches,
    special rows included, at slots out of order given as a strided view."""
    k_TKD = randn((tokens, heads, k), dtype, device, seed=tokens + k)
    v_TKD = randn((tokens, heads, k), dtype, device, seed=tokens + k + 1, spread=0.5)
    g = torch.Generator().manual_seed(k)
    v_TKD[0, -1] = poisoned_rows(k, dtype, g)[1].to(device)  # -NaN: V's row group poisoned
    if tokens > 1:
        k_TKD[1] = 0.0
        v_TKD[-1, 0] = -0.0
    slots = torch.randperm(4 * (2 * tokens + 2), generator=g)[:tokens]
    slots = torch.stack([slots, -slots], dim=1).to(device)[:, 0]
    assert slots.stride(0) == 2
    pages = [random_pages(2 * tokens + 2, 4, heads, k, device, s, dtype) for s in (1, 2)]
    check_pair_into(k_TKD, v_TKD, slots, *pages, f"{dtype} {tuple(k_TKD.shape)}")


def test_quantize_into_pair_checks_name_k_or_v(device):
    k = randn((3, 2, 32), torch.bfloat16, device, seed=0)
    v = randn((3, 2, 32), torch.bfloat16, device, seed=1)
    k_pages, v_pages = (random_pages(4, 4, 2, 32, device, s, torch.bfloat16) for s in (0, 1))
    slots = torch.tensor([5, 0, 9], device=device)
    wide = random_pages(4, 4, 4, 32, device, 2, torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"v_pages must be \[N, P, heads, K\] = \[N, P, 2, 32\] for v"
    ):
        kernels.quantize_into_pair(k, k_pages, v, wide, slots)
    with pytest.raises(ValueError, match=r"k_pages must be \[N, P, heads, K\]"):
        kernels.quantize_into_pair(k, wide, v, v_pages, slots)
    with pytest.raises(ValueError, match=r"k_TKD must be \[T, heads, K\]; got shape \(6, 32\)"):
        kernels.quantize_into_pair(k.view(6, 32), k_pages, v, v_pages, slots)
    v_strided = v.transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match=r"v_TKD: x must be contiguous"):
        kernels.quantize_into_pair(k, k_pages, v_strided, v_pages, slots)
    with pytest.raises(TypeError, match=r"v_TKD: NVFP4 quantization takes .* got torch.int32"):
        kernels.quantize_into_pair(k, k_pages, v.to(torch.int32), v_pages, slots)
    other_dtype = r"v_TKD must have k_TKD's shape \(3, 2, 32\) and dtype torch.bfloat16; got "
    half_pages = random_pages(4, 4, 2, 32, device, 3, torch.float16)
    with pytest.raises(ValueError, match=other_dtype + r"\(3, 2, 32\) torch.float16"):
        kernels.quantize_into_pair(k, k_pages, v.half(), half_pages, slots)
    with pytest.raises(ValueError, match=r"v_TKD must have k_TKD's shape \(3, 2, 32\)"):
        kernels.quantize_into_pair(k, k_pages, v[:2], v_pages, slots)
    with pytest.raises(ValueError, match="k_pages keep torch.float16 amaxes but k_TKD is"):
        kernels.quantize_into_pair(k, half_pages, v, v_pages, slots)
    strided = dataclasses.replace(v_pages, codes=v_pages.codes.transpose(0, 1))
    with pytest.raises(ValueError, match=r"v_pages.codes must be contiguous"):
        kernels.quantize_into_pair(k, k_pages, v, strided, slots)
    with pytest.raises(ValueError, match=r"slots_T must be int64 of shape \(3,\); got torch.int32"):
        kernels.quantize_into_pair(k, k_pages, v, v_pages, slots.to(torch.int32))
    if device == "cuda":
        with pytest.raises(ValueError, match="v_pages.block_scale must be on cuda"):
            cpu_scales = dataclasses.replace(v_pages, block_scale=v_pages.block_scale.cpu())
            kernels.quantize_into_pair(k, k_pages, v, cpu_scales, slots)
    # No rows: nothing stored, nothing launched.
    before = [clone_pages(p) for p in (k_pages, v_pages)]
    empty = slots[:0]
    kernels.quantize_into_pair(k[:0], k_pages, v[:0], v_pages, empty)
    for got, want in zip((k_pages, v_pages), before, strict=True):
        assert_nvfp4_equal(cpu(got), cpu(want), "no rows")
    records = kernels.quantize_into_pair(k[:0], k_pages, v[:0], v_pages, empty, "full")
    assert [r.codes.shape for r in records] == [(0, 2, 16)] * 2
    with pytest.raises(ValueError, match="record form must be 'full', 'compact' or None"):
        kernels.quantize_into_pair(k, k_pages, v, v_pages, slots, "sparse")


@pytest.mark.parametrize("dtype", DTYPES)
def test_caller_given_global_scales(device, dtype):
    x = randn((2, 6, 32), dtype, device, seed=3)
    w1, w3 = x[0], x[1]  # an expert's W1 and W3 share one scale
    shared = R.global_scale_from_amax(R.amax_of(w1.cpu(), w3.cpu(), dims=(0, 1))).to(device)
    check_quantize(w1, "tensor", global_scale=shared)
    check_quantize(w3, "tensor", global_scale=shared)
    per_row = torch.tensor([[1e-3], [0.0], [math.nan], [math.inf], [2.0**-117], [50.0]])
    check_quantize(w1, "row", global_scale=per_row.to(device))
    # Negative scales are not refused on the host (no sync): they poison their group.
    negative = torch.tensor([[-1e-3], [-0.0], [-math.nan], [-math.inf], [-(2.0**-130)], [5e-3]])
    check_quantize(w1, "row", global_scale=negative.to(device))
    got = kernels.quantize(w1, scaling="row", global_scale=negative.to(device))
    assert (got.global_scale[[0, 2, 3, 4]].view(torch.int32) == 0x7FC00000).all()
    assert (got.block_scale[[0, 2, 3, 4]].view(torch.uint8) == 0x7F).all()
    assert (got.codes[:5] == 0).all() and got.global_scale[1].view(torch.int32).item() == 0
    check_quantize(x, 2, global_scale=torch.tensor([[[0.02]], [[0.0]]], device=device))
    check_quantize(x, "row", global_scale=torch.tensor(0.01, device=device).view(1, 1, 1))


def test_empty_rows_quantize_to_empty_tensors(device):
    x = torch.empty(0, 32, dtype=torch.bfloat16, device=device)
    check_quantize(x, "row")
    with pytest.raises(ValueError, match="empty groups"):
        kernels.quantize(torch.empty(2, 0, 32, device=device), scaling=2)


@pytest.mark.parametrize("config", sorted(launch.CONFIGS))
def test_every_tile_config_matches_reference(device, config):
    x = randn((5, 3 * 1024 + 32), torch.bfloat16, device, seed=11)
    want = R.quantize(x.cpu(), scaling="row")
    got = nearest.launch(
        x, scaling="row", global_scale=None, fake=False, config=launch.CONFIGS[config]
    )
    assert_nvfp4_equal(cpu(got), want, config)
    for scaling in ("tensor", "row"):  # per-row: one chunk ("row") or a chunked walk
        fake = nearest.launch(
            x, scaling=scaling, global_scale=None, fake=True, config=launch.CONFIGS[config]
        )
        want_fake = R.dequantize(R.quantize(x.cpu(), scaling=scaling), x.dtype)
        assert_bitwise(fake, want_fake, config)


def test_bad_inputs_name_the_offending_value(device, monkeypatch):
    with pytest.raises(ValueError, match=r"multiple of 16; got shape \(4, 40\)"):
        kernels.quantize(torch.randn(4, 40, device=device))
    with pytest.raises(TypeError, match="torch.int32"):
        kernels.quantize(torch.ones(4, 32, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match=r"contiguous; got shape \(4, 32\) strides \(1, 4\)"):
        kernels.fake_quantize(torch.randn(32, 4, device=device).t())
    with pytest.raises(ValueError, match="scaling must be"):
        kernels.quantize(torch.randn(4, 32, device=device), scaling="col")
    with pytest.raises(TypeError, match="global_scale must be float32"):
        kernels.quantize(
            torch.randn(4, 32, device=device), global_scale=torch.ones(1, 1, device=device).double()
        )
    with pytest.raises(ValueError, match="does not broadcast"):
        kernels.quantize(
            torch.randn(4, 32, device=device),
            scaling="row",
            global_scale=torch.ones(3, 1, device=device),
        )
    if device == "cuda":
        with pytest.raises(ValueError, match="global_scale must be on cuda"):
            kernels.quantize(torch.randn(4, 32, device=device), global_scale=torch.ones(1, 1))
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    with pytest.raises(ValueError, match="CUDA tensor.*got device cpu"):
        kernels.quantize(torch.randn(4, 32))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "scaling"),
    [
        ((4096, 7168), "row"),
        ((8, 512, 7168), 2),  # experts of 7 MiB
        ((2048, 4096), "tensor"),
        ((4096, 7168), "tensor"),  # 56 MiB, larger than L2: amax launch, then quantize
        ((1000, 2064), "row"),
    ],
)
def test_large_shapes_on_gpu(shape, scaling):
    check_quantize(randn(shape, torch.bfloat16, "cuda", seed=5), scaling)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_quantize_into_pair_at_model_shapes_on_gpu(tokens):
    """Qwen3-30B-A3B's KV rows (4 kv heads, head dim 128) into 16-token pages."""
    k = randn((tokens, 4, 128), torch.bfloat16, "cuda", seed=tokens)
    v = randn((tokens, 4, 128), torch.bfloat16, "cuda", seed=tokens + 1)
    slots = torch.randperm(64 * 16, generator=torch.Generator().manual_seed(tokens))[:tokens]
    pages = [random_pages(64, 16, 4, 128, "cuda", s, torch.bfloat16) for s in (1, 2)]
    check_pair_into(k, v, slots.cuda(), *pages, f"bf16 {tuple(k.shape)}")
