"""Per-expert NVFP4 quantize (one global scale per expert) against a device copy of the same
BF16 tensor, measured in one run: the routed-expert weights of one Qwen3-30B-A3B layer.

    python benchmarks/expert_quant.py                  # one H200, well under a minute
    python benchmarks/expert_quant.py --quick          # CPU smoke check (TRITON_INTERPRET)
    python benchmarks/expert_quant.py --configs default,4096:16384:4:4

Shapes: W1+W3 ``[128, 1536, 2048]`` and W2 ``[128, 2048, 768]``, BF16. Ops: the one-launch
kernel (`fp4rl/kernels/expert_quant.py`) in each ``--configs`` variant (``default`` or
``TILE:ITEM_ELEMENTS:WARPS:PROGRAMS_PER_SM[:LAG]``), and the two-launch path it replaced (an
amax launch, then quantize, `nearest` with a tile config). Every variant is first checked bit
for bit: the two-launch result against the reference on CPU for a few experts, each one-launch
variant against the two-launch result on every expert. Then each op and a ``dst.copy_(src)`` of
the same tensor are timed with CUDA events after warm-up, median over repeats, rotating through
4 distinct random inputs (together past the L2): replayed from a CUDA graph (the GPU's time) and
as eager calls (launch included, as `benchmarks/refit.py` times them). Bandwidth is BF16 bytes
read per second; "vs copy" is the copy's time over the op's, in the same mode.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():  # --quick on a CPU: kernels must be decorated interpreted
    os.environ["TRITON_INTERPRET"] = "1"

from _timing import median_ms, report, run_header  # noqa: E402

from fp4rl.fp4 import reference as R  # noqa: E402
from fp4rl.fp4.tensor import NVFP4Tensor  # noqa: E402
from fp4rl.kernels import expert_quant, nearest  # noqa: E402
from fp4rl.kernels.launch import CONFIGS, outputs  # noqa: E402

NUM_BUFFERS = 4
SHAPES = {"w13": (128, 1536, 2048), "w2": (128, 2048, 768)}
QUICK_SHAPES = {"w13": (2, 16, 64), "w2": (2, 32, 48)}


def one_launch(w: torch.Tensor, config: expert_quant.ExpertConfig) -> NVFP4Tensor:
    e, n, k = w.shape
    s = torch.empty(e, 1, 1, dtype=torch.float32, device=w.device)
    out, codes, words, block_scale = outputs(w, False)
    expert_quant.launch(w.view(-1, k), n, s, out, words, block_scale, fake=False, config=config)
    return NVFP4Tensor(
        codes=codes, block_scale=block_scale.view(torch.float8_e4m3fn), global_scale=s
    )


def two_launches(w: torch.Tensor) -> NVFP4Tensor:
    return nearest.launch(w, scaling=2, global_scale=None, fake=False, config=CONFIGS["default"])


def same(a: NVFP4Tensor, b: NVFP4Tensor) -> bool:
    return all(
        x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(a.tensors(), b.tensors(), strict=True)
    )


def row(label: str, name: str, nbytes: int, copy: dict, graph_ms: float, eager_ms: float) -> str:
    return (
        f"| {label} | {name} | {graph_ms:.3f} | {nbytes / graph_ms / 1e6:,.0f} "
        f"| {copy[True] / graph_ms:.2f} | {eager_ms:.3f} | {nbytes / eager_ms / 1e6:,.0f} "
        f"| {copy[False] / eager_ms:.2f} |"
    )


def expert_config(spec: str) -> expert_quant.ExpertConfig:
    if spec in expert_quant.CONFIGS:
        return expert_quant.CONFIGS[spec]
    try:
        return expert_quant.ExpertConfig(*(int(part) for part in spec.split(":")))
    except (TypeError, ValueError):
        sys.exit(f"--configs: {spec!r} is neither a name in expert_quant.CONFIGS nor T:I:W:P[:L]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes; runs on a CPU")
    parser.add_argument("--configs", default="default", help="comma-separated variants")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        sys.exit("needs a CUDA GPU; --quick runs a CPU smoke check under TRITON_INTERPRET")
    device = "cuda" if cuda else "cpu"
    configs = {spec: expert_config(spec) for spec in args.configs.split(",")}
    warmup, repeats = (1, 1) if args.quick else (3, args.repeats)
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        f"{torch.cuda.get_device_name() if cuda else 'CPU'}; GB/s of BF16 read; GPU: CUDA-graph "
        "replay, eager: Python calls; vs copy = copy ms / op ms in the same mode",
        "",
        "| tensor | op | GPU ms | GB/s | vs copy | eager ms | GB/s | vs copy |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    torch.manual_seed(0)
    for leaf, shape in (QUICK_SHAPES if args.quick else SHAPES).items():
        inputs = [
            torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(NUM_BUFFERS)
        ]
        ops = {"two launches (amax, then quantize)": two_launches}
        ops |= {
            f"one launch, {spec}": (lambda w, c=c: one_launch(w, c)) for spec, c in configs.items()
        }
        # Bits first: a fast wrong kernel is not a result.
        baseline = two_launches(inputs[0])
        picked = [0, shape[0] // 2, shape[0] - 1]
        want = R.quantize(inputs[0][picked].cpu(), scaling=2)
        if not same(baseline.map(lambda t, p=picked: t[p].cpu()), want):
            sys.exit(f"{leaf}: the two-launch path differs from the reference")
        for name, fn in list(ops.items())[1:]:
            try:
                ok = same(fn(inputs[0]), baseline)
            except Exception as err:  # noqa: BLE001 - a variant that fails is reported, not fatal
                print(f"{leaf} {name}: {type(err).__name__}: {err}", file=sys.stderr)
                ops.pop(name)
                continue
            if not ok:
                sys.exit(f"{leaf} {name} differs from the two-launch path")

        out = torch.empty_like(inputs[0])
        timing = dict(warmup=warmup, repeats=repeats)
        copy = {g: median_ms(out.copy_, inputs, graph=g and cuda, **timing) for g in (True, False)}
        label = f"{leaf} [{' x '.join(map(str, shape))}]"
        nbytes = inputs[0].numel() * inputs[0].element_size()
        lines.append(row(label, "device copy", nbytes, copy, copy[True], copy[False]))
        for name, fn in ops.items():
            graph_ms = median_ms(fn, inputs, graph=cuda, **timing)
            eager_ms = median_ms(fn, inputs, **timing)
            lines.append(row(label, name, nbytes, copy, graph_ms, eager_ms))
        del inputs, out
    report("expert_quant.md", lines)


if __name__ == "__main__":
    main()
