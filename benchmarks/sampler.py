"""Sampling one token per row at Qwen3's vocabulary: today's full-sort sampler against the
sampler that skips the sort for greedy and top-k rows, with their outputs checked for equality,
and against the draw that walks the CDF in token order (``cdf_order="token"``, no sort).

One H200 (about a minute): ``python benchmarks/sampler.py``; a CPU smoke check:
``python benchmarks/sampler.py --device cpu --vocab 4096 --batch 1,8 --repeats 2``. Prints a
markdown table and writes it to ``$OUT/sampler.md`` when OUT is set; exits 1 if any output
differs.

V = 151936 tokens, B in (1, 8, 64, 256, 512) rows, nine settings (temperature 1, and the same
with torch's sort and float64 passes in place of the sorted draw's kernels, their baseline; the
same in token order, by the fused kernel on a GPU and by torch's float64 scan, its baseline;
top_k 50 by the path the sampler picks, and by partial selection or by the sort whatever the
batch; top_p 0.95; greedy) over three kinds of logits: randn (flat) and randn * 4 (peaked,
closer to a trained LM's) in FP32, and randn * 4 in BF16, as the engine passes its lm_head's
logits (both samplers get the same BF16 tensor; temperature-1 rows of the new one sort it as
given, or on a GPU from 64 rows count its values instead). "today" is the
reference kept in tests/rollout/test_sampler.py (every row sorted, in FP32), "new" is
`fp4rl.rollout.sampler.sample`. A call is timed together with what the engine does right
after it, ``.tolist()`` of the three outputs (the step's readback), so host launch time counts:
CUDA events, median over repeats, logits rotated over enough buffers to exceed the L2. The same
run draws once more with fresh generators of the same seeds and compares tokens, logprobs and
raw logprobs bitwise; token-order rows draw other tokens by design, and are checked for their
logprobs instead: bitwise those of the logits at the tokens drawn.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import torch
from _timing import median_ms, report, run_header

from fp4rl.rollout import sampler as sampler_module
from fp4rl.rollout.config import SamplingParams
from fp4rl.rollout.sampler import make_generator, sample

SELECTS_TOP_K = sampler_module._selects_top_k  # the sampler's own rule
REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "rollout" / "test_sampler.py"
SETTINGS = {
    "temperature 1": SamplingParams(),
    "temperature 1, torch sort": SamplingParams(),
    "temperature 1, token order": SamplingParams(cdf_order="token"),
    "temperature 1, token order, torch scan": SamplingParams(cdf_order="token"),
    "top_k 50": SamplingParams(top_k=50),
    "top_k 50, selection": SamplingParams(top_k=50),
    "top_k 50, sort": SamplingParams(top_k=50),
    "top_p 0.95": SamplingParams(top_p=0.95),
    "greedy": SamplingParams(temperature=0),
}
LOGITS = {  # name: (scale, dtype)
    "randn": (1.0, torch.float32),
    "randn * 4": (4.0, torch.float32),
    "randn * 4, bf16": (4.0, torch.bfloat16),
}


def today_sampler():
    """`reference_sample` of the test file: today's sampler, kept there verbatim."""
    spec = importlib.util.spec_from_file_location("sampler_reference", REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference_sample


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cpu runs a smoke check")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch", default="1,8,64,256,512", help="rows per call, comma-separated")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU; --device cpu runs a smoke check")
    V = args.vocab
    samplers = {"today": today_sampler(), "new": sample}

    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        "| logits | B | sampling | today ms | new ms | today / new | outputs |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    all_equal = True
    for kind, (scale, dtype) in LOGITS.items():
        for B in [int(b) for b in args.batch.split(",")]:
            # Enough distinct buffers that no call finds its logits in L2 (2x 64 MB).
            count = (
                min(256, max(2, math.ceil(2 * 64e6 / (B * V * 4)))) if device.type == "cuda" else 2
            )
            g = torch.Generator(device="cpu").manual_seed(B)
            inputs = [
                (torch.randn(B, V, generator=g) * scale).to(device, dtype) for _ in range(count)
            ]
            for name, params in SETTINGS.items():
                # The token-order draw's fused kernel, or (the baseline) torch's float64 scan;
                # the sorted draw's kernels, or (the baseline) torch's sort and passes.
                sampler_module.TOKEN_DRAW_KERNEL = not name.endswith("torch scan")
                sampler_module.SORTED_DRAW_KERNELS = not name.endswith("torch sort")
                # Top-k rows by the path the sampler picks, or by the one named.
                forced = {"top_k 50, selection": True, "top_k 50, sort": False}.get(name)
                sampler_module._selects_top_k = (
                    SELECTS_TOP_K if forced is None else lambda rows, device, narrow, f=forced: f
                )
                times = {k: time_ms(fn, inputs, params, args.repeats) for k, fn in samplers.items()}
                verdict = compare(samplers, inputs[0], params)
                all_equal &= verdict in ("bitwise equal", "logprobs exact")
                lines.append(
                    f"| {kind} | {B} | {name} | {times['today']:.3f} | {times['new']:.3f} | "
                    f"{times['today'] / times['new']:.2f}x | {verdict} |"
                )
    report("sampler.md", lines)
    return 0 if all_equal else 1


def time_ms(sampler, inputs, params, repeats: int) -> float:
    B = inputs[0].shape[0]
    generators = [make_generator(0, 0, j) for j in range(B)]

    def step(logits_BV):
        out = sampler(logits_BV, [params] * B, generators)
        return out.token_ids_B.tolist(), out.logprobs_B.tolist(), out.raw_logprobs_B.tolist()

    return median_ms(step, inputs, warmup=2, repeats=repeats)


def compare(samplers, logits_BV, params) -> str:
    """Both samplers on the same logits and seeds: "bitwise equal", or what differs."""
    B = logits_BV.shape[0]
    outs = [
        fn(logits_BV, [params] * B, [make_generator(1, 0, j) for j in range(B)])
        for fn in samplers.values()
    ]
    today, new = ([t.cpu() for t in (o.token_ids_B, o.logprobs_B, o.raw_logprobs_B)] for o in outs)
    if params.cdf_order == "token":  # other tokens by design: their logprobs are checked
        want = torch.log_softmax(logits_BV.float(), -1).gather(1, outs[1].token_ids_B[:, None])[
            :, 0
        ]
        exact = torch.equal(new[1], want.cpu()) and torch.equal(new[2], want.cpu())
        return "logprobs exact" if exact else "DIFFER: logprobs not those of the logits"
    if all(torch.equal(a, b) for a, b in zip(today, new, strict=True)):
        return "bitwise equal"
    differ = int((today[0] != new[0]).sum())
    same = today[0] == new[0]
    gap = (today[1] - new[1])[same].abs().max().item() if same.any() else float("nan")
    return f"DIFFER: {differ}/{B} tokens, max logprob gap {gap:.3g} where equal"


if __name__ == "__main__":
    sys.exit(main())
