"""Routed-expert GEMMs at Qwen3-30B-A3B's shapes: the NVFP4 grouped GEMM against today's paths.

One H200 (a couple of minutes): ``python benchmarks/moe.py``; a CPU smoke check of the script:
``python benchmarks/moe.py --quick`` (tiny shapes, Triton's interpreter). Prints markdown tables
and writes them to ``$OUT/moe.md`` when OUT is set.

Both GEMMs of a layer's experts (w13: N=1536, K=2048; w2: N=2048, K=768; 128 experts), for
decode batches of 1, 8, 64 and 256 tokens and a 4096-token prefill, top-8 of random router
logits. Compared in the same run:
  (a) ``moe_gemm.launch(..., registers=False)``: packed NVFP4 weights decoded in registers and
      handed to the tensor cores through shared memory, only touched experts read;
  (b) today's NVFP4 path (`PackedExperts`): ``dequantize`` of every expert to BF16, then the
      model's ``grouped_mm`` (``torch._grouped_mm`` on the GPU);
  (c) ``torch._grouped_mm`` on BF16 weights, the BF16 engine's path before (d);
  (d) ``moe_gemm.launch`` on the same BF16 weights: the program of (a), its weight tiles loaded
      as they lie (the launcher's BF16 tile, and the tiles of ``--bf16-configs``);
  (e) ``moe_gemm.launch(..., registers=True)`` on the packed weights of (a): the weights decoded
      into the tensor cores' register operands (`moe_gemm_registers`, GPU only), the tiles of
      ``--register-configs`` ("auto": `moe_tiles.register_config_for`'s). The launcher's own
      choice is (e) up to `moe_tiles.REGISTERS_MAX_ROWS_PER_EXPERT` rows per expert, else (a).
Every variant is first checked against the plain-PyTorch twin (``moe_gemm.reference_gemm``).
Times are CUDA-graph replays (the GPU's time) after warm-up, median over repeats, rotating over
``--layers`` sets of weights, rows and routing so that no call finds its experts in L2 (with
``--hot``, every call of a replay on the first set: the L2-hot figure); inputs
are random, never zeros. The roofline beside each time is the bytes that must move (distinct
experts touched x their bytes, FP4 packed for (a)/(b), BF16 for (c), plus x read and y written)
over a device-to-device copy measured in the same run, or the FLOPs over a BF16 matmul measured
in the same run, whichever is longer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

if not torch.cuda.is_available():  # --quick on a CPU: kernels must be decorated interpreted
    os.environ["TRITON_INTERPRET"] = "1"

from _timing import copy_bandwidth, median_ms, report, run_header  # noqa: E402

from fp4rl import ops  # noqa: E402
from fp4rl.kernels import launch, moe_gemm, moe_tiles  # noqa: E402
from fp4rl.kernels.moe_tiles import GemmTile  # noqa: E402
from fp4rl.model.experts import grouped_mm  # noqa: E402

TOP_K = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes; runs on a CPU")
    parser.add_argument("--tokens", default="1,8,64,256,4096", help="token counts (x top-8)")
    parser.add_argument("--layers", type=int, default=8, help="weight/routing sets rotated over")
    parser.add_argument(
        "--hot", action="store_true", help="every launch of a replay on the first set: after "
        "the first, its experts' weights are in L2 where they fit (what prefetching them would "
        "at best give)"
    )  # fmt: skip
    parser.add_argument(
        "--configs",
        default="",
        help="extra tiles for (a), BLOCK_M:BLOCK_N:BLOCK_K:WARPS:STAGES or auto, comma-separated; "
        "suffix '+acc' puts the global scale on the accumulator (not the contract)",
    )
    parser.add_argument(
        "--bf16-configs",
        default="16:64:128:4:4,16:64:64:4:6,16:128:128:4:4,32:64:128:4:4,16:32:128:4:4",
        help="tiles for (d), BLOCK_M:BLOCK_N:BLOCK_K:WARPS:STAGES, comma-separated",
    )
    parser.add_argument(
        "--register-configs",
        default="auto,16:64:128:4:2,16:64:128:4:1,16:128:128:4:2,8:64:256:4:2,16:64:64:4:2,"
        "32:64:128:4:2,16:128:64:8:2",
        help="tiles for (e), BLOCK_M:BLOCK_N:BLOCK_K:WARPS:STAGES[:SPLIT_K[:CLAMP[:WGMMA"
        "[:DECODERS]]]] or auto (STAGES >= 2: the next step's words loaded ahead; SPLIT_K of the "
        "warps share each column, each with its own BLOCK_K of a step; CLAMP 1: "
        "GemmTile.clamp_rows; WGMMA 1: the warpgroup MMA's program, Hopper only; DECODERS 4 or "
        "8: its warp-specialized program, STAGES its ring's buffers), "
        "comma-separated; suffix '+lut' decodes by byte-table "
        "lookup, '+arith' by arithmetic per code (moe_gemm_registers.LOOKUP; no suffix: its "
        "default); '+perm' reads x's rows stored in launch.permuted_rows' order, "
        "permuted ahead of the timing (a tile on the warpgroup MMA has no such variant: '-'); "
        "ignored without a GPU",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.quick:
        sys.exit("needs a CUDA GPU; --quick runs a CPU smoke check under TRITON_INTERPRET")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    experts = 8 if args.quick else 128
    shapes = {"w13": (64, 128), "w2": (128, 64)} if args.quick else {
        "w13": (1536, 2048), "w2": (2048, 768)
    }  # fmt: skip
    tokens = [1, 4] if args.quick else [int(t) for t in args.tokens.split(",")]
    layers = 1 if args.quick else args.layers
    warmup, repeats = (1, 1) if args.quick else (3, 15)
    variants = {"auto": (None, False)}
    for spec in filter(None, args.configs.split(",")):
        tile, _, acc = spec.partition("+")
        tile = None if tile == "auto" else GemmTile(*(int(v) for v in tile.split(":")))
        variants[spec] = (tile, acc == "acc")
    bf16_variants = {"auto": None}
    for spec in filter(None, args.bf16_configs.split(",")):
        bf16_variants[spec] = GemmTile(*(int(v) for v in spec.split(":")))
    register_variants = {}
    for spec in filter(None, args.register_configs.split(",") if cuda else []):
        tile, *suffixes = spec.split("+")
        unknown = set(suffixes) - {"lut", "arith", "perm"}
        if unknown or {"lut", "arith"} <= set(suffixes):
            sys.exit(f"--register-configs {spec}: suffixes are +lut or +arith, and +perm")
        register_variants[spec] = (
            None if tile == "auto" else register_tile(tile),
            True if "lut" in suffixes else False if "arith" in suffixes else None,
            "perm" in suffixes,
        )
    torch.manual_seed(0)

    copy_gbs, matmul_tflops = ceilings(device, args.quick)
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        f"E={experts}, top-{TOP_K}, random routing; "
        + ("one weight set, L2-hot" if args.hot else f"{layers} weight sets rotated")
        + ". Ceilings "
        f"measured in this run: device copy {copy_gbs:.0f} GB/s (read + write; the best of "
        f"512, 256 and 64 MiB copies), BF16 matmul "
        f"{matmul_tflops:.0f} TFLOP/s. Times: CUDA-graph replay, median of {repeats}, us.",
        "",
        "| GEMM | tokens | rows | experts touched | (a) NVFP4 kernel us | roofline us | % of "
        "roofline | (b) dequant + grouped_mm us | (c) BF16 grouped_mm us | BF16 roofline us | "
        "(a) vs (b) | (a) vs (c) | (d) BF16 kernel us | (c) / (d) | (a) vs (d) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    bf16_sweep = [
        "",
        "Tiles of (d), BF16 weights (BLOCK_M:BLOCK_N:BLOCK_K:WARPS:STAGES), us:",
        "",
        "| GEMM | tokens | (c) grouped_mm | " + " | ".join(bf16_variants) + " |",
        "|---|---:|---:|" + "---:|" * len(bf16_variants),
    ]
    register_sweep = [
        "",
        "Tiles of (e), NVFP4 weights decoded into the MMA's registers (BLOCK_M:BLOCK_N:BLOCK_K:"
        "WARPS:STAGES[:SPLIT_K]), us, beside (a) and (d) from the same run:",
        "",
        "| GEMM | tokens | (a) auto | (d) auto | "
        + " | ".join(register_variants)
        + " | best (e) vs (a) | best (e) vs (d) |",
        "|---|---:|---:|---:|" + "---:|" * len(register_variants) + "---:|---:|",
    ]
    sweep = [
        "",
        "Tiles of (a) (BLOCK_M:BLOCK_N:BLOCK_K:WARPS:STAGES; '+acc': global scale on the "
        "accumulator, not the contract), us:",
        "",
        "| GEMM | tokens | " + " | ".join(variants) + " |",
        "|---|---:|" + "---:|" * len(variants),
    ]
    for name, (n, k) in shapes.items():
        w_bf16 = [(torch.randn(experts, n, k, device=device) * 0.02).to(torch.bfloat16)
                  for _ in range(layers)]  # fmt: skip
        packed = [ops.quantize(w, scaling=2) for w in w_bf16]
        for t in tokens:
            row, tiles, bf16_tiles, register_tiles = measure(
                name, t, w_bf16, packed, variants, bf16_variants, register_variants,
                (copy_gbs, matmul_tflops), warmup=warmup, repeats=repeats, hot=args.hot,
            )  # fmt: skip
            lines.append(row)
            sweep.append(tiles)
            bf16_sweep.append(bf16_tiles)
            register_sweep.append(register_tiles)
            print(register_tiles, flush=True)
            print(row, flush=True)
        del w_bf16, packed
    end_gbs, end_tflops = ceilings(device, args.quick)
    lines.insert(3, f"The same ceilings measured again after the last row: {end_gbs:.0f} GB/s, "
                 f"{end_tflops:.0f} TFLOP/s.")  # fmt: skip
    report("moe.md", lines + sweep + bf16_sweep + (register_sweep if register_variants else []))


def measure(
    name, t, w_bf16, packed, variants, bf16_variants, register_variants, ceiling, *, warmup,
    repeats, hot=False,
):  # fmt: skip
    """(main table row, tile sweep row, BF16 tile sweep row, register tile sweep row) for one
    GEMM shape at t tokens."""
    copy_gbs, matmul_tflops = ceiling
    experts, n, k = w_bf16[0].shape
    device = w_bf16[0].device
    sets = []
    for w, p in zip(w_bf16, packed, strict=True):
        logits = torch.randn(t, experts, device=device)
        counts = torch.bincount(logits.topk(TOP_K, dim=-1).indices.flatten(), minlength=experts)
        x = torch.randn(t * TOP_K, k, device=device).to(torch.bfloat16)
        sets.append((x, p, w, counts, {}))  # {K step: x's rows permuted} for +perm variants
    if hot:
        sets = sets[:1] * len(sets)
    rows = t * TOP_K
    touched = statistics.mean(int((s[3] > 0).sum()) for s in sets)
    acts = rows * k * 2 + rows * n * 2
    floor_us = 2 * rows * n * k / (matmul_tflops * 1e6)  # FLOPs / (TFLOP/s), in us
    fp4_roof = max(1e-3 * (touched * packed[0].nbytes / experts + acts) / copy_gbs, floor_us)
    bf16_roof = max(1e-3 * (touched * n * k * 2 + acts) / copy_gbs, floor_us)

    def fp4_today(s):
        return grouped_mm(s[0], ops.dequantize(s[1], torch.bfloat16), s[3])

    def bf16_today(s):  # the BF16 engine's path before its own kernel: torch._grouped_mm
        if not s[0].is_cuda:
            return grouped_mm(s[0], s[2], s[3])
        offsets = s[3].cumsum(0).to(torch.int32)
        return torch._grouped_mm(s[0], s[2].transpose(-2, -1), offs=offsets)

    kernels = {
        spec: (lambda s, tile=tile, acc=acc: moe_gemm.launch(
            s[0], s[1], s[3], config=tile, global_scale_on_accumulator=acc, registers=False))
        for spec, (tile, acc) in variants.items()
    }  # fmt: skip
    bf16_kernels = {
        spec: (lambda s, tile=tile: moe_gemm.launch(s[0], s[2], s[3], config=tile))
        for spec, tile in bf16_variants.items()
    }  # fmt: skip
    # Rows in `permuted_rows`' order for the +perm variants, permuted ahead of the timing; a
    # variant whose tile runs on the warpgroup MMA reads no such rows and is left out.
    register_kernels = {}
    for spec, (tile, lookup, permuted) in register_variants.items():
        step = permuted_step(tile, t * TOP_K, experts, n, k, device) if permuted else None
        if permuted and step is None:
            continue
        for s in sets if step is not None else ():
            s[4].setdefault(step, launch.permuted_rows(s[0], step))
        register_kernels[spec] = lambda s, tile=tile, lookup=lookup, step=step: register_launch(
            s, tile, lookup, step
        )
    # Correct first: every variant against its twin on the first set.
    x, p, w, counts, _ = sets[0]
    want = moe_gemm.reference_gemm(x, p, counts)
    registers = [(f"registers {spec}", fn) for spec, fn in register_kernels.items()]
    for label, fn in [*kernels.items(), ("dequant + grouped_mm", fp4_today), *registers]:
        check(label, fn(sets[0]), want, f"{name} {t} tokens")
    bf16_want = bf16_twin(x, w, counts)
    for label, fn in [("BF16 grouped_mm", bf16_today), *bf16_kernels.items()]:
        check(label, fn(sets[0]), bf16_want, f"BF16 weights, {name} {t} tokens")

    def us(fn):
        return 1e3 * median_ms(
            fn, sets, warmup=warmup, repeats=repeats, graph=device.type == "cuda"
        )

    times = {spec: us(fn) for spec, fn in kernels.items()}
    today, bf16, ours = us(fp4_today), us(bf16_today), times["auto"]
    bf16_times = {spec: us(fn) for spec, fn in bf16_kernels.items()}
    bf16_ours = bf16_times["auto"]
    register_times = {spec: us(fn) for spec, fn in register_kernels.items()}
    best = min(register_times.values(), default=float("nan"))
    register_tiles = (
        f"| {name} | {t} | {ours:.1f} | {bf16_ours:.1f} | "
        + "".join(
            f"{register_times[spec]:.1f} | " if spec in register_times else "- | "
            for spec in register_variants
        )
        + f"{ours / best:.2f}x | {bf16_ours / best:.2f}x |"
    )
    row = (
        f"| {name} | {t} | {rows} | {touched:.1f} | {ours:.1f} | {fp4_roof:.1f} | "
        f"{100 * fp4_roof / ours:.0f} | {today:.1f} | {bf16:.1f} | {bf16_roof:.1f} | "
        f"{today / ours:.2f}x | {bf16 / ours:.2f}x | {bf16_ours:.1f} | {bf16 / bf16_ours:.2f}x | "
        f"{bf16_ours / ours:.2f}x |"
    )
    tiles = f"| {name} | {t} | " + " | ".join(f"{v:.1f}" for v in times.values()) + " |"
    bf16_tiles = f"| {name} | {t} | {bf16:.1f} | " + " | ".join(
        f"{v:.1f}" for v in bf16_times.values()
    ) + " |"  # fmt: skip
    return row, tiles, bf16_tiles, register_tiles


def register_tile(spec: str) -> GemmTile:
    """A register tile from
    BLOCK_M:BLOCK_N:BLOCK_K:WARPS:STAGES[:SPLIT_K[:CLAMP[:WGMMA[:DECODERS]]]]."""
    ints = [int(v) for v in spec.split(":")]
    return GemmTile(*ints[:6], *(bool(v) for v in ints[6:8]), *ints[8:])


def register_launch(s, tile: GemmTile | None, lookup: bool | None, step: int | None = None):
    """(e) with the decode by byte tables (``lookup``), by arithmetic per code, or (None) the
    module's choice; with ``step``, on x's rows permuted in K steps of that width."""
    x, how = (s[0], {}) if step is None else (s[4][step], {"x_permuted_by": step})
    if lookup is None:
        return moe_gemm.launch(x, s[1], s[3], config=tile, registers=True, **how)
    program = moe_gemm_registers()
    before = program.LOOKUP
    program.LOOKUP = lookup
    try:
        return moe_gemm.launch(x, s[1], s[3], config=tile, registers=True, **how)
    finally:
        program.LOOKUP = before


def moe_gemm_registers():
    """The register kernel's module (Gluon: imported only where a GPU runs it)."""
    from fp4rl.kernels import moe_gemm_registers

    return moe_gemm_registers


def permuted_step(tile: GemmTile | None, rows: int, experts: int, n: int, k: int, device):
    """The K step x's rows are permuted in for a +perm variant of ``tile`` (None: the
    launcher's), or None where that tile runs on the warpgroup MMA."""
    if tile is None:
        wgmma = moe_gemm.on_warpgroup_mma(device, n, k)
        tile = moe_tiles.register_config_for(rows, experts, k, wgmma=wgmma)
    return None if tile.wgmma else tile.fitted(n, k).block_k


def bf16_twin(x_AK: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Each expert's rows times its BF16 weight, FP32 sums, BF16 out (as `reference_gemm`)."""
    groups = x_AK.split(counts_E.tolist())
    return torch.cat([(x.float() @ w.float().T).to(torch.bfloat16)
                      for x, w in zip(groups, w_ENK, strict=True)])  # fmt: skip


def check(label: str, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same function as the twin: BF16 outputs of FP32 sums, within the BF16 rounding."""
    err = float((got.float() - want.float()).norm() / want.float().norm())
    if not err < 2.0**-8:
        sys.exit(f"{label}, {what}: relative error {err:.3g} against the twin")


def ceilings(device: str, quick: bool) -> tuple[float, float]:
    """(device copy GB/s counting read + write, BF16 matmul TFLOP/s), measured now. The matmul
    goes first: it also brings the clocks up from idle (a copy timed first, on a GPU that had
    idled at 375 MHz, ran at two thirds of its later rate)."""
    m = 256 if quick else 8192
    a, b = (torch.randn(m, m, device=device).to(torch.bfloat16) for _ in range(2))
    ms = median_ms(lambda _: a @ b, [None], warmup=20, repeats=20)
    tflops = 2 * m**3 / ms / 1e9
    copy_gbs = copy_bandwidth(device, (512, 256, 64), warm_up=False)  # the matmul warmed up
    size = 2**20 if quick else 2**28  # BF16 elements per buffer: 512 MiB
    bufs = [torch.randn(size, device=device).to(torch.bfloat16) for _ in range(3)]
    read_ms = median_ms(torch.amax, bufs, warmup=10, repeats=20, graph=torch.cuda.is_available())
    print(f"read-only (amax) GB/s: {size * 2 / read_ms / 1e6:.0f}", flush=True)
    return copy_gbs, tflops


if __name__ == "__main__":
    main()
