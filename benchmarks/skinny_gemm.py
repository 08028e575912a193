"""A decode step's attention projections: the one-launch kernel against cuBLAS, by the number
of rows M, outputs checked before anything is timed.

One H200 (a minute): ``python benchmarks/skinny_gemm.py``; a CPU smoke check under Triton's
interpreter at tiny shapes: ``python benchmarks/skinny_gemm.py --device cpu``. Prints markdown
tables and writes them to ``$OUT/skinny_gemm.md`` when OUT is set; exits 1 if a check fails.

Problems (Qwen3-30B-A3B's attention by default): "qkv", x ``[M, H]`` times q, k and v
(``[Hq * D, H]``, ``[Hkv * D, H]`` twice) -- cuBLAS as three ``F.linear`` calls, the kernel as
one launch (`fp4rl.kernels.skinny_gemm.launch`); "o", ``[M, Hq * D]`` times o (``[H, Hq * D]``)
-- one call each. Checks: every kernel output within the FP32-accumulation bound of the float64
product (tests/kernels/test_kernel_skinny_gemm.py states it), for the default tile and every
other tile timed; against ``F.linear`` (torch's default settings) the largest distance in BF16
units in the last place and the share of equal outputs, reported, not asserted (both round an
FP32 sum once; near-zero outputs of large cancelling sums can differ by several units).
Times: CUDA-graph replays of one call per input (the GPU's time alone, as decode steps replay
it), median over repeats, us per call; every input has its own weights, rotated over enough
sets to pass 128 MiB (as a decode step finds each layer's weights out of L2). GB/s: weight, x
and y bytes over the time; "copy GB/s" is a device-to-device copy of the same weight bytes
(bytes read plus written over its time) in the same run, the bandwidth to compare with.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch


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
        default="16:16:4:6,16:32:4:4,32:16:4:4,64:16:4:2,16:16:4:3:512,16:16:4:8:128",
        help="other kernel tiles BLOCK_M:BLOCK_N:WARPS:STAGES[:BLOCK_K], timed too (a BLOCK_K "
        "other than the default's changes the order of the sum, not its bound)",
    )
    parser.add_argument("--repeats", type=int, default=50)
    return parser.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":  # kernels must be decorated interpreted: before fp4rl.kernels loads
    os.environ["TRITON_INTERPRET"] = "1"

from _timing import median_ms, report, rotation_count, run_header  # noqa: E402

from fp4rl.kernels import skinny_gemm  # noqa: E402
from fp4rl.kernels.skinny_gemm import SkinnyTile  # noqa: E402

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
    """(what failed or None, the largest ulp distance to F.linear, the share equal to it)."""
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
    tiles = []
    for text in ARGS.tiles.split(",") if ARGS.tiles else []:
        values = [int(v) for v in text.split(":")]
        block_k = values[4] if len(values) > 4 else skinny_gemm.BLOCK_K
        tiles.append(SkinnyTile(*values[:4], block_k=block_k))
    return tiles


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
    repeats = ARGS.repeats if cuda else 1
    timed = functools.partial(median_ms, warmup=2, repeats=repeats, graph=cuda)
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        "Problems (K, N of each weight): "
        + ", ".join(f"{name} {spec}" for name, spec in problems().items())
        + f"; BF16. CUDA-graph replay, median of {repeats}, us per call.",
        "",
        "| M | problem | cuBLAS us | kernel us | cuBLAS / kernel | kernel GB/s | copy GB/s "
        "| max ulp vs F.linear | equal to F.linear | checks |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    sweep = [
        "",
        "Other tiles BLOCK_M:BLOCK_N:WARPS:STAGES:BLOCK_K, us (the default's by M: "
        + ", ".join(f"M <= {b}: {_name(t)}" for b, t in skinny_gemm.CONFIGS)
        + ").",
        "",
        "| M | problem | " + " | ".join(_name(t) for t in extra) + " |",
        "|---:|---|" + "---:|" * len(extra),
    ]
    all_ok = True
    for M in rows:
        for name, (K, Ns) in problems().items():
            weight_bytes = 2 * K * sum(Ns)
            count = rotation_count(weight_bytes, cuda=cuda)
            inputs = make_inputs(M, K, Ns, count, seed=M * 7 + K)
            failure, worst, equal = check(*inputs[0], [None, *extra])
            all_ok &= failure is None
            if failure is not None:
                lines.append(f"| {M} | {name} | | | | | | | | FAILED: {failure} |")
                continue
            cublas_us = timed(
                lambda inp: [torch.nn.functional.linear(inp[0], w) for w in inp[1]], inputs
            ) * 1e3  # fmt: skip
            kernel_us = timed(lambda inp: skinny_gemm.launch(*inp), inputs) * 1e3
            copy_us = _copy_us(weight_bytes, count, timed)
            moved = weight_bytes + 2 * M * (K + sum(Ns))
            lines.append(
                f"| {M} | {name} | {cublas_us:.2f} | {kernel_us:.2f} | "
                f"{cublas_us / kernel_us:.2f}x | {moved / kernel_us / 1e3:.0f} | "
                f"{2 * weight_bytes / copy_us / 1e3:.0f} | {worst} | {equal:.4f} | passed |"
            )
            tile_us = [
                timed(lambda inp, tile=tile: skinny_gemm.launch(*inp, tile), inputs) * 1e3
                for tile in extra
            ]
            sweep.append(f"| {M} | {name} | " + " | ".join(f"{t:.2f}" for t in tile_us) + " |")
    report("skinny_gemm.md", lines + (sweep if extra else []))
    return 0 if all_ok else 1


def _name(tile: SkinnyTile) -> str:
    return f"{tile.block_m}:{tile.block_n}:{tile.num_warps}:{tile.num_stages}:{tile.block_k}"


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
