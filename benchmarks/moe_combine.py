"""The MoE combine: the one-launch kernel against the eager ops it replaces (the arange and
scatter of the inverse permutation, then gather, weight cast, multiply and sum over k), by the
number of tokens T, outputs checked before anything is timed.

One H200 (seconds): ``python benchmarks/moe_combine.py``; a CPU smoke check under Triton's
interpreter: ``python benchmarks/moe_combine.py --device cpu``. Prints a markdown table and
writes it to ``$OUT/moe_combine.md`` when OUT is set; exits 1 if a check fails.

"eager" is what `fp4rl.model.experts` runs where the kernels do not: the inverse of the
dispatch's order as ``empty_like(order).scatter_(0, order, arange(A))`` and `eager_combine`.
"kernel" is `fp4rl.kernels.moe_combine.launch`; the inverse comes from the sort kernel
(`fp4rl.kernels.expert_sort`), one store per assignment more in a launch the dispatch makes
anyway (`benchmarks/expert_sort.py` times that launch). So "eager / kernel" compares the
eager inverse plus the eager combine with the combine kernel alone. Checks: the sort kernel's
inverse equals the scatter's; kernel outputs are within one unit in the last place of the
eager ones, and at least 99 % of them equal. Times: CUDA-graph replays of one call per input
(the GPU's time alone, as decode steps replay it), median over repeats, us per call; inputs
rotate over enough buffers to pass 128 MiB, except that at most 64 are kept (small T stays in
L2, as the combine finds the output the grouped GEMM just wrote).
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
    parser.add_argument("--tokens", default="1,8,64,256,1024")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument(
        "--tiles", default="128:1,512:2,1024:4", help="other kernel tiles BLOCK_H:WARPS, timed too"
    )
    parser.add_argument("--repeats", type=int, default=20)
    return parser.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":  # kernels must be decorated interpreted: before fp4rl.kernels loads
    os.environ["TRITON_INTERPRET"] = "1"

from _timing import median_ms, report, rotation_count, run_header  # noqa: E402

from fp4rl.kernels import expert_sort, moe_combine  # noqa: E402
from fp4rl.model.experts import eager_combine  # noqa: E402

MAX_INPUTS = 64


def make_inputs(T: int, count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``count`` sets of ``(order_A, row_order_Tk, y_AH, weights_Tk)``: k distinct experts per
    token, the dispatch's order and inverse from the sort kernel, BF16 expert outputs and
    weights (the router's output dtype)."""
    g = torch.Generator().manual_seed(seed)
    k, H, E = ARGS.top_k, ARGS.hidden, ARGS.experts
    sets = []
    for _ in range(count):
        ids = torch.rand(T, E, generator=g).topk(k, dim=-1).indices.to(ARGS.device)
        order, inverse, _ = expert_sort.launch(ids, E)
        y = torch.randn(T * k, H, generator=g).to(torch.bfloat16).to(ARGS.device)
        w = torch.softmax(torch.randn(T, k, generator=g), -1).to(torch.bfloat16)
        sets.append((order, inverse.view(T, k), y, w.to(ARGS.device)))
    return sets


def eager_inverse(order_A: torch.Tensor) -> torch.Tensor:
    positions_A = torch.arange(order_A.numel(), device=order_A.device)
    return torch.empty_like(order_A).scatter_(0, order_A, positions_A)


def check(inputs: tuple[torch.Tensor, ...], tiles) -> str | None:
    """None if the inverse and every tile's combine pass the checks, else what failed."""
    order, row_order, y, w = inputs
    if not torch.equal(row_order.flatten(), eager_inverse(order)):
        return "inverse differs from the scatter's"
    want = eager_combine(y, row_order, w).float()
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    for tile in tiles:
        got = moe_combine.launch(y, row_order, w, tile).float()
        if ((got - want).abs() > ulp).any():
            return f"tile {tile.block_h}:{tile.num_warps} more than an ulp off"
        equal = (got == want).float().mean().item()
        if equal < 0.99:
            return f"tile {tile.block_h}:{tile.num_warps}: only {equal:.4f} equal"
    return None


def main() -> int:
    cuda = ARGS.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU; --device cpu runs a smoke check under TRITON_INTERPRET")
    tokens = [int(t) for t in ARGS.tokens.split(",")]
    tiles = [
        moe_combine.CombineTile(*(int(v) for v in t.split(":"))) for t in ARGS.tiles.split(",")
    ]
    tiles = [moe_combine.DEFAULT_TILE] + [t for t in tiles if t != moe_combine.DEFAULT_TILE]
    if not cuda:
        tokens = [t for t in tokens if t <= 8]
    repeats = ARGS.repeats if cuda else 1
    k, H = ARGS.top_k, ARGS.hidden
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        f"k = {k}, H = {H}, E = {ARGS.experts}; BF16 expert outputs and weights. CUDA-graph "
        f"replay, median of {repeats}, us per call.",
        "",
        f"Kernel tiles BLOCK_H:WARPS; the first is the default ({moe_combine.DEFAULT_TILE}).",
        "",
        "| T | eager inverse us | eager combine us | "
        + " | ".join(f"kernel {t.block_h}:{t.num_warps} us" for t in tiles)
        + " | eager / default kernel | checks |",
        "|---:|---:|---:|" + "---:|" * len(tiles) + "---:|---|",
    ]
    all_ok = True
    for T in tokens:
        per_input = T * k * H * 2
        count = rotation_count(per_input, most=MAX_INPUTS, cuda=cuda)
        inputs = make_inputs(T, count, seed=T)
        failure = check(inputs[0], tiles)
        all_ok &= failure is None
        if failure is not None:
            lines.append(f"| {T} | | | " + "| " * len(tiles) + f"| FAILED: {failure} |")
            continue
        fns = [
            lambda inp: eager_inverse(inp[0]),
            lambda inp: eager_combine(inp[2], inp[1], inp[3]),
        ] + [
            lambda inp, tile=tile: moe_combine.launch(inp[2], inp[1], inp[3], tile)
            for tile in tiles
        ]
        timed = functools.partial(median_ms, warmup=2, repeats=repeats, graph=cuda)
        times = [timed(fn, inputs) * 1e3 for fn in fns]
        ratio = (times[0] + times[1]) / times[2]
        lines.append(
            f"| {T} | " + " | ".join(f"{t:.1f}" for t in times) + f" | {ratio:.2f}x | passed |"
        )
    report("moe_combine.md", lines)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
