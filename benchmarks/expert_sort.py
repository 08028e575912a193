"""The MoE dispatch's sort by expert: the counting-sort kernel against the int32-key torch sort
, inverse scatter and count it replaces, by the number of assignments A and experts E, outputs
checked bitwise.

One H200 (seconds): ``python benchmarks/expert_sort.py``; a CPU smoke check under Triton's
interpreter: ``python benchmarks/expert_sort.py --device cpu``. Prints a markdown table and
writes it to ``$OUT/expert_sort.md`` when OUT is set; exits 1 if an order differs from
``torch.argsort(ids, stable=True)``, an inverse from its inverse permutation or a count from
``torch.bincount``.

"kernel" is `fp4rl.kernels.expert_sort.launch` (the order, its inverse and the counts per
expert); "torch" is what `fp4rl.model.experts.dispatch_order` runs where the kernel does not
(keys ``id * A + position`` sorted as int32, the inverse as a scatter of ``arange(A)``, the
counts as an index-add of ones, `fp4rl.model.experts.expert_counts`).
Times: CUDA-graph replays of one call per input (the GPU's time alone, as decode steps replay
it), median over repeats, us per call. The kernel's time grows with A (every program reads all
the ids), torch's with its sort's passes: where they cross is where
`expert_sort.MAX_ASSIGNMENTS` belongs.
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
    parser.add_argument("--assignments", default="8,64,512,1024,2048,4096,8192")
    parser.add_argument("--experts", default="128,256")
    parser.add_argument(
        "--tiles", default="32:4,64:8,128:8", help="other kernel tiles CHUNK:WARPS, timed too"
    )
    parser.add_argument("--repeats", type=int, default=20)
    return parser.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":  # kernels must be decorated interpreted: before fp4rl.kernels loads
    os.environ["TRITON_INTERPRET"] = "1"

from _timing import median_ms, report, run_header  # noqa: E402

from fp4rl.kernels import expert_sort  # noqa: E402


def torch_sort(ids_A: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """`dispatch_order`'s torch path (E * A < 2**31): one sort of unique int32 keys, then the
    inverse permutation by a scatter and the counts by an index-add."""
    A = ids_A.numel()
    keys_A = torch.arange(A, dtype=torch.int32, device=ids_A.device)
    keys_A.add_(ids_A.to(torch.int32), alpha=A)
    order_A = torch.sort(keys_A).indices
    positions_A = torch.arange(A, device=ids_A.device)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_A.device)
    counts_E.index_add_(0, ids_A, torch.ones_like(ids_A, dtype=torch.int64))
    return order_A, torch.empty_like(order_A).scatter_(0, order_A, positions_A), counts_E


def sorted_correctly(result: tuple[torch.Tensor, ...], ids: torch.Tensor, E: int) -> bool:
    """The order is the stable argsort of ``ids`` bit for bit, the inverse its inverse
    permutation, the counts ``bincount``'s."""
    order, inverse, counts = (t.cpu() for t in result)
    want = torch.argsort(ids.cpu(), stable=True)
    return (
        torch.equal(order, want)
        and torch.equal(inverse[want], torch.arange(want.numel()))
        and torch.equal(counts, torch.bincount(ids.cpu(), minlength=E))
    )


def main() -> int:
    cuda = ARGS.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU; --device cpu runs a smoke check under TRITON_INTERPRET")
    sizes = [int(a) for a in ARGS.assignments.split(",")]
    tiles = [expert_sort.SortTile(*(int(v) for v in t.split(":"))) for t in ARGS.tiles.split(",")]
    tiles = [expert_sort.DEFAULT_TILE] + [t for t in tiles if t != expert_sort.DEFAULT_TILE]
    experts = [int(e) for e in ARGS.experts.split(",")]
    if not cuda:
        sizes, experts = [a for a in sizes if a <= 512], experts[:1]
    repeats = ARGS.repeats if cuda else 1
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        f"Uniform int64 ids (the router's top-k dtype). CUDA-graph replay, median of {repeats}, "
        "us per call.",
        "",
        f"Kernel tiles CHUNK:WARPS; the first is the default ({expert_sort.DEFAULT_TILE}).",
        "",
        "| A | E | torch us | "
        + " | ".join(f"kernel {t.chunk}:{t.num_warps} us" for t in tiles)
        + " | torch / default kernel | orders, inverses, counts |",
        "|---:|---:|---:|" + "---:|" * len(tiles) + "---:|---|",
    ]
    all_equal = True
    for E in experts:
        for A in sizes:
            g = torch.Generator().manual_seed(A + E)
            inputs = [torch.randint(0, E, (A,), generator=g).to(ARGS.device) for _ in range(8)]
            sorts = [functools.partial(torch_sort, num_experts=E)] + [
                functools.partial(expert_sort.launch, num_experts=E, tile=t) for t in tiles
            ]
            times = [
                median_ms(fn, inputs, warmup=2, repeats=repeats, graph=cuda) * 1e3 for fn in sorts
            ]
            equal = all(sorted_correctly(fn(inputs[0]), inputs[0], E) for fn in sorts)
            all_equal &= equal
            lines.append(
                f"| {A} | {E} | "
                + " | ".join(f"{t:.1f}" for t in times)
                + f" | {times[0] / times[1]:.2f}x | {'bitwise equal' if equal else 'DIFFER'} |"
            )
    report("expert_sort.md", lines)
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
