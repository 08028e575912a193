"""The experts' SwiGLU with its intermediate's FP4 site: the launcher's programs against other
rows-per-program and warps, outputs checked bitwise before anything is timed.

One H200 (seconds): ``python benchmarks/swiglu.py``; a CPU smoke check under Triton's
interpreter: ``python benchmarks/swiglu.py --device cpu``. Prints a markdown table and writes it
to ``$OUT/swiglu.md`` when OUT is set; exits 1 if a variant's output differs.

`fp4rl.kernels.swiglu.launch` on BF16 ``gate_up [A, 2I]`` (with ``quantize``, the NVFP4 engine's
path; ``--plain`` for the BF16 engine's SwiGLU alone), for decode and prefill row counts A
(top-8: A = 8 x tokens). Variants ``ROWS:WARPS`` (rows a program, warps a program) change no
bit; each is checked equal to the launcher's output first. Times: CUDA-graph replays of one
call per input, median over repeats, us per call, rotating over enough inputs to pass 128 MiB.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu runs a smoke check"
    )
    parser.add_argument("--rows", default="8,512,2048,4096,32768", help="row counts A")
    parser.add_argument("--intermediate", type=int, default=768, help="I (Qwen3-30B-A3B's)")
    parser.add_argument("--plain", action="store_true", help="without the FP4 site")
    parser.add_argument(
        "--variants", default="1:4,1:8,2:4,2:8,4:4,4:8", help="ROWS:WARPS, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=30)
    return parser.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":  # kernels must be decorated interpreted: before fp4rl.kernels loads
    os.environ["TRITON_INTERPRET"] = "1"

from _timing import median_ms, report, rotation_count, run_header  # noqa: E402

from fp4rl.kernels import swiglu  # noqa: E402


def main() -> int:
    cuda = ARGS.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU; --device cpu runs a smoke check under TRITON_INTERPRET")
    counts = [int(a) for a in ARGS.rows.split(",")]
    if not cuda:  # the interpreter runs each program in numpy: one small case, timed once
        counts = [a for a in counts if a <= 8][:1] or [8]
    variants = [tuple(int(v) for v in spec.split(":")) for spec in ARGS.variants.split(",")]
    I, quantize = ARGS.intermediate, not ARGS.plain  # noqa: E741 - the legend's name
    repeats = ARGS.repeats if cuda else 1
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        f"I = {I}, BF16, {'with' if quantize else 'without'} the FP4 site. CUDA-graph replay, "
        f"median of {repeats}, us per call. Variants ROWS:WARPS (rows a program, warps).",
        "",
        "| A | launcher (rows:warps) us | "
        + " | ".join(f"{r}:{w} us" for r, w in variants)
        + " | best vs launcher |",
        "|---:|---:|" + "---:|" * len(variants) + "---:|",
    ]
    ok = True
    g = torch.Generator().manual_seed(0)
    for A in counts:
        count = rotation_count(A * 2 * I * 2, most=64, cuda=cuda)
        inputs = [
            torch.randn(A, 2 * I, generator=g).to(torch.bfloat16).to(ARGS.device)
            for _ in range(count)
        ]
        want = swiglu.launch(inputs[0], quantize=quantize)
        fns = [lambda x: swiglu.launch(x, quantize=quantize)] + [
            lambda x, r=r, w=w: swiglu.launch(x, quantize=quantize, rows=r, num_warps=w)
            for r, w in variants
        ]
        for (r, w), fn in zip(variants, fns[1:], strict=True):
            if not torch.equal(fn(inputs[0]).view(torch.int16), want.view(torch.int16)):
                print(f"A = {A}: variant {r}:{w} differs from the launcher", file=sys.stderr)
                ok = False
        times = [median_ms(fn, inputs, warmup=3, repeats=repeats, graph=cuda) * 1e3 for fn in fns]
        own = f"{swiglu.rows_per_program(A, I)}:{swiglu.warps_for(A)}"
        lines.append(
            f"| {A} | {times[0]:.2f} ({own}) | "
            + " | ".join(f"{t:.2f}" for t in times[1:])
            + f" | {times[0] / min(times[1:]):.2f}x |"
        )
    report("swiglu.md", lines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
