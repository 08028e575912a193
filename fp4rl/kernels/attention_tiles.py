"""Decode attention's tiles (`paged_attention.launch`): what one program walks (`DecodeTile`),
which tile and how many context stretches a launch takes, by page format (`page_format`: BF16
or NVFP4 pages for the Triton program, or the register kernel) and by sequence-heads. Every
choice below was measured on one H200 at Qwen3-30B-A3B's attention shape (32 query / 4 KV heads
of 128; `python benchmarks/attention.py`, BENCHMARKS.md "Decode attention" and the sections
after it); no tile or split changes a value, only the order of the FP32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from fp4rl.kernels.launch import multiprocessors, register_kernels_refusal


@dataclass(frozen=True, slots=True)
class DecodeTile:
    """One program's step: ``block_n`` context tokens (a power of two >= 16), ``num_stages``
    steps of loads in flight. Contexts are split into stretches when the grid would otherwise
    be too small for the GPU: up to ``programs_per_sm`` programs a multiprocessor, as many
    stretches as cut the block table into stretches of at least ``min_split_tokens`` (see
    `stretches_for`); each sequence's own context is then cut into that many."""

    block_n: int
    num_warps: int
    num_stages: int
    min_split_tokens: int = 128
    programs_per_sm: int = 8
    keys_first: bool = False  # tokens as the dots' rows (`paged_attention._paged_decode_kernel`)
    # NVFP4 pages decoded into the MMA's registers (`paged_attention_registers`; one warp, the
    # next step's pages in flight: num_warps 1, num_stages 2)
    registers: bool = False

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"DecodeTile.block_n must be a power of two >= 16; got {self.block_n}")
        if self.registers and (self.num_warps, self.num_stages, self.keys_first) != (1, 2, False):
            raise ValueError(
                f"a registers DecodeTile runs one warp with the next step in flight (num_warps=1,"
                f" num_stages=2, keys_first=False); got {self.num_warps}, {self.num_stages}, "
                f"{self.keys_first}"
            )


# (fewest programs, tile) per page format: the last entry whose bound the launch's programs
# (sequences x KV heads, before context splits) reach. For the Qwen3-30B-A3B attention shape
# (32 / 4 heads of 128) on one H200, from the tile sweep recorded in BENCHMARKS.md ("Decode
# attention: what bounds the NVFP4 pages"): 64-token steps of 2 warps, 3 loads in flight,
# were the fastest or within 5 % from batch 16 up (NVFP4 pages at batch 64, 4k: 212 us
# against 214 for 64:4:2; batch 256, 2k: 395 against 403; BF16 pages 143 against 158 and 261
# against 316), and the slowest at batch 1 (1k: NVFP4 14.9 us, BF16 9.7), where 128-token
# steps of more warps win (NVFP4 128:8:2 8.6 us, BF16 128:4:3 7.4). The keys-first sweep
# ("Decode attention: the K tile from registers"): for NVFP4 pages from batch 16 up, 64-token
# steps of 4 warps, 2 loads in flight, keys first (batch 64, 4k: 196 us against 209 for
# 64:2:3; batch 256, 2k: 367 against 392); BF16 pages stay rows first (keys first 159 against
# 141 us).
# The register kernel (`paged_attention_registers`, "registers": NVFP4 pages under BF16 queries
# at head dim 128 on sm_89 and newer; "nvfp4" is the Triton program for the other launches):
# 16-token steps ("Decode attention: K and V decoded into registers (the register kernel)" in
# BENCHMARKS.md): batch 64, 4k: 121.7 us against 199.6 for the "nvfp4" tile and 157.6 for BF16
# pages; batch 256, 2k: 225.2 against 380.9 and 287.6. 32-token steps spill and lose.
REGISTERS_TILE = DecodeTile(block_n=16, num_warps=1, num_stages=2, registers=True)
CONFIGS = {
    "bf16": (
        (0, DecodeTile(block_n=128, num_warps=4, num_stages=3)),
        (64, DecodeTile(block_n=64, num_warps=2, num_stages=3, programs_per_sm=4)),
    ),
    "nvfp4": (
        (0, DecodeTile(block_n=128, num_warps=8, num_stages=2)),
        (64, DecodeTile(block_n=64, num_warps=4, num_stages=2, keys_first=True)),
    ),
    "registers": ((0, REGISTERS_TILE),),
}


def config_for(fmt: str, programs: int) -> DecodeTile:
    """The tile of `CONFIGS` for ``fmt`` ('bf16' or 'nvfp4' pages) and a launch of ``programs``
    (sequences x KV heads)."""
    return [tile for bound, tile in CONFIGS[fmt] if programs >= bound][-1]


# Launches of at most SMALL_LAUNCH sequence-heads (a few sequences) cut the context into about
# one stretch per multiprocessor, each one step of a tile as long as the stretch (32 to 128
# tokens, `SMALL_TILES`): the programs then cover the GPU once, with the shortest serial
# chains. On one H200 at batch 1 (4 KV heads of 128; "Decode attention at a few sequences" in
# BENCHMARKS.md): NVFP4 pages 7.2 us at 1k (32 stretches of 32 tokens) against 8.7 for the
# `CONFIGS` tile's 8 stretches of 128, 8.1 against 9.0 at 2k, the same 9.8 at 4k (32 of 128
# either way); BF16 pages 7.0 against 7.5, 8.2 against 8.1, 9.7 both. A block table wider than
# the contexts (the engine's graphs use the longest a sequence may grow to) takes the tile of
# 128-token steps, and each context is still cut into the planned stretches
# (`paged_attention.stretch_of`).
SMALL_LAUNCH = 16
SMALL_TILES = {
    "bf16": {
        32: DecodeTile(block_n=32, num_warps=4, num_stages=2),
        64: DecodeTile(block_n=64, num_warps=4, num_stages=2),
        128: DecodeTile(block_n=128, num_warps=4, num_stages=3),
    },
    "nvfp4": {
        32: DecodeTile(block_n=32, num_warps=4, num_stages=2),
        64: DecodeTile(block_n=64, num_warps=4, num_stages=2),
        128: DecodeTile(block_n=128, num_warps=8, num_stages=2),
    },
}
# A few sequences keep the Triton program: one step per stretch leaves the register kernel's one
# warp nothing to overlap its loads with (batch 1, 1k: 8.2 us at its best split against 7.1;
# 4k: 11.9 against 9.9).
SMALL_TILES["registers"] = SMALL_TILES["nvfp4"]


def plan_for(
    fmt: str, programs: int, table_tokens: int, device: torch.device
) -> tuple[DecodeTile, int | None]:
    """``(tile, context stretches)`` for a launch of ``programs`` sequence-heads over block
    tables of ``table_tokens``: `SMALL_TILES` with one stretch per multiprocessor (a power of
    two) at most SMALL_LAUNCH programs, else `config_for`'s tile with `stretches_for`'s
    choice (None). ``fmt``: 'bf16', 'nvfp4' or 'registers' (`page_format`)."""
    if programs > SMALL_LAUNCH:
        return config_for(fmt, programs), None
    per_sm = max(1, multiprocessors(device) // max(programs, 1))
    stretches = 1 << (per_sm.bit_length() - 1)
    stretch = -(-table_tokens // stretches)
    block = min(128, max(32, triton.next_power_of_2(stretch)))
    return SMALL_TILES[fmt][block], stretches


# Programs a multiprocessor the context splits aim for (`DecodeTile.programs_per_sm`). The
# default 8, from the tile sweep: batch 64 at 4k tokens (256 sequence-heads) ran fastest in 4
# stretches (163 us BF16, 255 us NVFP4) and slower in 2 (188, 313; 512 programs, 1.3 waves if 3
# fit an SM by registers) than in 1 (178, 276); batch 256 (1,024 programs) fastest unsplit. The
# BF16 pages' tile of 2 warps has since been fastest in 2 stretches at batch 64 (134.0 against
# 140.6 us at 4k, 72.1 against 79.5 at 2k: "Decode attention: a shorter loop" in
# BENCHMARKS.md), which 4 a multiprocessor picks; batch 256 stays unsplit.
def stretches_for(
    programs: int, table_tokens: int, tile: DecodeTile, device: torch.device,
    num_splits: int | None = None,
) -> int:  # fmt: skip
    """How many stretches each sequence's context is cut into (`paged_attention.stretch_of`):
    the largest power of two that keeps ``programs`` (sequences x KV heads) times it within
    ``tile.programs_per_sm`` per multiprocessor, and no more than would cut a context as long
    as the table (``table_tokens``) into stretches shorter than ``tile.min_split_tokens``.
    ``num_splits`` overrides the choice (tests, benchmarks); either way at most one stretch per
    ``tile.block_n`` tokens of the table."""
    if num_splits is None:
        wanted = max(1, tile.programs_per_sm * multiprocessors(device) // max(programs, 1))
        wanted = 1 << (wanted.bit_length() - 1)
        num_splits = min(wanted, table_tokens // tile.min_split_tokens)
    return max(1, min(num_splits, -(-table_tokens // tile.block_n)))


def page_format(q_BHD: torch.Tensor, nvfp4: bool, head_dim: int, group: int) -> str:
    """Which kernel's tiles serve a launch: 'registers' (the register kernel) where it can run,
    else the Triton program's 'nvfp4' or 'bf16'."""
    from fp4rl.kernels import paged_attention_registers

    if not nvfp4:
        return "bf16"
    registers = (
        paged_attention_registers.supported(q_BHD.dtype, head_dim, group)
        and register_kernels_refusal(q_BHD.device) is None
    )
    return "registers" if registers else "nvfp4"
