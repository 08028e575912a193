"""One GRPO step of a Qwen3-30B-A3B-shaped MoE, NVFP4 rollout vs BF16 rollout, same run.

    python benchmarks/grpo_step.py                        # one H200, 4 layers
    python benchmarks/grpo_step.py --device cpu --layers 2 --hidden 64 --prompts 2 --n 2 \\
        --prompt-len 8 --max-tokens 4                     # smoke check

Each variant builds its trainer (QAT model, BF16 parameters, FP32 masters and AdamW moments) and
a colocated engine on one device, loads the engine by a refit, then times ``--steps`` whole
steps (the first compiles kernels and is reported apart; the medians of the others): rollout
(random prompts, n samples each, every sample ``--max-tokens`` long), reward (a stand-in: the
parity of each sample's token sum, so that groups have spread), advantages, one update of
micro-batches with replay (and compact guidance for NVFP4), refit. Every layer is MoE and, in
the NVFP4 variant, FP4 experts and FP4 KV (no BF16 boundary layers). Wall-clock seconds with a
device sync at each phase's end. ``--keep-graphs 1,0`` runs each rollout with the engine's CUDA
graphs kept across its release of the KV pages (`EngineConfig.keep_graphs`, the default) and
captured again in every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch
from _timing import run_header

from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import qwen3_30b_a3b
from fp4rl.model.transformer import build_model, init_weights
from fp4rl.refit import RefitReceiver, refit_records
from fp4rl.rollout import Engine, EngineConfig, SamplingParams
from fp4rl.train.grpo import GrpoConfig, group_advantages
from fp4rl.train.optim import MasterAdamW, OptimConfig
from fp4rl.train.step import grpo_update

GUIDANCE = {"bf16": None, "nvfp4": "compact"}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--micro-batch-seqs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="steps per row; the first is warm-up")
    parser.add_argument(
        "--keep-graphs", default="1", help="comma-separated EngineConfig.keep_graphs values "
        "(1: the engine's graphs outlive release_kv; 0: captured again each step), a row each"
    )  # fmt: skip
    parser.add_argument("--device", default="cuda", help="cpu runs a smoke check")
    parser.add_argument("--hidden", type=int, default=None, help="override (smoke checks)")
    return parser.parse_args()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(trainer, engine, receiver, optimizer, prompts, args, seed) -> dict[str, float]:
    device, times = engine.layout.device, {}
    start = time.perf_counter()
    sampling = SamplingParams(n=args.n, max_tokens=args.max_tokens, ignore_eos=True, seed=seed)
    stats = {}
    completions = engine.generate(prompts, sampling, stats=stats)
    sync(device)
    times["rollout"] = time.perf_counter() - start
    times["captured"] = stats["graphs_captured"]
    start = time.perf_counter()
    rewards = torch.tensor([float(sum(c.completion_ids) % 2) for c in completions])
    adv, _ = group_advantages(rewards.view(len(prompts), args.n), normalize_std=False)
    times["reward"] = time.perf_counter() - start
    start = time.perf_counter()
    engine.release_kv()
    grpo_update(
        trainer,
        optimizer,
        completions,
        adv.flatten().tolist(),
        config=GrpoConfig(),
        replay=True,
        guided=engine.config.guidance is not None,
        temperature=1.0,
        micro_batch_seqs=args.micro_batch_seqs,
    )
    sync(device)
    times["train"] = time.perf_counter() - start
    start = time.perf_counter()
    receiver.receive(refit_records(trainer, policy_version=engine.policy_version + 1))
    engine.acquire_kv()
    sync(device)
    times["refit"] = time.perf_counter() - start
    times["tokens"] = sum(len(c.completion_ids) for c in completions)
    return times


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    shrink = {} if args.hidden is None else dict(
        hidden_size=args.hidden, vocab_size=512, num_experts=8, moe_intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    )  # fmt: skip
    config = qwen3_30b_a3b(num_hidden_layers=args.layers, max_position_embeddings=4096, **shrink)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (args.prompts, args.prompt_len), generator=g)
    prompts = prompts.tolist()
    engine_config = EngineConfig(
        kv_memory_bytes=(16 << 30) if device.type == "cuda" else (64 << 20),
        max_model_len=args.prompt_len + args.max_tokens,
        max_num_seqs=args.prompts * args.n,
        max_num_batched_tokens=max(8192, args.prompt_len + args.max_tokens),
        capture_routing=True,
    )
    print(run_header(" ".join(["python", *sys.argv])))
    print(
        f"\n{args.layers} layers, {args.prompts} prompts x {args.n} samples, prompt "
        f"{args.prompt_len} + {args.max_tokens} new tokens, micro-batches of "
        f"{args.micro_batch_seqs} sequences\n"
    )
    rows, base = [], None
    keeps = [bool(int(k)) for k in args.keep_graphs.split(",")]
    for variant, keep in [(v, k) for v in ("bf16", "nvfp4") for k in keeps]:
        precision = PrecisionConfig(
            experts=variant, kv_cache=variant, bf16_first_layers=0, bf16_last_layers=0
        )
        trainer = build_model(config, precision, fp4_experts="qat", device=device)
        init_weights(trainer, std=0.02, seed=0)
        packed = build_model(config, precision, fp4_experts="packed", device=device)
        engine = Engine(
            packed,
            dataclasses.replace(engine_config, guidance=GUIDANCE[variant], keep_graphs=keep),
        )
        receiver = RefitReceiver(engine)
        receiver.receive(refit_records(trainer, policy_version=1))
        optimizer = MasterAdamW(trainer.parameters(), OptimConfig(lr=1e-6))
        first, *timed = [
            one_step(trainer, engine, receiver, optimizer, prompts, args, seed=1 + s)
            for s in range(max(2, args.steps))
        ]
        t = {key: statistics.median(step[key] for step in timed) for key in timed[0]}
        total = t["rollout"] + t["reward"] + t["train"] + t["refit"]
        base = base or t["rollout"]
        rows.append(
            f"| {variant} | {keep} | {t['rollout']:.2f} | {t['reward']:.3f} | {t['train']:.2f} | "
            f"{t['refit']:.3f} | {total:.2f} | {t['tokens'] / t['rollout']:,.0f} | "
            f"{base / t['rollout']:.2f} | {t['captured']:.0f} | "
            f"{first['rollout'] + first['train']:.1f} |"
        )
        del trainer, packed, engine, receiver, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(
        "| rollout | keep_graphs | rollout s | reward s | train s | refit s | step s "
        "| rollout tok/s | rollout speed vs the first row | graphs captured | first step "
        "(rollout+train) s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
