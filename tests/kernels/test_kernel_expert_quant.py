"""Per-expert (per-group) quantize in one launch (`kernels/expert_quant.py`) against the
reference, bit for bit: codes, block scales, global scales, and the fused fake-quant values.

Under the interpreter the persistent grid's first program does every work item in ticket order;
the ticket order itself is checked here, and on the GPU the same inputs at the model's shapes,
with programs that must wait for each other's amax items (lag 0).
"""

import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from kernel_checks import (  # noqa: E402
    DTYPES,
    assert_nvfp4_equal,
    assert_same_values,
    cpu,
    e4m3_edge_rows,
    poisoned_rows,
    tie_rows,
)

from fp4rl import kernels  # noqa: E402
from fp4rl.fp4 import reference as R  # noqa: E402
from fp4rl.fp4.tensor import NVFP4Tensor  # noqa: E402
from fp4rl.kernels import expert_quant, nearest  # noqa: E402
from fp4rl.kernels.launch import CONFIGS as TILE_CONFIGS  # noqa: E402
from fp4rl.kernels.launch import outputs  # noqa: E402

TINY = expert_quant.CONFIGS["tiny"]
TWO_LAUNCHES = TILE_CONFIGS["default"]  # a tile config: the amax launch, then quantize


CONFIGS = {
    "default": expert_quant.CONFIGS["default"],
    "tiny": TINY,
    "tiny, lag 0": replace(TINY, lag=0),  # quant(g) dealt right after amax(g)
    "tiny, lag 5": replace(TINY, lag=5),  # more groups ahead than there are
}


def expert_quantize(x: torch.Tensor, group_ndim: int, config, fake: bool):
    """`expert_quant.launch` on x with its trailing ``group_ndim`` dims sharing a scale."""
    k = x.shape[-1]
    x_RK = x.reshape(-1, k)
    rows_per_group = math.prod(x.shape[x.dim() - group_ndim : -1])
    scale_shape = R.global_scale_shape(x.shape, group_ndim)
    s = torch.full(scale_shape, -1.0, device=x.device)  # poisoned: every entry must be written
    out_RK, codes, words, block_scale = outputs(x, fake)
    if fake:
        out_RK.fill_(-7.0)
    else:
        codes.fill_(0xEE)
        block_scale.fill_(0xEE)
    expert_quant.launch(
        x_RK, rows_per_group, s, out_RK, words, block_scale, fake=fake, config=config
    )
    if fake:
        return out_RK.view(x.shape)
    return NVFP4Tensor(
        codes=codes, block_scale=block_scale.view(torch.float8_e4m3fn), global_scale=s
    )


def check(x: torch.Tensor, group_ndim: int, config=None, what: str = "") -> None:
    want = R.quantize(x.cpu(), scaling=group_ndim)
    got = expert_quantize(x, group_ndim, config, fake=False)
    assert_nvfp4_equal(cpu(got), want, f"{what} {x.dtype} {tuple(x.shape)}")
    fake = expert_quantize(x, group_ndim, config, fake=True)
    assert_same_values(fake, R.dequantize(want, x.dtype), f"{what} fake-quant")


def randn(shape, dtype, device, seed: int) -> torch.Tensor:
    """Random values over several binades, drawn on ``device`` (the model's shapes are large)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=device)
    return (x * torch.exp2(6 * torch.rand(shape, generator=g, device=device))).to(dtype)


# ---- the ticket order ------------------------------------------------------------------------


@triton.jit
def _work_kernel(out_T3, num_tickets, num_groups, items_per_group, lag):
    for t in range(0, num_tickets):
        second, group, item = expert_quant._work_of(t, num_groups, items_per_group, lag)
        tl.store(out_T3 + 3 * t, second.to(tl.int32))
        tl.store(out_T3 + 3 * t + 1, group)
        tl.store(out_T3 + 3 * t + 2, item)


@pytest.mark.parametrize(
    ("num_groups", "items", "lag"), [(1, 1, 1), (3, 2, 0), (5, 3, 2), (4, 2, 9)]
)
def test_tickets_deal_every_item_once_and_each_amax_before_its_quantize(
    device, num_groups, items, lag
):
    num_tickets = 2 * num_groups * items
    out = torch.full((num_tickets, 3), -1, dtype=torch.int32, device=device)
    _work_kernel[(1,)](out, num_tickets, num_groups, items, lag)
    work = [tuple(row) for row in out.cpu().tolist()]
    assert sorted(work) == [
        (p, g, i) for p in (0, 1) for g in range(num_groups) for i in range(items)
    ]
    at = {w: t for t, w in enumerate(work)}
    lead = min(lag, num_groups)
    for g in range(num_groups):
        last_amax = max(at[0, g, i] for i in range(items))
        first_quant = min(at[1, g, i] for i in range(items))
        assert last_amax < first_quant
        # amax(g + lag) is dealt before quant(g): lag groups of amax items ahead.
        if g + lead < num_groups:
            assert max(at[0, g + lead, i] for i in range(items)) < first_quant


# ---- bits against the reference -------------------------------------------------------------


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize(
    ("shape", "group_ndim"),
    [((3, 5, 32), 2), ((2, 17, 48), 2), ((2, 3, 4, 16), 3), ((17, 96), 2), ((1, 6, 784), 2)],
)
def test_random_inputs_match_reference(device, config, shape, group_ndim):
    check(randn(shape, torch.bfloat16, device, seed=shape[-1]), group_ndim, CONFIGS[config], config)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_through_quantize_and_fake_quantize(device, dtype, monkeypatch):
    """The public entry points send per-expert groups here (`nearest.launch` routes them)."""
    monkeypatch.setattr(expert_quant, "MAX_GROUP_BYTES", 16 << 20)
    x = randn((3, 9, 64), dtype, device, seed=4)
    want = R.quantize(x.cpu(), scaling=2)
    assert_nvfp4_equal(cpu(kernels.quantize(x, scaling=2)), want, f"quantize {dtype}")
    fake = kernels.fake_quantize(x, scaling=2)
    assert_same_values(fake, R.dequantize(want, dtype), f"fake_quantize {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_e4m3_edges_poison_and_zeros_per_expert(device, dtype):
    qs = (-4,) if dtype == torch.float16 else (-4, -117)  # -117: MIN_GLOBAL_SCALE exactly
    for q in qs:
        rows, _ = tie_rows(q, dtype)  # 18 rows: 3 experts of 6
        check(rows.view(3, 6, -1).to(device), 2, TINY, f"ties q={q}")
        edges = e4m3_edge_rows(q, dtype)  # 3 rows: 3 experts of 1, then 1 expert of 3
        check(edges.view(3, 1, -1).to(device), 2, None, f"e4m3 edges q={q}")
        check(edges.view(1, 3, -1).to(device), 2, None, f"e4m3 edges q={q}")
    x = torch.cat([poisoned_rows(48, dtype, torch.Generator().manual_seed(9))] * 2)  # 10 rows
    x[8:] = 0.0  # the last expert all zeros, -0 in one place
    x[9, 3] = -0.0
    check(x.view(5, 2, 48).to(device), 2, TINY, "poisoned and zero experts")
    got = kernels.quantize(x.view(5, 2, 48).to(device), scaling=2)
    assert (got.global_scale[:2].view(torch.int32) == 0x7FC00000).all()
    assert (got.global_scale[4] == 0).all() and (got.codes[4] == 0).all()


def test_nearest_routes_expert_sized_groups_here_and_larger_ones_to_two_launches(
    device, monkeypatch
):
    monkeypatch.setattr(expert_quant, "MAX_GROUP_BYTES", 16 << 20)  # the size it is meant for
    calls = []
    real = expert_quant.launch
    monkeypatch.setattr(expert_quant, "launch", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    x = randn((4, 6, 32), torch.bfloat16, device, seed=2)
    for scaling, rows in ((2, 6), ("tensor", 24)):
        want = R.quantize(x.cpu(), scaling=scaling)
        assert_nvfp4_equal(cpu(kernels.quantize(x, scaling=scaling)), want, str(scaling))
        assert calls[-1] == rows
    kernels.quantize(x, scaling="row")  # per-row: one pass already
    assert len(calls) == 2
    monkeypatch.setattr(expert_quant, "MAX_GROUP_BYTES", 6 * 32 * 2 - 1)  # one expert too big
    want = R.quantize(x.cpu(), scaling=2)
    assert_nvfp4_equal(cpu(kernels.quantize(x, scaling=2)), want, "two launches")
    assert_same_values(kernels.fake_quantize(x, scaling=2), R.dequantize(want, x.dtype), "fake")
    assert len(calls) == 2


def test_block_k_pads_rows_by_at_most_an_eighth():
    assert [expert_quant.block_k_for(k) for k in (2048, 768, 7168, 2064, 16, 48)] == [
        1024, 256, 1024, 256, 16, 16
    ]  # fmt: skip
    for k in range(16, 4096, 16):
        block_k = expert_quant.block_k_for(k)
        assert -(-k // block_k) * block_k * 8 <= 9 * k


# ---- the model's shapes on the GPU ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(128, 1536, 2048), (128, 2048, 768)], ids=["w13", "w2"])
def test_model_shapes_on_gpu(shape):
    """Every expert against the two-launch path (itself checked against the reference), and a
    few experts, the poisoned, zero and flushed ones among them, against the reference on CPU
    (experts are independent groups, so a slice of the result is the result of a slice)."""
    x = randn(shape, torch.bfloat16, "cuda", seed=6)
    x[3, 100, 7] = math.nan  # a poisoned expert
    x[5, 2000 % shape[1], 1] = -math.inf
    x[7] = 0.0  # an all-zero expert
    x[9] *= 2.0**-120  # an expert whose scale flushes to zero
    picked = [0, 3, 5, 7, 9, 64, shape[0] - 1]
    want = R.quantize(x[picked].cpu(), scaling=2)
    two = nearest.launch(x, scaling=2, global_scale=None, fake=False, config=TWO_LAUNCHES)
    assert_nvfp4_equal(cpu(two.map(lambda t: t[picked])), want, "two launches")
    # lag 0: programs dealt quant(g) right after amax(g) wait for other programs' amax items.
    lag0 = replace(expert_quant.CONFIGS["default"], lag=0, programs_per_sm=8)
    for name, config in (("default", None), ("lag 0", lag0)):
        got = expert_quantize(x, 2, config, fake=False)
        for member, a, b in zip(("codes", "block_scale", "global_scale"), got.tensors(),
                                two.tensors(), strict=True):  # fmt: skip
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} {member}"
        assert_nvfp4_equal(cpu(got.map(lambda t: t[picked])), want, name)
        fake = expert_quantize(x, 2, config, fake=True)
        assert_same_values(fake[picked], R.dequantize(want, x.dtype), f"{name} fake-quant")


@pytest.mark.gpu
@pytest.mark.parametrize("max_group_bytes", [0, 16 << 20], ids=["two launches", "one launch"])
def test_quantize_captured_in_a_cuda_graph_without_host_sync(monkeypatch, max_group_bytes):
    """Per-expert quantize and quantize with a caller-given scale (a negative one included)
    run without a host synchronization, so both replay from a CUDA graph."""
    monkeypatch.setattr(expert_quant, "MAX_GROUP_BYTES", max_group_bytes)
    x = randn((16, 256, 512), torch.bfloat16, "cuda", seed=7)
    given = torch.rand(16, 1, 1, device="cuda") * 1e-3
    given[3] = -1.0  # poisons expert 3, on the device
    kernels.quantize(x, scaling=2), kernels.quantize(x, scaling=2, global_scale=given)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            per_expert = kernels.quantize(x, scaling=2)
            with_given = kernels.quantize(x, scaling=2, global_scale=given)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x.copy_(randn(x.shape, torch.bfloat16, "cuda", seed=8))
    graph.replay()
    torch.cuda.synchronize()
    assert_nvfp4_equal(cpu(per_expert), R.quantize(x.cpu(), scaling=2), "graph, per-expert")
    want = R.quantize(x.cpu(), scaling=2, global_scale=given.cpu())
    assert_nvfp4_equal(cpu(with_given), want, "graph, given scale")
    assert with_given.global_scale[3].isnan().all() and (with_given.codes[3] == 0).all()
