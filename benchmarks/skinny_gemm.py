"""A decode step's attention projections: the one-launch kernel against cuBLAS, by the number
of rows M, outputs checked before anything is timed.

One H200 (a minute): ``python benchmarks/skinny_gemm.py``; a CPU smoke check under Triton's
interpreter at tiny shapes: ``python benchmarks/skinny_gemm.py --device cpu``. Prints markdown
tables and writes them to ``$OUT/skinny_gemm.md`` when OUT is set; exits 1 if a check fails.

Problems (Qwen3-30B-A3B's attention by default): "qkv", x ``[M, H]`` times q, k and v
(``[Hq * D, H]``, ``[Hkv * D, H]`` twice) -- cuBLAS as three ``F.linear`` calls, the kernel as
one launch (`fp4rl.kernels.skinny_gemm.launch`); "o", ``[M, Hq * D]`` times o (``[H, Hq * D]``)
-- one call each. Kernel variants: the launcher's tiles (K split in slices of `SLICE_K`), the
tiles before the split (all of K per program: "unsplit"), the launcher's tile of each M with
other slices (``--slices``) and other tiles (``--tiles``). Checks: every kernel output within
the FP32-accumulation bound of the float64 product (tests/kernels/test_kernel_skinny_gemm.py
states it), for every variant timed; against ``F.linear`` (torch's default settings) the largest
distance in BF16 units in the last place and the share of equal outputs, reported, not asserted
(both round an FP32 sum once; near-zero outputs of large cancelling sums can differ by several
units).
Times: CUDA-graph replays of one call per input (the GPU's time alone, as decode steps replay
it), median over repeats, us per call; every input has its own weights, rotated over enough
sets to pass 128 MiB (as a decode step finds each layer's weights out of L2). GB/s: weight, x
and y bytes over the time; "copy GB/s" is a device-to-device copy of the same weight bytes
(bytes read plus written over its time) in the same run, the bandwidth to compare with.
"programs": the default tile's grid (column blocks x row blocks x slices). The kernel is launched
dependently (`fp4rl.kernels.dependent_launch`: each replayed call may start while the one
before ends, as in a decode step of such kernels); ``--no-pdl`` launches it plainly.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import torch

# Other tiles timed by default: 16 columns per program (o: 128 column blocks), one slice of
# 256 per program (one step, no pipeline) and slices of 1024 (4 steps, 3 in flight).
GPU_TILES = (
    "16:16:4:2,16:16:4:1:256:256,16:32:4:1:256:256,16:32:4:3:256:1024,16:16:4:3:256:1024,"
    "32:16:4:2,64:16:4:2"
)
# The smoke check's K is 64 or 128: steps of 16 in slices of 32 split it.
CPU_TILES = "16:16:4:2:16:32"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu runs a smoke check"
    )
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--tiles",
        default=None,
        help="other kernel tiles BLOCK_M:BLOCK_N:WARPS:STAGES[:BLOCK_K[:SLICE_K]], timed too "
        "(a BLOCK_K or SLICE_K other than the default's changes the order of the sum, not its "
        f"bound; SLICE_K 0: not split); default {GPU_TILES} (on the CPU {CPU_TILES})",
    )
    parser.add_argument(
        "--slices",
        default="0,256,1024,2048",
        help="SLICE_K values timed with the launcher's tile of each M (0: all of K per program; "
        "each at least the tile's BLOCK_K)",
    )
    parser.add_argument(
        "--no-pdl", action="store_true", help="launch the kernel plainly, not dependently"
    )
    parser.add_argument("--repeats", type=int, default=50)
    return parser.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":  # kernels must be decorated interpreted: before fp4rl.kernels loads
    os.environ["TRITON_INTERPRET"] = "1"

from _timing import median_ms, report, rotation_count, run_header  # noqa: E402

from fp4rl.kernels import dependent_launch, skinny_gemm  # noqa: E402
from fp4rl.kernels.skinny_gemm import SkinnyTile  # noqa: E402

dependent_launch.ENABLED = not ARGS.no_pdl

# The launcher's tiles before K was split (all of K per program), by the most rows they took.
UNSPLIT = (
    (16, SkinnyTile(block_m=16, block_n=32, num_warps=4, num_stages=4, slice_k=0)),
    (32, SkinnyTile(block_m=32, block_n=32, num_warps=4, num_stages=3, slice_k=0)),
    (
        skinny_gemm.MAX_ROWS,
        SkinnyTile(block_m=64, block_n=32, num_warps=4, num_stages=2, slice_k=0),
    ),
)

SMOKE_SHAPES = dict(hidden=64, heads=4, kv_heads=2, head_dim=16)


def problems() -> dict[str, tuple[int, tuple[int, ...]]]:
    """name -> (K, N of each weight)."""
    shape = SMOKE_SHAPES if ARGS.device == "cpu" else dict(
        hidden=ARGS.hidden, heads=ARGS.heads, kv_heads=ARGS.kv_heads, head_dim=ARGS.head_dim
    )  # fmt: skip
    H, D = shape["hidden"], shape["head_dim"]
    q, kv = shape["heads"] * D, shape["kv_heads"] * D
    return {"qkv": (H, (q, kv, kv)), "o": (q, (H,))}


def make_inputs(M: int, K: int, Ns, count: int, seed: int) -> list[tuple]:
    """``count`` sets of (x, weights): Gaussian x, weights of a trained projection's scale."""
    g = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(count):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(ARGS.device)
        weights = [(torch.randn(n, K, generator=g) * K**-0.5).to(torch.bfloat16) for n in Ns]
        sets.append((x, [w.to(ARGS.device) for w in weights]))
    return sets


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in BF16 units in the last place (±0 both 0)."""

    def ordered(t):
        bits = t.view(torch.int16).to(torch.int32)
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()


def within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """y within ``2**-8 |ref| + (1 + 2**-8) K 2**-23 (|x| @ |w|.T)`` of the float64 product."""
    ref = x.double() @ w.double().T
    e = x.shape[1] * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    return bool(((y.double() - ref).abs() <= 2.0**-8 * ref.abs() + (1 + 2.0**-8) * e).all())


def check(x, weights, tiles) -> tuple[str | None, int, float]:
    """(what failed or None, the largest ulp distance to F.linear, the share equal to it), of
    the launcher's tile (None in ``tiles``) and the others."""
    for tile in tiles:
        outs = skinny_gemm.launch(x, weights, tile)
        if not all(within_bound(y, x, w) for y, w in zip(outs, weights, strict=True)):
            return f"tile {tile} outside the FP32 bound", 0, 0.0
    outs = skinny_gemm.launch(x, weights)
    cublas = [torch.nn.functional.linear(x, w) for w in weights]
    worst = max(int(ulp_distance(y, c).max()) for y, c in zip(outs, cublas, strict=True))
    equal = sum(int((y == c).sum()) for y, c in zip(outs, cublas, strict=True))
    return None, worst, equal / sum(y.numel() for y in outs)


def parse_tiles() -> list[SkinnyTile]:
    text = (
        ARGS.tiles if ARGS.tiles is not None else GPU_TILES if ARGS.device == "cuda" else CPU_TILES
    )
    tiles = []
    for spec in text.split(",") if text else []:
        values = [int(v) for v in spec.split(":")]
        if not 4 <= len(values) <= 6:
            sys.exit(f"--tiles: BLOCK_M:BLOCK_N:WARPS:STAGES[:BLOCK_K[:SLICE_K]]; got {spec!r}")
        block_k = values[4] if len(values) > 4 else skinny_gemm.BLOCK_K
        slice_k = values[5] if len(values) > 5 else skinny_gemm.SLICE_K
        tiles.append(SkinnyTile(*values[:4], block_k=block_k, slice_k=slice_k))
    return tiles


def unsplit_for(num_rows: int) -> SkinnyTile:
    return next(tile for bound, tile in UNSPLIT if num_rows <= bound)


def variants(M: int, slices: list[int], extra: list[SkinnyTile]) -> dict[str, SkinnyTile]:
    """The sweep's tiles for M rows by column name: the launcher's tile with each slice, then
    the other tiles."""
    tile = skinny_gemm.tile_for(M)
    named = {f"slice {s}": dataclasses.replace(tile, slice_k=s) for s in slices}
    return named | {_name(t): t for t in extra}


def programs(M: int, K: int, Ns, tile: SkinnyTile) -> int:
    """The grid of a launch: column blocks x row blocks x slices."""
    blocks = sum(-(-n // tile.block_n) for n in Ns)
    return blocks * -(-M // tile.block_m) * skinny_gemm.slices_for(K, tile.slice_k)


def main() -> int:
    cuda = ARGS.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU; --device cpu runs a smoke check under TRITON_INTERPRET")
    rows = [int(m) for m in ARGS.rows.split(",")]
    if any(not 1 <= m <= skinny_gemm.MAX_ROWS for m in rows):
        sys.exit(f"--rows must lie in [1, {skinny_gemm.MAX_ROWS}]; got {ARGS.rows}")
    if not cuda:
        rows = [m for m in rows if m <= 4]
    extra = parse_tiles()
    slices = [int(s) for s in ARGS.slices.split(",")] if ARGS.slices else []
    if not cuda:  # the smoke check's K is one slice of any SLICE_K the default tile takes
        slices = [0]
    repeats = ARGS.repeats if cuda else 1
    timed = functools.partial(median_ms, warmup=2, repeats=repeats, graph=cuda)
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        "Problems (K, N of each weight): "
        + ", ".join(f"{name} {spec}" for name, spec in problems().items())
        + f"; BF16. CUDA-graph replay, median of {repeats}, us per call. Kernel tiles "
        "BLOCK_M:BLOCK_N:WARPS:STAGES:BLOCK_K:SLICE_K by M: "
        + ", ".join(f"M <= {b}: {_name(t)}" for b, t in skinny_gemm.CONFIGS)
        + "; unsplit (before the split): "
        + ", ".join(f"M <= {b}: {_name(t)}" for b, t in UNSPLIT)
        + f". Dependent launch: {'off' if ARGS.no_pdl else 'on where the GPU has it'}.",
        "",
        "| M | problem | programs | cuBLAS us | kernel us | cuBLAS / kernel | unsplit us "
        "| cuBLAS / unsplit | kernel GB/s | copy GB/s | max ulp vs F.linear | equal to F.linear "
        "| checks |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    names = list(variants(1, slices, extra))
    sweep = [
        "",
        "Other variants, us per call (cuBLAS / variant): the launcher's tile of each M with "
        "another SLICE_K (0: not split), other tiles BLOCK_M:BLOCK_N:WARPS:STAGES:BLOCK_K:SLICE_K.",
        "",
        "| M | problem | " + " | ".join(names) + " |",
        "|---:|---|" + "---:|" * len(names),
    ]
    all_ok = True
    for M in rows:
        for name, (K, Ns) in problems().items():
            weight_bytes = 2 * K * sum(Ns)
            count = rotation_count(weight_bytes, cuda=cuda)
            inputs = make_inputs(M, K, Ns, count, seed=M * 7 + K)
            unsplit = unsplit_for(M)
            others = variants(M, slices, extra)
            failure, worst, equal = check(*inputs[0], [None, unsplit, *others.values()])
            all_ok &= failure is None
            if failure is not None:
                lines.append(f"| {M} | {name} |" + " |" * 10 + f" FAILED: {failure} |")
                continue
            kernel_us = functools.partial(_kernel_us, inputs, timed)
            cublas_us = timed(
                lambda inp: [torch.nn.functional.linear(inp[0], w) for w in inp[1]], inputs
            ) * 1e3  # fmt: skip
            default_us, unsplit_us = kernel_us(None), kernel_us(unsplit)
            copy_us = _copy_us(weight_bytes, count, timed)
            moved = weight_bytes + 2 * M * (K + sum(Ns))
            lines.append(
                f"| {M} | {name} | {programs(M, K, Ns, skinny_gemm.tile_for(M))} | "
                f"{cublas_us:.2f} | {default_us:.2f} | {cublas_us / default_us:.2f}x | "
                f"{unsplit_us:.2f} | {cublas_us / unsplit_us:.2f}x | "
                f"{moved / default_us / 1e3:.0f} | {2 * weight_bytes / copy_us / 1e3:.0f} | "
                f"{worst} | {equal:.4f} | passed |"
            )
            cells = []
            for tile in others.values():
                us = kernel_us(tile)
                cells.append(f"{us:.2f} ({cublas_us / us:.2f}x)")
            sweep.append(f"| {M} | {name} | " + " | ".join(cells) + " |")
    report("skinny_gemm.md", lines + (sweep if names else []))
    return 0 if all_ok else 1


def _name(tile: SkinnyTile) -> str:
    return (
        f"{tile.block_m}:{tile.block_n}:{tile.num_warps}:{tile.num_stages}:{tile.block_k}:"
        f"{tile.slice_k}"
    )


def _kernel_us(inputs, timed, tile: SkinnyTile | None) -> float:
    """us per kernel launch with ``tile`` (None: the launcher's)."""
    return timed(lambda inp: skinny_gemm.launch(*inp, tile), inputs) * 1e3


def _copy_us(num_bytes: int, count: int, timed) -> float:
    """us per device-to-device copy of ``num_bytes``, over ``count`` rotated buffers."""
    pairs = [
        (torch.ones(num_bytes, dtype=torch.uint8, device=ARGS.device),
         torch.empty(num_bytes, dtype=torch.uint8, device=ARGS.device))
        for _ in range(count)
    ]  # fmt: skip
    return timed(lambda pair: pair[1].copy_(pair[0]), pairs) * 1e3


if __name__ == "__main__":
    sys.exit(main())
