"""The cost of the trainer's attention backends (`align.trainer_forward`), forward + backward.

    python benchmarks/trainer_attention.py [--device cuda] [--heads 32 4] [--head-dim 128]
        [--seqs 64] [--prompt 256] [--completion 768] [--prompts-shared 8]

One layer's attention over a packed batch of ``--seqs`` sequences (a prompt of ``--prompt``
tokens shared by ``--prompts-shared`` samples, then ``--completion`` tokens each), BF16 q, k
and v: "packed" (SDPA in BF16), "packed_fp32" (SDPA in FP32, the output rounded to BF16) and,
on the CPU only, "engine" (`EngineOrderAttention`). The time is the median of ``--repeats``
calls of forward + backward of the output's sum, after one warm-up (CUDA events on the GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fp4rl.model.attention import Bf16KV, CausalAttention, EngineOrderAttention, NewKV


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--heads", type=int, nargs=2, default=[4, 2], metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=7)
    parser.add_argument("--completion", type=int, default=3)
    parser.add_argument("--prompts-shared", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    (Hq, Hkv), D = args.heads, args.head_dim
    n, P, C = args.seqs, args.prompt, args.completion
    seq_lens, prompts = [P + C] * n, [P] * n
    leaders = [b - b % args.prompts_shared for b in range(n)]
    T = n * (P + C)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(T, h, D, generator=g, device=device, dtype=torch.bfloat16)
        for h in (Hq, Hkv, Hkv)
    )
    backends = {
        "packed": CausalAttention(seq_lens, device=device),
        "packed_fp32": CausalAttention(seq_lens, fp32=True, device=device),
    }
    if device.type == "cpu":
        backends["engine"] = EngineOrderAttention(
            seq_lens, prompts, prefilled_by=leaders, device=device
        )
    print(f"{n} sequences of {P} + {C} tokens, heads {Hq}/{Hkv}, head dim {D}, {device}")
    for name, backend in backends.items():

        def step(backend=backend):
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            backend.attend(0, qq, NewKV(kk, vv, Bf16KV())).float().sum().backward()

        step()
        seconds = statistics.median(timed(step, device) for _ in range(args.repeats))
        print(f"{name}: {1e3 * seconds:.2f} ms forward + backward")


if __name__ == "__main__":
    main()
