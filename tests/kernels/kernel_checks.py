"""Adversarial inputs for the kernel tests, and the suite's comparisons (`tests/assertions.py`)
under the names the kernel tests import.

The reference always runs on CPU copies: its CPU result is the specification (CUDA PyTorch may
differ in NaN bit patterns).
"""

import torch
from assertions import (
    assert_bitwise,
    assert_nvfp4_equal,
    assert_record_equal,
    assert_same_values,
    cpu,
)

__all__ = [
    "DTYPES",
    "assert_attention_within",
    "assert_bitwise",
    "assert_nvfp4_equal",
    "assert_record_equal",
    "assert_same_values",
    "cpu",
    "dealt_tables",
    "random_paged_cache",
]

DTYPES = (torch.bfloat16, torch.float32, torch.float16)


# ---- adversarial inputs ----------------------------------------------------------------------

E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def tie_rows(q: int, dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """Rows whose scaled values land exactly on every E2M1 tie, and just beside each.

    Every row holds ``A = 2688 * 2**q`` (so its and the tensor's global scale is exactly
    ``2**q``), then per exponent p a block of amax ``6 * 2**(p + q)``: its ratio is exactly
    ``2**p``, its block scale ``2**p`` and its reciprocal a power of two, so ``x * recip`` is
    exact. Block 1 holds the ties ±t, block 2 values one bf16 ulp above and below them.
    Returns the rows and the exponent p of each.
    """
    ps = list(range(-9, 9))
    rows = []
    for p in ps:
        unit = 2.0 ** (p + q)
        anchor = [2688.0 * 2.0**q] + [2688.0 * 2.0**q / (i + 2) for i in range(15)]
        ties = [6.0, -0.0] + [t for v in E2M1_TIES for t in (v, -v)]
        beside = [6.0, 0.0] + [v * (1 + d) for v in E2M1_TIES for d in (2.0**-7, -(2.0**-7))]
        rows.append(anchor + [v * unit for v in ties] + [v * unit for v in beside])
    return torch.tensor(rows, dtype=torch.float64).to(dtype), ps


# Block-amax / (6 s) ratios at E4M3 rounding ties and edges: the 2**-10 tie (to 0), subnormal
# ties (1.5, 2.5, 7.5 units of 2**-9), the subnormal/normal seam 2**-6, normal ties, 448 and
# past it (clamped), and numbers far below the smallest subnormal.
E4M3_EDGE_RATIOS = (
    2.0**-10,
    3 * 2.0**-10,
    5 * 2.0**-10,
    15 * 2.0**-10,
    2.0**-6,
    1.0625 * 2.0**-6,
    1.0625,
    1.1875,
    432.0,
    448.0,
    464.0,
    480.0,
    1e4,
    2.0**-11,
    2.0**-20,
)


def e4m3_edge_rows(q: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows with global scale exactly ``2**q`` whose blocks hit `E4M3_EDGE_RATIOS` exactly, and
    nearly (times 1 ± 2**-6): block 0 carries the row amax ``2688 * 2**q``."""
    amax = 2688.0 * 2.0**q
    rows = []
    for scale in (1.0, 1 + 2.0**-6, 1 - 2.0**-6):
        blocks = [[amax] + [amax * 0.5**i for i in range(1, 16)]]
        for r in E4M3_EDGE_RATIOS:
            b = min(6.0 * 2.0**q * r * scale, amax)
            blocks.append([b] + [-b * (i / 16) for i in range(1, 16)])
        rows.append([v for block in blocks for v in block])
    return torch.tensor(rows, dtype=torch.float64).to(dtype)


def poisoned_rows(k: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Rows with NaN, -NaN, +inf or -inf in one place each, among finite random values."""
    x = torch.randn(5, k, generator=generator).to(dtype)
    specials = (float("nan"), -float("nan"), float("inf"), -float("inf"))
    for row, value in enumerate(specials):
        x[row, (7 * row + 3) % k] = value
    return x  # the last row stays finite


def near_boundary_rows(num_rows: int, generator: torch.Generator) -> torch.Tensor:
    """FP32 rows whose scaled values sit on and one ulp beside E2M1 boundaries under scales
    that are not powers of two: a reciprocal or product one ulp off flips their codes.

    Each block keeps its largest value (so its scales do not move) and fills the other 15
    with ``b / recip`` and its two FP32 neighbours for five of the seven boundaries b.
    """
    from fp4rl.fp4 import reference as R  # the construction asks the spec for the reciprocals

    base = torch.randn(num_rows, 8, 16, generator=generator)
    base = base * torch.exp2(torch.randint(-8, 8, (num_rows, 8, 1), generator=generator))
    base[..., 0] = base.abs().amax(-1) * 1.02  # a clear amax in slot 0
    want = R.quantize(base.flatten(1), scaling="row")
    recip = 1.0 / (want.block_scale.float() * want.global_scale)  # [R, 8]
    boundaries = torch.tensor(E2M1_TIES)
    for j in range(8):
        chosen = boundaries[torch.arange(j, j + 5) % 7]  # 5 of the 7, rotating per block
        exact = chosen[None, :] / recip[:, j : j + 1]  # [R, 5]
        trio = torch.stack(
            [exact, exact.nextafter(torch.full_like(exact, 0)), exact.nextafter(exact * 2)], -1
        )
        signs = torch.where(torch.rand(num_rows, 15, generator=generator) < 0.5, -1.0, 1.0)
        base[:, j, 1:] = trio.flatten(1) * signs
    x = base.flatten(1)
    moved = R.quantize(x, scaling="row")
    assert torch.equal(moved.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
    assert torch.equal(moved.global_scale, want.global_scale)
    return x


# ---- paged KV for the attention kernels -----------------------------------------------------


def random_paged_cache(fmt, page_dtype, num_blocks, page, heads, dim, *, seed, device, scale=1.0):
    """One layer's `KVCache` ("bf16" or "nvfp4" pages) whose every slot, the ones no context
    covers included, holds finite random K/V; drawn where they live (the GPU cases fill hundreds
    of MB), NVFP4 rows quantized per token-head."""
    from fp4rl.rollout.kv_cache import KVCache, KVCacheSpec

    spec = KVCacheSpec(layer_formats=(fmt,), num_kv_heads=heads, head_dim=dim, dtype=page_dtype)
    cache = KVCache(spec, num_blocks, page, device)
    g = torch.Generator(device=device).manual_seed(seed)
    k, v = (
        (torch.randn(num_blocks * page, heads, dim, generator=g, device=device) * scale).to(
            page_dtype
        )
        for _ in range(2)
    )
    cache.write(0, torch.arange(num_blocks * page, device=device), k, v)
    return cache


def dealt_tables(blocks_per_seq: list[int], order: list[int]) -> list[list[int]]:
    """Block tables dealt round-robin from ``order``: interleaved and out of order."""
    tables = [[] for _ in blocks_per_seq]
    dealt = 0
    for round_ in range(max(blocks_per_seq)):
        for i, n in enumerate(blocks_per_seq):
            if round_ < n:
                tables[i].append(order[dealt])
                dealt += 1
    return tables


def assert_attention_within(got, o64, mag, what: str):
    """Attention outputs ``got`` within the attention kernels' bound of float64 attention
    ``o64`` over the same K/V values: ``2**-16 * mag`` (``mag = sum_c p_c |v_c|``: FP32 sums in
    another order, the GPU's exp), plus ``2**-8 * |o64|`` for BF16 outputs (one rounding)."""
    bound = 2.0**-16 * mag
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * o64.abs()
    err = (got.double().to(o64.device) - o64).abs()
    bad = ~(err <= bound)  # NaN fails
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} outputs outside the bound; worst excess "
        f"{float((err - bound).max()):.3g}, worst |err| / mag {float((err / mag).max()):.3g}"
    )
