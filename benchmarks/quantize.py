"""NVFP4 kernels: achieved bytes/s against a device copy and against the PyTorch reference.

One H200 (about a minute): ``python benchmarks/quantize.py``; a CPU smoke check of the script
itself: ``python benchmarks/quantize.py --quick`` (tiny shapes, Triton's interpreter). Prints a
markdown table and writes it to ``$OUT/quantize.md`` when OUT is set.

Every op is first checked bit for bit against the reference (CPU) on a slice, then timed with
CUDA events after warm-up, median over repeats, rotating through 3 distinct random (non-zero)
inputs that each exceed the L2: once as a replayed CUDA graph (the GPU's time, which the
bandwidth columns use) and once as eager Python calls (what a caller waits for, launch
included). Bytes are the op's minimal traffic (input read once, outputs written once);
per-tensor quantize really reads x twice (amax pass, then quantize), shown separately. The copy
baseline is ``dst.copy_(src)`` of the activation, counting read + write; "tile copy" is the
kernels' own chunk walk (load, unpack, repack, store) without the NVFP4 arithmetic, which
separates memory access from rounding cost.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():  # --quick on a CPU: kernels must be decorated interpreted
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from _timing import median_ms, report, run_header  # noqa: E402

from fp4rl import kernels  # noqa: E402
from fp4rl.fp4 import reference as R  # noqa: E402
from fp4rl.fp4 import rounding  # noqa: E402
from fp4rl.kernels import dequant, guided, nearest  # noqa: E402
from fp4rl.kernels.launch import CONFIGS, TileConfig, pair_view  # noqa: E402
from fp4rl.kernels.tiles import load_pairs, program_rows, store_values  # noqa: E402

NUM_BUFFERS = 3


@triton.jit
def _tile_copy_kernel(
    x_RK, out_RK, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr
):
    rows_R, row_ok_R = program_rows(R, BLOCK_R)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        even, odd = load_pairs(x_RK, rows_R, row_ok_R, k0, K, BLOCK_K)
        store_values(out_RK, rows_R, row_ok_R, k0, K, even, odd, BLOCK_K)


def tile_copy(x_RK: torch.Tensor, config: TileConfig | None) -> torch.Tensor:
    out = torch.empty_like(x_RK)
    grid, meta = (config or CONFIGS["row"]).launch(*x_RK.shape)
    _tile_copy_kernel[grid](pair_view(x_RK), out, *x_RK.shape, **meta)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes; runs on a CPU")
    parser.add_argument(
        "--configs",
        help="comma-separated tile configs to time: auto (each launcher's choice), names from "
        "launch.CONFIGS or specs BLOCK_K:TILE:WARPS:STAGES such as 1024:4096:4:3 (default: auto)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.quick:
        sys.exit("needs a CUDA GPU; --quick runs a CPU smoke check under TRITON_INTERPRET")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, k = (64, 256) if args.quick else (16384, 7168)  # activations [T, D]
    experts, n = (2, 32) if args.quick else (8, 4096)  # a layer's expert weights [E, N, D]
    warmup, repeats = (1, 2) if args.quick else (5, 20)
    bf16 = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=bf16)

    acts = [randn(rows, k) for _ in range(NUM_BUFFERS)]
    weights = [randn(experts, n, k) for _ in range(NUM_BUFFERS)]
    rollouts = [kernels.quantize(x * (1 + 0.02 * torch.randn_like(x)), scaling="row") for x in acts]
    packed = [kernels.quantize(x, scaling="row") for x in acts]
    act, wt = rows * k, experts * n * k  # element counts
    nvfp4_bytes = act // 2 + act // 16 + 4 * rows  # codes + block scales + global scales
    # The same activations as rows of 2048 (Qwen3-30B-A3B's hidden size, a power of two).
    narrow = [x.view(-1, 2048) for x in acts]
    # Weights with their global scale known beforehand: the quantize pass alone.
    scaled = [(w.view(-1, k), R.global_scale_from_amax(w.abs().amax()).view(1, 1)) for w in weights]
    narrow_bytes = act // 2 + act // 16 + 4 * (act // 2048)

    # name, kernel(config) -> fn(input), inputs, reference fn(input), minimal bytes, bytes moved
    ops = [
        ("tile copy (no arithmetic)", lambda c: lambda x: tile_copy(x, c), acts,
         lambda x: x.clone(), 4 * act, None),
        ("quantize per-row [T, D]", lambda c: lambda x: nearest.launch(
            x, scaling="row", global_scale=None, fake=False, config=c),
         acts, lambda x: R.quantize(x, scaling="row"), 2 * act + nvfp4_bytes, None),
        ("quantize per-row [T*D/2048, 2048]", lambda c: lambda x: nearest.launch(
            x, scaling="row", global_scale=None, fake=False, config=c),
         narrow, lambda x: R.quantize(x, scaling="row"), 2 * act + narrow_bytes, None),
        ("quantize per-tensor [E*N, D]", lambda c: lambda w: nearest.launch(
            w.view(-1, k), scaling="tensor", global_scale=None, fake=False, config=c),
         weights, lambda w: R.quantize(w.view(-1, k), scaling="tensor"),
         2 * wt + wt // 2 + wt // 16 + 4, 4 * wt + wt // 2 + wt // 16 + 4),
        ("quantize, given global scale [E*N, D]", lambda c: lambda ws: nearest.launch(
            ws[0], scaling="tensor", global_scale=ws[1], fake=False, config=c),
         scaled, lambda ws: R.quantize(ws[0], scaling="tensor", global_scale=ws[1]),
         2 * wt + wt // 2 + wt // 16, None),
        ("quantize per-expert [E, N, D]", lambda c: lambda w: nearest.launch(
            w, scaling=2, global_scale=None, fake=False, config=c),
         weights, lambda w: R.quantize(w, scaling=2),
         2 * wt + wt // 2 + wt // 16 + 4 * experts, 4 * wt + wt // 2 + wt // 16 + 4 * experts),
        ("fake-quant per-row", lambda c: lambda x: nearest.launch(
            x, scaling="row", global_scale=None, fake=True, config=c),
         acts, lambda x: R.dequantize(R.quantize(x, scaling="row"), bf16), 4 * act, None),
        ("dequantize -> bf16", lambda c: lambda t: dequant.launch(t, bf16, config=c),
         packed, lambda t: R.dequantize(t, bf16), nvfp4_bytes + 2 * act, None),
        ("guided-full fake-quant", lambda c: lambda xr: guided.launch(
            xr[0], xr[1], fake=True, config=c),
         list(zip(acts, rollouts, strict=True)),
         lambda xr: R.dequantize(rounding.round_guided_full(*xr), bf16),
         4 * act + nvfp4_bytes, None),
    ]  # fmt: skip
    configs = {name: tile_config(name) for name in (args.configs or "auto").split(",")}

    # Bit-exactness on a slice first: a fast wrong kernel is not a result.
    for name, make, inputs, ref, _, _ in ops:
        sliced = slice_input(inputs[0], 4 if args.quick else 64)
        want = ref(to_cpu(sliced))
        for config, tiles in configs.items():
            got = make(tiles)(sliced)
            if not same(got, want):
                sys.exit(f"{name} [{config}] does not match the reference bit for bit")

    copy_dst = torch.empty_like(acts[0])
    graph = torch.cuda.is_available()
    copy_ms = median_ms(copy_dst.copy_, acts, warmup=warmup, repeats=repeats, graph=graph)
    copy_gbs = 2 * act * 2 / copy_ms / 1e6
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        f"T={rows}, D={k}, E={experts}, N={n}; BF16 inputs. Copy baseline: {copy_gbs:.0f} GB/s "
        f"({copy_ms * 1e3:.0f} us for {4 * act / 1e6:.0f} MB moved). GPU us: CUDA-graph replay; "
        "eager us: one Python call, launch included.",
        "",
        "| op | config | GPU us | GB/s (minimal bytes) | % of copy | GB/s (bytes moved) | "
        "eager us | PyTorch ref us | speedup (eager) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, make, inputs, ref, minimal, moved in ops:
        ref_ms = median_ms(ref, inputs, warmup=1, repeats=3)
        for config, tiles in configs.items():
            fn = make(tiles)
            ms = median_ms(fn, inputs, warmup=warmup, repeats=repeats, graph=graph)
            eager_ms = median_ms(fn, inputs, warmup=warmup, repeats=repeats)
            gbs = minimal / ms / 1e6
            moved_gbs = f"{moved / ms / 1e6:.0f}" if moved else "="
            lines.append(
                f"| {name} | {config} | {ms * 1e3:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f} "
                f"| {moved_gbs} | {eager_ms * 1e3:.1f} | {ref_ms * 1e3:.0f} "
                f"| {ref_ms / eager_ms:.1f}x |"
            )
    report("quantize.md", lines)


def tile_config(spec: str) -> TileConfig | None:
    if spec == "auto":  # each launcher's own choice
        return None
    if spec in CONFIGS:
        return CONFIGS[spec]
    try:
        return TileConfig(*(int(part) for part in spec.split(":")))
    except (TypeError, ValueError):
        sys.exit(
            f"--configs: {spec!r} is neither one of {list(CONFIGS)} nor BLOCK_K:TILE:WARPS:STAGES"
        )


def slice_input(inp, rows: int):
    """The first rows (of each expert) of an op's input, keeping its layout."""
    from fp4rl.fp4.tensor import NVFP4Tensor

    if isinstance(inp, tuple):
        return tuple(slice_input(part, rows) for part in inp)
    if isinstance(inp, NVFP4Tensor):
        return inp.map(lambda t: t[:rows].contiguous())
    return inp[..., :rows, :].contiguous()


def to_cpu(inp):
    if isinstance(inp, tuple):
        return tuple(to_cpu(part) for part in inp)
    return inp.cpu() if isinstance(inp, torch.Tensor) else inp.map(lambda t: t.cpu())


def same(got, want) -> bool:
    """Bitwise: NVFP4 codes and scales, or float values with NaN matching NaN."""
    if isinstance(want, torch.Tensor):
        got = got.cpu()
        ints = got.view(torch.int16) == want.view(torch.int16)
        return bool((ints | (got.isnan() & want.isnan())).all())
    return got.map(lambda t: t.cpu()).equal(want)


if __name__ == "__main__":
    main()
