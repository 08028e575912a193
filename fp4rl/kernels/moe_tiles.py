"""The routed-expert GEMM's tiles (`moe_gemm.launch`): what one program computes (`GemmTile`)
and which tile a launch takes, by rows per expert on average, for each of the three programs
(`moe_gemm`'s Triton program over packed or BF16 weights, `moe_gemm_registers`' Gluon
program over packed weights, and on Hopper `moe_gemm_wgmma`'s, the same decode on the
warpgroup MMA). Every choice below was measured on one H200 at Qwen3-30B-A3B's
expert shapes (`python benchmarks/moe.py`, BENCHMARKS.md "Routed-expert GEMM" and the
sections after it); no tile changes a bit of the product, only the order of its FP32 sums.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GemmTile:
    """One program: ``block_m`` rows of one expert times ``block_n`` output columns, ``block_k``
    of the reduction per step (each a power of two >= 16; ``block_m`` may be 8 for the register
    kernel, whose MMA takes 8 rows), ``num_stages`` of loads in flight. ``split_k`` (register
    kernel only) of the ``num_warps`` share each column, each taking its own ``block_k`` of a
    step: a step then covers ``split_k * block_k`` of K, and the warps' sums are added at the
    end. ``clamp_rows`` (register kernel only): a tile's rows past the expert's last read that
    row again, unmasked, instead of masked loads with a zero fill; the extra rows' products land
    in accumulator columns that are never stored. No bit changes; the compiled loop does (fewer
    instructions, another register allocation), so it is set where it measured faster.
    ``wgmma`` (packed weights on Hopper): the tile runs on `moe_gemm_wgmma`'s warpgroup MMA, x's
    rows read by the tensor cores from shared memory, instead of the register kernel's
    ``mma.sync``. ``decoders`` (a wgmma tile): the program is warp-specialized
    (`moe_gemm_specialized`): that many warps decode each K step into a ring of ``num_stages``
    shared-memory buffers, and ``num_warps`` (one warpgroup) run the MMA from there."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    clamp_rows: bool = False
    wgmma: bool = False
    decoders: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v, least = getattr(self, name), 8 if name == "block_m" else 16
            if v < least or v & (v - 1):
                raise ValueError(f"GemmTile.{name} must be a power of two >= {least}; got {v}")
        if self.wgmma and (self.split_k > 1 or self.clamp_rows):
            raise ValueError(
                f"GemmTile.wgmma takes neither split_k nor clamp_rows; got split_k="
                f"{self.split_k}, clamp_rows={self.clamp_rows}"
            )
        if self.decoders and not self.wgmma:
            raise ValueError(f"GemmTile.decoders is for wgmma tiles; got {self.decoders}")
        if self.split_k < 1 or self.split_k & (self.split_k - 1) or self.num_warps % self.split_k:
            raise ValueError(
                f"GemmTile.split_k must be a power of two dividing num_warps={self.num_warps}; "
                f"got {self.split_k}"
            )

    def fitted(self, n: int, k: int) -> GemmTile:
        """This tile narrowed where N or K is not a multiple of it (N, K multiples of 16): its
        K step first, then its split."""
        block_n, block_k, split_k = self.block_n, self.block_k, self.split_k
        while n % block_n:
            block_n //= 2
        while k % (block_k * split_k):
            if block_k > 64:
                block_k //= 2
            elif split_k > 1:
                split_k //= 2
            else:
                block_k //= 2
        return dataclasses.replace(self, block_n=block_n, block_k=block_k, split_k=split_k)


# (most rows per expert on average, tile): the first bucket that holds A / E is used; the
# token counts below are for top-8 over 128 experts. Chosen on one H200 at Qwen3-30B-A3B's
# shapes (w13 [128, 1536, 2048], w2 [128, 2048, 768]) from the sweeps of benchmarks/moe.py
# recorded in BENCHMARKS.md.
CONFIGS: tuple[tuple[float, GemmTile], ...] = (
    # Up to 4 tokens: few experts, few programs; long K steps keep more bytes in flight each.
    (0.25, GemmTile(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3)),
    # Decode batches up to 128 tokens: one tile of 16 rows per expert; 80 registers let
    # several programs share an SM, and three stages (not four) let shared memory hold six.
    (8.0, GemmTile(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    # Up to 640 tokens: 32 rows, so that most experts are decoded once.
    (40.0, GemmTile(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4)),
    # Prefill chunks up to 2048 tokens: 128 rows per tile. At 2048 tokens it took 640.0 / 326.0
    # us (w13 / w2) against 695.7 / 354.4 for the 256-row tile; at 3072 the 256-row tile was
    # ahead, 717.3 / 360.7 against 861.0 / 436.8 (one H200, `python benchmarks/moe.py --tokens
    # 1024,1280,1536,2048,3072,4096`, BENCHMARKS.md "Routed-expert GEMM: prefill chunks").
    (128.0, GemmTile(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3)),
    # Long prefill: a weight tile's decode is shared by 256 rows.
    (float("inf"), GemmTile(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3)),
)


# BF16 weights (the BF16 engine's experts): nothing to decode, so the weight tile goes from
# shared memory to the tensor cores as loaded. From the sweep of `python benchmarks/moe.py`
# (--bf16-configs, one H200, BENCHMARKS.md "Routed-expert GEMM"): the NVFP4 buckets' tiles were
# the fastest or within 2 % from 8 tokens up, and at up to 4 tokens 64-wide K steps six deep
# (w13 15.6 against 16.1 us at one token, w2 9.9 against 12.1). These tiles are not narrowed
# (`config_for`): that rule was measured for the NVFP4 decode.
BF16_CONFIGS: tuple[tuple[float, GemmTile], ...] = (
    (0.25, GemmTile(block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=6)),
    *CONFIGS[1:],
)


# Batches of at most this many rows per expert on average (decode steps and prefill chunks up
# to 1,024 tokens at top-8 over 128 experts) take the register kernel (`moe_gemm_registers`) on
# packed weights, with `register_config_for`'s tile: 1.08-1.56x the BF16 kernel's speed from 1
# to 256 tokens, where `moe_gemm`'s Triton program is 0.84-1.07x (one H200, `python
# benchmarks/moe.py`, BENCHMARKS.md "Routed-expert GEMM: the register kernel"). Up to 512
# tokens (the NVFP4 engine's decode batches when its KV holds that many sequences) the wide tile
# beat the Triton program by 1.4x (w13 210.6 against 286.9 us, w2 112.0 against 160.1), and the
# 48-layer decode step of 512 x 1024 took 30.48 against 37.02 ms (`python benchmarks/decode.py
# --cases 512x1024`, BENCHMARKS.md "A whole rollout with the seats its KV holds"); at 768 and
# 1,024 tokens by 1.5x and 1.2x (w13 286.8 / 358.3 against 423.8 / 429.7, w2 150.3 / 189.7
# against 217.2 / 221.4); at 1,280 they tied (w13 426.9 against 435.7, w2 225.6 against 222.8)
# and from 1,536 the Triton program was ahead, also against a 64-row register tile (w13 440.8
# against 483.8 at 1,536) (`python benchmarks/moe.py --tokens 512,...,4096`, BENCHMARKS.md
# "Routed-expert GEMM: prefill chunks"). From 1,024 tokens both NVFP4 programs are slower than
# the BF16 kernel (0.67x and 0.56x for w13 there). On Hopper the bound does not apply: the
# warpgroup MMA's tiles (`WGMMA_TILES`) take every batch past 5.5 rows per expert.
REGISTERS_MAX_ROWS_PER_EXPERT = 64.0
# Up to 5.5 rows per expert on average (88 tokens at top-8 over 128 experts): 8 rows, 64
# columns, 256-wide K steps (w13 at 8 / 64 tokens 48.5 / 101.7 us against 50.2 / 110.2 for 16
# rows, w2 26.3 / 57.8 against 29.2 / 64.8). Below half a row (under 8 tokens) 16 rows were once
# faster (14.0 against 17.0 us for w13 at one token, 7.5 against 7.9 for w2); with the K loop
# unrolled at compile time the 8-row tile took w2 there too: 6.5 / 9.5 / 14.6 / 18.4 us at 1 /
# 2 / 4 / 6 tokens against 7.2 / 10.3 / 16.2 / 20.2 for 16 rows (one H200, `python
# benchmarks/moe.py --tokens 1,2,4,6,... --register-configs auto,8:64:256:4:2`, BENCHMARKS.md
# "Routed-expert GEMM: the K loop unrolled at compile time").
REGISTERS_SHORT_TILE = GemmTile(block_m=8, block_n=64, block_k=256, num_warps=4, num_stages=2)
# Below half a row per expert, a long reduction (at least 8 of REGISTERS_SHORT_TILE's K steps:
# w13's K = 2048, not w2's 768) is split between two warps per column: 8 rows, 32 columns, each
# warp its own 256 of a 512-wide step. A lone token's warps then each walk half as many steps:
# w13 at 1 / 4 tokens 11.8 / 29.3 us against 14.0 / 30.9 unsplit (16 rows), while w2's three
# steps gain nothing (8.1 against 7.7 us at one token) (one H200, `python benchmarks/moe.py`,
# BENCHMARKS.md "Routed-expert GEMM: K split across warps"); unrolled, 9.7 / 25.3 us against
# 12.3 / 26.2 for the 8-row tile unsplit.
REGISTERS_SPLIT_TILE = GemmTile(block_m=8, block_n=32, block_k=256, num_warps=4, num_stages=2,
                                split_k=2)  # fmt: skip
REGISTERS_SPLIT_MIN_STEPS = 8
# Above 5.5 rows per expert on average, up to 12 (89 to 192 tokens at top-8 over 128 experts):
# 16 rows and 128 columns of 4 warps. Around 8 rows many experts need two 8-row tiles, each
# decoding the expert's weights again: at 128 tokens w13 126.8 against 162.6 us for the 8-row
# tile and 136.1 for the wide one, w2 71.5 against 86.0 and 76.3; at 160 tokens 133.8 / 73.1
# against the wide tile's 136.3 / 77.0; at 96 and 192 tokens the two GEMMs together are within
# 1 % and 2 % of the tiles on either side (one H200, `python benchmarks/moe.py --tokens
# 48,64,96,128,160,192,256`, BENCHMARKS.md "Routed-expert GEMM: a 16-row tile for mid-sized
# batches"). Its rows are clamped (`GemmTile.clamp_rows`): under Triton 3.6 that compiles to 128
# registers instead of 136, four programs a multiprocessor instead of three, and at 128 tokens
# w13 took 117.3-118.1 against 125.1-127.0 us, w2 62.7-63.0 against 68.2-68.5 (one H200,
# `python benchmarks/moe.py --tokens 1,8,64,128,256`, the two trees alternately, twice;
# BENCHMARKS.md "Routed-expert GEMM: clamped rows"). The other tiles measured slower clamped.
# Clamped, it also beat the wide tile at 192 tokens (12 rows per expert): w13 133.8 against
# 138.7 us, w2 68.9 against 76.3; at 224 the two GEMMs together were 219.3 against 216.3 (one
# H200, `python benchmarks/moe.py --tokens 160,192,224,256 --register-configs
# auto,...,16:128:128:4:2:1:1`), so its range now reaches 12 rows. Below 6 rows it beat the
# 8-row tile at 96 tokens and about tied it at 88, the two GEMMs together 177.4 against
# 189.3-190.4 us at 96, 177.6-177.9 against 178.8-179.9 at 88, and 176.5-177.8 against
# 168.0-168.4 at 80 (one H200, `python benchmarks/moe.py --tokens 64,72,80,88,96,104,112,128`,
# twice; BENCHMARKS.md "Routed-expert GEMM: the 16-row tile from 89 tokens"), so its range
# starts above 5.5 rows.
REGISTERS_MEDIUM_TILE = GemmTile(
    block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=2, clamp_rows=True
)
REGISTERS_MEDIUM_ROWS = (5.5, 12.0)  # rows per expert on average: above the first, up to the second
# Past 12 rows per expert: 32 rows and 128 columns of 4 warps (each warp's 32 columns share its
# copy of the rows); at 256 tokens 171 against 280 us (w13) and 82 against 149 (w2).
REGISTERS_WIDE_TILE = GemmTile(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=2)

# On Hopper, past 5.5 rows per expert (from 89 tokens at top-8 over 128 experts): the warpgroup
# MMA's tiles (`moe_gemm_wgmma`), each K step's rows of x stored once into shared memory and the
# decoded weights the MMA's register operand. Up to 12 rows per expert 16 rows of 128 columns,
# against the register kernel's medium tile at 96 / 128 / 160 / 192 tokens: w13 113.3 / 114.3 /
# 114.3 / 124.0 us against 117.7 / 119.2 / 119.3 / 134.2, w2 61.6 / 62.1 / 62.8 / 66.5 against
# 61.9 / 62.4 / 63.9 / 68.5 (one H200, `python benchmarks/moe.py --tokens 8,64,96,...,192`;
# 8-row wgmma tiles lost or tied at 8 and 64 tokens, w2 at 64 56.3 against 53.9, so the short
# tiles stay). Past 12 rows, against the register kernel's wide tile, us a
# launch at 256 / 384 / 512 / 768 / 1,024 / 2,048 / 4,096 tokens: w13 134.0 / 142.5 / 171.8 /
# 177.1 / 251.0 / 410.2 / 672.7 against 140.8 / 154.0 / 212.4 / 288.1 / 364.4 / 645.0 /
# 1,225.2 (and `moe_gemm`'s program, which the launcher took from 1,280 tokens, 432.0 / 639.4 /
# 1,031.8 at 1,024 / 2,048 / 4,096), w2 71.8 / 76.5 / 94.5 / 99.4 / 136.5 / 226.5 / 392.6
# against 77.7 / 85.0 / 112.0 / 153.1 / 189.3 / 339.6 / 644.9 (program 221.5 / 324.5 / 522.4)
# (one H200, `python benchmarks/moe.py --tokens 256,...,4096 --register-configs ...`,
# BENCHMARKS.md "Routed-expert GEMM: the warpgroup MMA"). 32 rows of 128 columns up to 24 rows
# per expert (384 tokens; 64 rows took 166.0 there, 171.8 against 189.1 at 512), 64 rows up to
# 128 (2,048 tokens; the 128-row tile 265.5 against 251.0 at 1,024, 408.8 against 410.2 at
# 2,048), then 128 rows of 256 columns on two warpgroups (672.7 against 759.5 at 4,096).
WGMMA_TILES: tuple[tuple[float, GemmTile], ...] = (
    (12.0, GemmTile(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=2, wgmma=True)),
    (24.0, GemmTile(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=2, wgmma=True)),
    (128.0, GemmTile(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=2, wgmma=True)),
    (float("inf"), GemmTile(128, 256, 64, num_warps=8, num_stages=2, wgmma=True)),
)

# A launch whose grid would give the SMs fewer programs than this each (one token's w13: 24
# column tiles x 8 experts = 192 programs for 132 SMs) halves its tile's width, so that more SMs
# stream weights: 18.7 against 20.1 µs there, while w2's 256 programs lose by narrowing (14.8
# against 10.5 µs), BENCHMARKS.md "Routed-expert GEMM".
MIN_PROGRAMS_PER_SM = 1.5


def config_for(
    num_rows: int, num_experts: int, n: int | None = None, sms: int = 0, *, bf16: bool = False
) -> GemmTile:
    """The bucket's tile (`BF16_CONFIGS` for BF16 weights) for ``num_rows`` rows over
    ``num_experts`` experts; for NVFP4 weights, given the output width ``n`` and the device's
    ``sms``, narrowed (down to 32 columns) while its grid would have fewer than
    `MIN_PROGRAMS_PER_SM` programs per SM."""
    rows_per_expert = num_rows / max(num_experts, 1)
    buckets = BF16_CONFIGS if bf16 else CONFIGS
    tile = next(tile for bound, tile in buckets if rows_per_expert <= bound)
    if n is not None and not bf16:
        # The programs of `moe_gemm.launch`'s grid.
        row_tiles = num_rows // tile.block_m + min(num_experts, num_rows)
        while (
            tile.block_n > 32
            and (n // tile.block_n) * row_tiles < MIN_PROGRAMS_PER_SM * sms
            and n % (tile.block_n // 2) == 0
        ):
            tile = dataclasses.replace(tile, block_n=tile.block_n // 2)
    return tile


def register_config_for(
    num_rows: int, num_experts: int, k: int = 0, *, wgmma: bool = False
) -> GemmTile:
    """The register kernel's tile by rows per expert on average: `REGISTERS_SHORT_TILE` up to
    5.5 rows (`REGISTERS_SPLIT_TILE` below half a row where the reduction ``k`` has at least
    `REGISTERS_SPLIT_MIN_STEPS` of its steps), `REGISTERS_MEDIUM_TILE` up to 12
    (`REGISTERS_MEDIUM_ROWS`), `REGISTERS_WIDE_TILE` above (narrowed to the weight's shape by
    `moe_gemm.launch`, its warps cut to one per 16 columns); on a GPU with the warpgroup MMA
    (``wgmma``) `WGMMA_TILES`' from 5.5 rows."""
    experts = max(num_experts, 1)
    low, high = REGISTERS_MEDIUM_ROWS
    if wgmma and num_rows > low * experts:
        return next(t for bound, t in WGMMA_TILES if num_rows <= bound * experts)
    if num_rows > high * experts:
        return REGISTERS_WIDE_TILE
    if num_rows > low * experts:
        return REGISTERS_MEDIUM_TILE
    if num_rows < 0.5 * experts and k >= REGISTERS_SPLIT_MIN_STEPS * REGISTERS_SHORT_TILE.block_k:
        return REGISTERS_SPLIT_TILE
    return REGISTERS_SHORT_TILE
