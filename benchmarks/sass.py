"""What the register kernels compile to for a GPU, read without one: registers, spilled bytes,
shared memory and the main loop's instructions by opcode.

No GPU needed (Triton compiles for the target and disassembles with the tools its wheel ships):
``python benchmarks/sass.py`` for sm_90, ``--arch 80`` for an A100. ``--cases`` picks some of
`CASES` (e.g. ``attention:16,gemm:w13:short``). Prints a markdown table, written to
``$OUT/sass.md`` when OUT is set.

The kernels: `paged_attention_registers` (decode attention, NVFP4 pages, 32 query / 4 KV heads of
128, pages of 16 tokens) at 16- and 32-token steps, `moe_gemm_registers` (the expert GEMM,
Qwen3-30B-A3B's w13 ``[1536, 2048]`` and w2 ``[2048, 768]``) at the launcher's four tiles, by
byte-table lookup and by arithmetic per code (and at the short and split tiles with x's rows
in `launch.permuted_rows`' order: ``gemm:w13:short:permuted``), and `moe_gemm_wgmma` (the same GEMM
on Hopper's warpgroup MMA, sm_90 only) at the launcher's four tiles (``wgmma:w13:ROWS``), and
`moe_gemm_specialized` (its warp-specialized form, sm_90 only: ``specialized:w13``, the
16:128:128 tile with 8 decoder warps; the loop counted is the decoders'). The loop is the
longest stretch of SASS between an instruction and a conditional branch back to it, read from
cuobjdump's listing of the whole kernel; `moe_gemm_registers` unrolls
its K loop at compile time (up to `UNROLL_MAX_STEPS` steps), and there the whole kernel is
counted and divided by its steps (the prologue and the store included). "per value" divides a
pass's instructions by the NVFP4 values a thread decodes in one pass (K and V for the
attention, weights for the GEMM).
Shared-memory instructions in the loop are counted apart: the register kernels are meant to
have none, the wgmma kernel only the stores of x's rows. A figure holds for the Triton printed
in the header; the GPU machine's may allocate registers differently.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Compiled, never interpreted (Gluon has no interpreter), whatever the caller's environment says:
# before anything imports triton.
os.environ.pop("TRITON_INTERPRET", None)

from _timing import report, run_header  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One compilation: a kernel, its constexprs and launch options, and how many NVFP4 values
    a thread decodes per pass of the loop."""

    kernel: str  # "attention", "gemm", "wgmma" or "specialized"
    constexprs: dict
    num_warps: int
    values_per_thread: int
    mma: int  # m16n8k16 products (wgmma: m64nNk16 instructions) one warp must issue per pass
    label: str
    steps: int = 0  # passes of a loop unrolled at compile time; 0: the SASS has the loop
    maxnreg: int = 0  # the launch's register cap, where it sets one


def attention_case(block_n: int) -> Case:
    d = 128
    # Scores S^T: BLOCK_N/16 key tiles x D/16 reduction steps (the 8 heads are one n8 tile);
    # O^T: three products (the probability's BF16 parts) x D/16 row tiles x BLOCK_N/16 steps.
    mma = (block_n // 16) * (d // 16) + 3 * (d // 16) * (block_n // 16)
    return Case(
        "attention", dict(G=8, D=d, PAGE=16, BLOCK_N=block_n, SPLIT=True, PDL=True), 1,
        2 * block_n * d // 32, mma, f"{block_n}-token steps",
    )  # fmt: skip


def gemm_case(weight: str, tile_name: str, lookup: bool, permuted: bool = False) -> Case:
    """`moe_gemm_registers` at one of the launcher's tiles, decoding by byte-table lookup or by
    arithmetic, x's rows in real order or (``permuted``) in `launch.permuted_rows`' order."""
    from fp4rl.kernels import moe_gemm_registers, moe_tiles

    n, k = {"w13": (1536, 2048), "w2": (2048, 768)}[weight]
    tile = {
        "short": moe_tiles.REGISTERS_SHORT_TILE,
        "medium": moe_tiles.REGISTERS_MEDIUM_TILE,
        "wide": moe_tiles.REGISTERS_WIDE_TILE,
        "split": moe_tiles.REGISTERS_SPLIT_TILE,
    }[tile_name]
    tile = tile.fitted(n, k)
    warps_n = min(tile.num_warps // tile.split_k, tile.block_n // 16)
    warps = warps_n * tile.split_k
    steps = k // (tile.block_k * tile.split_k)
    unroll = steps <= moe_gemm_registers.UNROLL_MAX_STEPS
    return Case(
        "gemm",
        dict(
            N=n,
            K=k,
            GATHER=False,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            BLOCK_E=128,
            PREFETCH=tile.num_stages >= 2,
            LOOKUP=lookup and tile.block_k >= 64,
            WARPS_N=warps_n,
            SPLIT=tile.split_k,
            CLAMP_ROWS=tile.clamp_rows,
            UNROLL=unroll,
            X_PERMUTED=permuted,
            PDL=True,
        ),  # fmt: skip
        warps,
        tile.block_n * tile.block_k // (32 * warps_n),
        # K steps x row tiles of 8 x the warp's m16 tiles of weight rows
        (tile.block_k // 16) * (tile.block_m // 8) * (tile.block_n // (16 * warps_n)),
        f"{weight} {tile.block_m}:{tile.block_n}:{tile.block_k}:{warps}"
        f"{f':split {tile.split_k}' if tile.split_k > 1 else ''} "
        f"{'lookup' if lookup else 'arithmetic'}{', x permuted' if permuted else ''}",
        steps=steps if unroll else 0,
    )


def wgmma_case(weight: str, index: int) -> Case:
    """`moe_gemm_wgmma` at the launcher's tile ``moe_tiles.WGMMA_TILES[index]``."""
    from fp4rl.kernels import moe_gemm_wgmma, moe_tiles

    n, k = {"w13": (1536, 2048), "w2": (2048, 768)}[weight]
    tile = moe_tiles.WGMMA_TILES[index][1].fitted(n, k)
    warps = tile.num_warps
    unroll = tile.block_m <= moe_gemm_wgmma.UNROLL_MAX_ROWS
    return Case(
        "wgmma",
        dict(N=n, K=k, GATHER=False, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
             BLOCK_K=tile.block_k, BLOCK_E=128, WARPS=warps,
             UNROLL=unroll, PDL=True),
        warps,
        tile.block_n * tile.block_k // (32 * warps),
        # K steps of 16 x the warp's m64 instructions (its warpgroup's 64 rows at a time)
        (tile.block_k // 16) * (tile.block_n // (16 * warps)),
        f"{weight} {tile.block_m}:{tile.block_n}:{tile.block_k}:{warps} wgmma",
        steps=k // tile.block_k if unroll else 0,
    )  # fmt: skip


def specialized_case(weight: str) -> Case:
    """`moe_gemm_specialized` at the 16:128:128 tile with 8 decoder warps and 2 stages."""
    from fp4rl.kernels import moe_gemm_specialized as ws

    n, k = {"w13": (1536, 2048), "w2": (2048, 768)}[weight]
    decoders, stages = 8, 2
    return Case(
        "specialized",
        dict(N=n, K=k, GATHER=False, BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, BLOCK_E=128,
             STAGES=stages, DECODERS=decoders, REGISTERS=ws.REGISTERS, PDL=True),
        ws.MMA_WARPS.value,
        # a pass of the decoders' loop: one step per stage
        stages * 128 * 128 // (32 * decoders),
        0,  # the decoders' loop has no MMA
        f"{weight} 16:128:128, {decoders} decoders, {stages} stages",
        maxnreg=ws.REGISTERS,
    )  # fmt: skip


CASES = {
    "attention:16": lambda: attention_case(16),
    "attention:32": lambda: attention_case(32),
    **{
        f"gemm:{w}:{t}{'' if lut else ':arith'}": (lambda w=w, t=t, lut=lut: gemm_case(w, t, lut))
        for w in ("w13", "w2")
        for t in ("short", "medium", "wide", "split")
        for lut in (True, False)
    },
    **{
        f"gemm:{w}:{t}:permuted": (lambda w=w, t=t: gemm_case(w, t, True, permuted=True))
        for w in ("w13", "w2")
        for t in ("short", "split")
    },
    **{
        f"wgmma:{w}:{rows}": (lambda w=w, i=i: wgmma_case(w, i))
        for w in ("w13", "w2")
        for i, rows in enumerate((16, 32, 64, 128))
    },
    "specialized:w13": lambda: specialized_case("w13"),
    "specialized:w2": lambda: specialized_case("w2"),
}

# Pointer arguments (all 16-byte aligned, as the launchers' tensors are) and scalars, by kernel.
SIGNATURES = {
    "attention": {
        "q_BHD": "*bf16", "k_pages": "*i32", "k_block_scale": "*u8", "k_amax": "*bf16",
        "v_pages": "*i32", "v_block_scale": "*u8", "v_amax": "*bf16",
        "table_BN": "*i32", "context_B": "*i32", "out_BHD": "*bf16", "part_m": "*fp32",
        "part_l": "*fp32", "part_o": "*fp32", "softmax_scale": "fp32", "num_kv_heads": "i32",
        "table_cols": "i32",
    },
    "gemm": {
        "x_AK": "*bf16", "codes_ENW": "*i32", "block_scale_ENB": "*u8", "scale_G": "*fp32",
        "counts_E": "*i64", "y_AN": "*bf16", "order_A": "*i64", "A": "i32", "E": "i32",
        "rows_per_group": "i32", "top_k": "i32",
    },
}  # fmt: skip
SIGNATURES["wgmma"] = SIGNATURES["specialized"] = SIGNATURES["gemm"]


def compile_case(case: Case, arch: int):
    """The compiled kernel for ``sm_<arch>`` (no device needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from fp4rl.kernels import (
        moe_gemm_registers,
        moe_gemm_specialized,
        moe_gemm_wgmma,
        paged_attention_registers,
    )

    fn = {
        "attention": paged_attention_registers._paged_decode_registers_kernel,
        "gemm": moe_gemm_registers._moe_gemm_registers_kernel,
        "wgmma": moe_gemm_wgmma._moe_gemm_wgmma_kernel,
        "specialized": moe_gemm_specialized._moe_gemm_specialized_kernel,
    }[case.kernel]
    signature = dict(SIGNATURES[case.kernel])
    signature.update({name: "constexpr" for name in case.constexprs})
    names = list(signature)
    source = GluonASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in case.constexprs.items()},
        attrs={
            (i,): [["tt.divisibility", 16]]
            for i, t in enumerate(signature.values())
            if t.startswith("*")
        },  # fmt: skip
    )
    options = dict(num_warps=case.num_warps, enable_fp_fusion=False, launch_pdl=True)
    if case.maxnreg:
        options["maxnreg"] = case.maxnreg
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def resources(cubin: bytes) -> dict[str, int]:
    """REG, STACK (spilled and local bytes) and SHARED of the one kernel in ``cubin``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED):(\d+)", out)}


def listing(cubin: bytes) -> list[tuple[int, str]]:
    """``(address, opcode)`` of every instruction of the one kernel in ``cubin``, predicates left
    out, a branch's target kept (``BRA 0x1220``), from cuobjdump's listing: it has every
    instruction, where Triton's own listing stops at an address of four hex digits."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    instructions = []
    for line in out.splitlines():
        m = re.match(
            r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]+)\s*(\S*)", line
        )
        if m:
            op = m.group(3)
            if op == "BRA" and m.group(2):  # a conditional branch: its target, for the loops
                op += " " + m.group(4).rstrip(";")
            instructions.append((int(m.group(1), 16), op))
    return instructions


def kernel_opcodes(instructions: list[tuple[int, str]]) -> collections.Counter:
    """Opcodes of the whole kernel (NOPs left out)."""
    return collections.Counter(op.split(" ")[0] for _, op in instructions if op != "NOP")


def loop_opcodes(instructions: list[tuple[int, str]]) -> collections.Counter:
    """Opcodes of the longest stretch between an address and a conditional branch back to it
    (an unconditional one is the retry of a wait placed out of line, not a loop's back edge)."""
    back_edges = [
        (int(op[4:], 16), address)
        for address, op in instructions
        if op.startswith("BRA 0x") and int(op[4:], 16) < address
    ]
    best = max(back_edges, key=lambda edge: edge[1] - edge[0], default=None)
    if best is None:
        return collections.Counter()
    return collections.Counter(
        op.split(" ")[0] for address, op in instructions if best[0] <= address <= best[1]
    )


# Opcodes the ALU pipe issues (logic, shifts, PRMT, LEA, integer adds and compares, min/max,
# selects: Nsight Compute's "alu" pipe from sm_80). It takes 16 lanes a cycle in each of a
# multiprocessor's four sub-partitions, two warp instructions a cycle in all, and it is what the
# NVFP4 decode loads most (BENCHMARKS.md). VIADD is left out: which pipe issues it is not
# documented.
ALU_PIPE = ("PRMT", "LOP3", "SHF", "LEA", "IADD3", "ISETP", "FSETP", "FMNMX", "SEL", "FSEL",
            "SGXT", "PLOP3")  # fmt: skip


def table_row(name: str, case: Case, arch: int) -> str:
    compiled = compile_case(case, arch)
    res = resources(compiled.asm["cubin"])
    instructions = listing(compiled.asm["cubin"])
    if case.steps:  # unrolled: the whole kernel, a step's share
        whole = kernel_opcodes(instructions)
        ops = collections.Counter({op: round(n / case.steps) for op, n in whole.items()})
    else:
        ops = loop_opcodes(instructions)
    total = sum(ops.values())
    shared = sum(n for op, n in ops.items() if op.startswith(("LDS", "STS", "LDSM", "STSM")))
    mma = sum(n for op, n in ops.items() if op.startswith(("HMMA", "HGMMA")))
    alu = sum(n for op, n in ops.items() if op.split(".")[0] in ALU_PIPE)
    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
    return (
        f"| {name} | {case.label} | {res.get('REG', 0)} | {res.get('STACK', 0)} | "
        f"{compiled.metadata.shared} | {total} | {total / case.values_per_thread:.2f} | "
        f"{alu / case.values_per_thread:.2f} | {mma} ({case.mma}) | {shared} | {top} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    parser.add_argument("--cases", default=",".join(CASES), help=f"some of {', '.join(CASES)}")
    args = parser.parse_args()
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        sys.exit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        f"Compiled for sm_{args.arch} without a GPU. Registers and stack bytes (spills) per "
        "thread, shared memory per program; the loop's SASS instructions, per NVFP4 value a "
        "thread decodes in a pass and those the ALU pipe issues (`ALU_PIPE`) per value (a "
        "kernel unrolled at compile time: the whole kernel over its steps), its "
        "MMA instructions (mma.sync, or wgmma) against those a pass needs, and how many of its "
        "instructions touch shared memory.",
        "",
        "| case | kernel | registers | stack B | shared B | loop instructions | per value | "
        "ALU pipe per value | MMA in loop (needed) | shared-memory ops in loop | "
        "most frequent |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in names:
        lines.append(table_row(name, CASES[name](), args.arch))
        print(lines[-1], flush=True)
    report("sass.md", lines)


if __name__ == "__main__":
    main()
