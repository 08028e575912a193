"""The arithmetic behind the register kernels' byte tables (`fragments.byte_tables`), on the CPU.

The kernels are Gluon and run only on a GPU, where their tests read every code and scale byte
back bitwise. What those tests sample, this file sweeps: the table of a block holds four of the
contract's products (magnitudes 0, 0.5, 1, 1.5) and gets the other four (2, 3, 4, 6) by doubling
1 and 1.5 in BF16. That is the contract's bits only if doubling commutes with both roundings,
which holds while the values stay normal: from the recipe's smallest global scale up
(`MIN_GLOBAL_SCALE`; the recipe writes 0 below it), for every block-scale byte.
"""

import torch

from fp4rl.fp4 import reference as R
from fp4rl.fp4.format import MIN_GLOBAL_SCALE
from fp4rl.fp4.tensor import NVFP4Tensor

GLOBAL_SCALE_BIAS = 2.0**8  # `packed_words.GLOBAL_SCALE_BIAS`, as the kernels pass the global scale
LARGEST_FROM_FINITE_INPUT = torch.finfo(torch.float32).max / 2688


def tables_as_built(sf: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``[n, 8]`` BF16 entries for magnitude indices 0..7, computed as `fragments.byte_tables`
    does: FP32 products with the biased global scale, one BF16 rounding, and BF16 doublings."""
    s = s * GLOBAL_SCALE_BIAS
    half = (2.0**-9 * sf) * s
    one = ((2.0**-8 * sf) * s).to(torch.bfloat16)
    three_halves = ((1.5 * 2.0**-8 * sf) * s).to(torch.bfloat16)
    products = [(half * 0.0).to(torch.bfloat16), half.to(torch.bfloat16), one, three_halves]
    return torch.stack(products + [one * 2, three_halves * 2, one * 4, three_halves * 4], dim=1)


def reference_entries(sf_bytes: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``[n, 8]`` the recipe's dequantized values of codes 0..7 under each (block scale, global
    scale) pair: one 16-value block per pair, codes 0..7 twice."""
    n = sf_bytes.numel()
    codes = torch.arange(8, dtype=torch.uint8).repeat(2)  # 0..7, 0..7
    packed = R.pack_e2m1(codes).expand(n, 8).contiguous()
    t = NVFP4Tensor(packed, sf_bytes.view(torch.float8_e4m3fn).view(n, 1), s.view(n, 1))
    return R.dequantize(t, torch.bfloat16)[:, :8]


def mismatches(sf_bytes: torch.Tensor, s: torch.Tensor) -> int:
    want = reference_entries(sf_bytes, s)
    got = tables_as_built(sf_bytes.view(torch.float8_e4m3fn).float(), s)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    return int((~same).sum())


def every_byte_under(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block-scale byte (NaN ones included) under each global scale."""
    sf_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(scales.numel())
    return sf_bytes, scales.repeat_interleave(256)


def test_tables_are_the_contracts_bits_for_every_scale_the_recipe_writes():
    g = torch.Generator().manual_seed(0)
    lo, hi = torch.tensor(MIN_GLOBAL_SCALE).log2(), torch.tensor(LARGEST_FROM_FINITE_INPUT).log2()
    sampled = torch.exp2(lo + (hi - lo) * torch.rand(4000, generator=g, dtype=torch.float64))
    just_above = MIN_GLOBAL_SCALE * (1 + torch.rand(1000, generator=g, dtype=torch.float64))
    edges = torch.tensor(
        [0.0, MIN_GLOBAL_SCALE, 2.0**-116, 1.7e-3, 1.0, LARGEST_FROM_FINITE_INPUT, 2.0**119,
         float("inf"), float("nan")],
        dtype=torch.float64,
    )  # fmt: skip
    scales = torch.cat([edges, sampled, just_above]).float()
    sf_bytes, s = every_byte_under(scales)
    assert mismatches(sf_bytes, s) == 0


def test_below_the_smallest_global_scale_the_doublings_would_not_be_exact():
    """Why the bound matters: products that land among FP32's subnormals round differently once
    doubled. The recipe never writes such a scale (it flushes them to 0)."""
    g = torch.Generator().manual_seed(1)
    below = MIN_GLOBAL_SCALE * (0.25 + 0.75 * torch.rand(1000, generator=g))
    assert mismatches(*every_byte_under(below)) > 0
