"""The Gluon register kernels, and the warp-specialized expert GEMM, compiled for sm_90 on any
machine (`benchmarks/sass.py`, through ``fp4rl bench sass``): what the GPU tests cannot show
off the GPU. Compiling checks every layout change the kernels assert to be a register renaming;
the SASS shows their loops free of shared memory, as designed (but for a few bytes of the
attention's row scales, the wgmma kernel's stores of x's rows, and the warp-specialized
decoders' handing of weights to the MMA), issuing exactly the MMA instructions a pass needs,
and the launchers' default tiles free of spills; x's rows read in the permuted order as in
the real one."""

import re

import pytest

pytest.importorskip("triton.experimental.gluon", reason="needs Triton's Gluon (Triton >= 3.4)")

from fp4rl.cli import main  # noqa: E402

CASES = [
    "attention:16",
    "gemm:w13:short",
    "gemm:w2:short",
    "gemm:w13:short:permuted",  # x's rows in `launch.permuted_rows`' order
    "gemm:w13:medium",  # rows clamped (GemmTile.clamp_rows)
    "gemm:w2:wide",
    "gemm:w13:short:arith",
    "wgmma:w13:16",
    "wgmma:w13:32",
    "wgmma:w2:64",
    "wgmma:w13:128",
    "specialized:w13",
]
NO_SPILLS = {
    "attention:16",
    "gemm:w13:short",
    "gemm:w2:short",
    "gemm:w13:short:permuted",
    "wgmma:w13:16",
    "wgmma:w13:32",
    "wgmma:w2:64",
    "specialized:w13",
}  # the launchers' tiles at decode batches and the 512-sequence steps, and the opt-in one
# Shared-memory instructions a loop may hold: none, but for the attention's V row scales (one
# FP32 value a row, computed by one lane and moved to the 8 lanes that hold the row's block:
# one store and one load a step, as Triton lowers that move), and the wgmma kernel's stores of
# a step's rows of x, a pair of values each (block_m * block_k / (32 * warps) / 2). The
# warp-specialized decoders pass weights to the MMA through shared memory by design: a pass of
# their loop (two steps) stores 16 times and loads back the words and scales, 30 such
# instructions under Triton 3.6 and 35 under 3.9.
SHARED_OPS = {
    "attention:16": 2,
    "wgmma:w13:16": 16 * 128 // 128 // 2,
    "wgmma:w13:32": 32 * 64 // 128 // 2,
    "wgmma:w2:64": 64 * 64 // 128 // 2,
    "wgmma:w13:128": 128 * 64 // 256 // 2,
    "specialized:w13": 36,
}


def test_register_kernels_compile_for_sm90_without_shared_memory_in_their_loops(capfd):
    assert main(["bench", "sass", "--arch", "90", "--cases", ",".join(CASES)]) == 0
    out, _ = capfd.readouterr()
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in CASES and len(cells) == 11:
            rows[cells[0]] = cells
    assert set(rows) == set(CASES), out
    for case, (_, _, regs, stack, _, loop, per_value, alu, mma, shared_ops, _) in rows.items():
        assert 0 < int(regs) <= 255, (case, regs)
        allowed = SHARED_OPS.get(case, 0)
        assert int(shared_ops) <= allowed, f"{case}: {shared_ops} shared-memory ops in the loop"
        assert int(loop) > 0 and float(per_value) > 0, (case, loop)
        assert 0 < float(alu) < float(per_value), (case, alu, per_value)
        issued, needed = re.fullmatch(r"(\d+) \((\d+)\)", mma).groups()
        assert issued == needed, f"{case}: {issued} MMA instructions in the loop, {needed} needed"
        if case in NO_SPILLS:
            assert int(stack) == 0, f"{case} spills {stack} bytes"
    # Permuted rows are read with the same 16-byte loads (a lost alignment hint: 2-byte loads,
    # about twice the registers): the same registers and instructions.
    assert rows["gemm:w13:short:permuted"][2:6] == rows["gemm:w13:short"][2:6]
