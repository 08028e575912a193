"""Forward+backward tokens/s of a Qwen3-30B-A3B-shaped MoE: QAT (NVFP4 experts) vs BF16.

One H200: ``python benchmarks/train_step.py`` (``--layers 8`` gives ~5.4B parameters). Every
layer is MoE and, in the QAT variants, FP4 (no BF16 boundary layers), which is the worst case
for the fake-quantization overhead. The loss is the chunked token log-probability the trainer
uses. Timed with CUDA events after warm-up; the median of the timed steps is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from _timing import report, run_header

from fp4rl.fp4 import compact
from fp4rl.model.attention import CausalAttention
from fp4rl.model.logprobs import token_logprobs
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import qwen3_30b_a3b
from fp4rl.model.sites import SiteRecords
from fp4rl.model.transformer import build_model

FP4_KV = PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0, kv_cache="nvfp4")
VARIANTS = {  # name: (precision, router replay, guidance: None | "full" | "compact")
    "bf16": (PrecisionConfig(experts="bf16"), False, None),
    "qat": (PrecisionConfig(bf16_first_layers=0, bf16_last_layers=0), False, None),
    "qat+kv": (FP4_KV, False, None),
    # The alignment variants: replayed routing, every FP4 site rounded to nearest or following
    # records (here the model's own codes from one forward, which cost the same to follow).
    "qat+kv replay": (FP4_KV, True, None),
    "qat+kv replay guided-full": (FP4_KV, True, "full"),
    "qat+kv replay guided-compact": (FP4_KV, True, "compact"),
}


def time_variant(config, variant, tokens_T, seq_lens, steps, warmup) -> tuple[float, int]:
    precision, replay, guidance_mode = variant
    model = build_model(config, precision, device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0.0, 0.02)
    num_params = sum(p.numel() for p in model.parameters())
    targets_T = torch.roll(tokens_T, -1)
    routing = guidance = None
    if replay or guidance_mode:
        records = SiteRecords()
        with torch.no_grad():
            model.hidden_states(tokens_T, CausalAttention(seq_lens, device="cuda"), capture=records)
        routing = torch.stack([records.routing[layer] for layer in model.moe_layers]).int()
        if guidance_mode:
            to_record = compact if guidance_mode == "compact" else (lambda t: t)
            guidance = {key: to_record(records.sites[key]) for key in model.guided_keys}

    def step():
        attn = CausalAttention(seq_lens, device="cuda")
        h = model.hidden_states(tokens_T, attn, routing=routing, guidance=guidance)
        loss = -token_logprobs(model.lm_head, h, targets_T).mean()
        loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), num_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    config = qwen3_30b_a3b(num_hidden_layers=args.layers, vocab_size=args.vocab)
    seq_lens = [args.seq_len] * args.seqs
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens_T = torch.randint(0, args.vocab, (sum(seq_lens),), device="cuda", generator=g)
    rows, base = [], None
    for name in args.variants.split(","):
        seconds, num_params = time_variant(
            config, VARIANTS[name], tokens_T, seq_lens, args.steps, args.warmup
        )
        tok_s = len(tokens_T) / seconds
        base = base or tok_s
        rows.append(
            f"| {name} | {num_params / 1e9:.2f} B | {seconds * 1e3:.1f} | {tok_s:,.0f} "
            f"| {tok_s / base:.3f} |"
        )
        torch.cuda.empty_cache()  # the variant's model is gone; give its memory back
    report(
        "train_step.md",
        [
            run_header("python benchmarks/train_step.py " + " ".join(sys.argv[1:])),
            "",
            f"{args.layers} layers, {len(tokens_T)} tokens/step ({args.seqs} x {args.seq_len}), "
            "forward+backward",
            "",
            "| variant | params | step ms | tokens/s | vs bf16 |",
            "|---|---|---|---|---|",
            *rows,
        ],
    )


if __name__ == "__main__":
    main()
