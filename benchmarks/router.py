"""The MoE router's live routing: its two kernels against the eager ops they replace on the
engine's path, by the number of tokens T, outputs checked before anything is timed.

One H200 (seconds): ``python benchmarks/router.py``; a CPU smoke check under Triton's
interpreter: ``python benchmarks/router.py --device cpu``. Prints a markdown table and writes it
to ``$OUT/router.md`` when OUT is set; exits 1 if a check fails.

"eager" is `fp4rl.model.moe.eager_route` without replay (the casts, the FP32 GEMM, softmax,
top-k, the sum and the division of the normalization). "kernels" is
`fp4rl.kernels.router.launch` (logits, then softmax and top-k); "logits" its first launch alone.
Checks: the kernels' ids and weights are bitwise their PyTorch twin's
(`router.reference_route`, whose exp is torch's CUDA exp, libdevice's expf as the kernel's);
against eager, ids equal but in rows with a near tie at the k-th place (counted, at most 1 %
of rows), weights within one BF16 unit in the last place where the ids agree and at least
99 % of them equal. Times: CUDA-graph replays of one call per input (the GPU's time alone, as
decode steps replay it), median over repeats, us per call; every input has its own router
weight and activations, rotated over enough sets to pass 128 MiB (as a decode step finds each
layer's router weight out of L2).
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
    parser.add_argument("--no-norm", action="store_true", help="norm_topk_prob off")
    parser.add_argument(
        "--tiles",
        default="1:16:1,4:8:2,16:8:4",
        help="other logits tiles BLOCK_T:BLOCK_E:WARPS, timed too (the bits do not change)",
    )
    parser.add_argument("--repeats", type=int, default=50)
    return parser.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":  # kernels must be decorated interpreted: before fp4rl.kernels loads
    os.environ["TRITON_INTERPRET"] = "1"

from _timing import median_ms, report, rotation_count, run_header  # noqa: E402

from fp4rl.kernels import router  # noqa: E402
from fp4rl.model.moe import eager_route  # noqa: E402

MAX_INPUTS = 256


def make_inputs(T: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` pairs ``(x [T, H], W [E, H])`` in BF16: logits of standard deviation ~3."""
    g = torch.Generator().manual_seed(seed)
    H, E = ARGS.hidden, ARGS.experts
    return [
        (
            torch.randn(T, H, generator=g).to(torch.bfloat16).to(ARGS.device),
            (torch.randn(E, H, generator=g) * (3 / H**0.5)).to(torch.bfloat16).to(ARGS.device),
        )
        for _ in range(count)
    ]


def check(x: torch.Tensor, w: torch.Tensor, tiles, norm: bool) -> tuple[str | None, int]:
    """(None if every check passes, else what failed; rows whose ids differ from eager's)."""
    k = ARGS.top_k
    got_w, got_ids = router.launch(x, w, k, norm)
    if x.is_cuda:  # under the interpreter the kernel's exp is numpy's: the tests cover it
        twin_w, twin_ids = router.reference_route(x, w, k, norm)
        if not (torch.equal(got_ids, twin_ids) and torch.equal(got_w, twin_w)):
            return "differs from the PyTorch twin", 0
    for tile in tiles:
        if not torch.equal(router.logit_partials(x, w, tile), router.logit_partials(x, w)):
            return f"tile {tile} changes the logits", 0
    with torch.no_grad():
        want_w, want_ids, _ = eager_route(x, w, k, norm)
    differs_T = (got_ids != want_ids).any(-1)
    near_ties = int(differs_T.sum())
    if near_ties > max(1, x.shape[0] // 100):
        return f"ids differ in {near_ties} rows", near_ties
    same = ~differs_T
    g, e = got_w[same].float(), want_w[same].float()
    ulp = torch.finfo(torch.bfloat16).eps * e.abs()
    if ((g - e).abs() > ulp).any():
        return "a weight more than an ulp off", near_ties
    equal = (g == e).float().mean().item() if g.numel() else 1.0
    if equal < 0.99:
        return f"only {equal:.4f} of the weights equal", near_ties
    return None, near_ties


def main() -> int:
    cuda = ARGS.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU; --device cpu runs a smoke check under TRITON_INTERPRET")
    tokens = [int(t) for t in ARGS.tokens.split(",")]
    tiles = [router.LogitsTile(*(int(v) for v in t.split(":"))) for t in ARGS.tiles.split(",")]
    if not cuda:  # the interpreter runs each program in numpy: one small case, timed once
        tokens = [t for t in tokens if t <= 8][:1]
    repeats = ARGS.repeats if cuda else 1
    k, H, E, norm = ARGS.top_k, ARGS.hidden, ARGS.experts, not ARGS.no_norm
    order = router.sum_order(H)
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        f"E = {E}, k = {k}, H = {H}, norm_topk_prob = {norm}; BF16 x and W; logits summed in "
        f"{order.num_splits(H)} slices of {order.split} columns. CUDA-graph replay, median of "
        f"{repeats}, us per call. Logits tiles BLOCK_T:BLOCK_E:WARPS (the default is "
        "`router.tile_for(T)`).",
        "",
        "| T | eager us | kernels us | logits us (default tile) | "
        + " | ".join(f"logits {t.block_t}:{t.block_e}:{t.num_warps} us" for t in tiles)
        + " | eager / kernels | rows with other ids | checks |",
        "|---:|---:|---:|---:|" + "---:|" * len(tiles) + "---:|---:|---|",
    ]
    all_ok = True
    for T in tokens:
        per_input = (T + E) * H * 2
        count = rotation_count(per_input, most=MAX_INPUTS, cuda=cuda)
        inputs = make_inputs(T, count, seed=T)
        failure, near_ties = check(*inputs[0], tiles, norm)
        all_ok &= failure is None
        if failure is not None:
            cells = [str(T)] + [""] * (len(tiles) + 4) + [str(near_ties), f"FAILED: {failure}"]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        fns = [
            lambda inp: eager_route(inp[0], inp[1], k, norm),
            lambda inp: router.launch(inp[0], inp[1], k, norm),
            lambda inp: router.logit_partials(inp[0], inp[1]),
        ] + [lambda inp, tile=tile: router.logit_partials(inp[0], inp[1], tile) for tile in tiles]
        timed = functools.partial(median_ms, warmup=2 if cuda else 0, repeats=repeats, graph=cuda)
        with torch.no_grad():
            times = [timed(fn, inputs) * 1e3 for fn in fns]
        lines.append(
            f"| {T} | "
            + " | ".join(f"{t:.1f}" for t in times)
            + f" | {times[0] / times[1]:.2f}x | {near_ties} | passed |"
        )
    report("router.md", lines)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
