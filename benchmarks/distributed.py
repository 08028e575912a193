"""GRPO steps of a Qwen3-30B-A3B-shaped MoE on one GPU, then on N GPUs of one host (torchrun,
FSDP2 trainer, one colocated engine per rank), with the same global batch and seeds.

    python benchmarks/distributed.py --gpus 2 --layers 8          # two H200s of one host
    python benchmarks/distributed.py --gpus 2 --layers 8 --gradient-sync update  # one reduce
    python benchmarks/distributed.py --gpus 2 --layers 8 --keep-gathered   # one gather per update
    python benchmarks/distributed.py --gpus 2 --layers 20 --no-baseline   # memory: layers that
                                        # fit on 2 GPUs, not on 1
    python benchmarks/distributed.py --device cpu --gpus 2 --layers 2 --hidden 64 \\
        --prompts 4 --samples 4 --prompt-len 8 --max-tokens 4           # smoke check, gloo

The driver runs the worker twice: as one plain process (the single-process path, `MasterAdamW`,
no process group), then under ``torchrun --standalone --nproc-per-node N``. Each run builds the
trainer (QAT model, BF16 compute, FP32 masters and AdamW moments: sharded across the ranks) and
an NVFP4 engine per rank loaded by a refit, then times ``--steps`` whole steps: rollout (random
prompts, each rank its share, every sample ``--max-tokens`` long), reward (a stand-in: the
parity of each sample's token sum), advantages over the whole batch, one update of micro-batches
of one group each (replay, compact guidance), refit (gathered one layer at a time). The sharded
update reduce-scatters its gradients as ``--gradient-sync`` says (``run.gradient_sync``:
"update", once per update; "micro_batch", in each, the default) and, with ``--keep-gathered``
(``run.keep_gathered``), gathers its parameters once per update; the header says which. The first
step compiles kernels and is reported apart. A phase's time is its slowest rank's, wall clock
with a device sync at its end; peak memory is each rank's ``max_memory_allocated``.

It prints, per run: rollout tokens/s, trained samples/s, refit s, peak GiB per GPU, and how the
N-GPU run agrees with the one-GPU run: rewards per step, the largest relative loss difference,
and the share of weight tensors bitwise equal after the last step (SHA-256 of each).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import get_args

import torch
from _timing import run_header

from fp4rl import distributed
from fp4rl.loop import weights_of
from fp4rl.model.precision import PrecisionConfig
from fp4rl.model.presets import qwen3_30b_a3b
from fp4rl.model.transformer import build_model, init_weights
from fp4rl.refit import RefitReceiver
from fp4rl.rollout import Engine, EngineConfig, SamplingParams
from fp4rl.train.grpo import GrpoConfig, group_advantages
from fp4rl.train.optim import MasterAdamW, OptimConfig
from fp4rl.train.step import GradientSync, grpo_update

PRECISION = PrecisionConfig(
    experts="nvfp4", kv_cache="nvfp4", bf16_first_layers=0, bf16_last_layers=0
)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the second run")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8, help="per prompt")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="the first is warm-up")
    parser.add_argument("--device", default="cuda", help="cpu runs a smoke check over gloo")
    parser.add_argument("--hidden", type=int, default=None, help="override (smoke checks)")
    parser.add_argument(
        "--no-baseline", action="store_true", help="only the N-GPU run (a model one GPU can't hold)"
    )
    parser.add_argument(
        "--gradient-sync",
        choices=get_args(GradientSync),
        default="micro_batch",
        help="when the sharded update reduce-scatters (run.gradient_sync; default micro_batch)",
    )
    parser.add_argument(
        "--keep-gathered",
        action="store_true",
        help="the sharded update gathers its parameters once (run.keep_gathered)",
    )
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def model_config(args):
    shrink = {} if args.hidden is None else dict(
        hidden_size=args.hidden, vocab_size=512, num_experts=8, moe_intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    )  # fmt: skip
    return qwen3_30b_a3b(num_hidden_layers=args.layers, max_position_embeddings=4096, **shrink)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(times: dict, name: str, device, fn):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    times[name] = time.perf_counter() - start
    return out


def one_step(trainer, engine, receiver, optimizer, ranks, prompts, args, seed) -> dict:
    """One GRPO step; this rank's times and the step's loss, rewards and counts."""
    device, times = engine.layout.device, {}
    mine = range(len(prompts)) if ranks is None else ranks.share(len(prompts))
    sampling = SamplingParams(
        n=args.samples, max_tokens=args.max_tokens, ignore_eos=True, seed=seed
    )
    completions = timed(
        times,
        "rollout",
        device,
        lambda: engine.generate(
            prompts[mine.start : mine.stop], sampling, first_prompt_index=mine.start
        ),
    )
    rewards = [float(sum(c.completion_ids) % 2) for c in completions]
    if ranks is not None:  # the whole batch's rewards, in prompt order
        rewards = [r for part in ranks.gather(rewards) for r in part]
    adv, _ = group_advantages(
        torch.tensor(rewards).view(len(prompts), args.samples), normalize_std=False
    )
    first = mine.start * args.samples
    advantages = adv.flatten().tolist()[first : first + len(completions)]
    engine.release_kv()
    out = timed(
        times,
        "train",
        device,
        lambda: grpo_update(
            trainer,
            optimizer,
            completions,
            advantages,
            config=GrpoConfig(),
            replay=True,
            guided=True,
            temperature=1.0,
            micro_batch_seqs=args.samples,  # one group: the same micro-batches on any GPU count
            across=ranks,
            spare=completions[0],
            gradient_sync=args.gradient_sync,
            keep_gathered=args.keep_gathered,
        ),
    )

    def refit() -> None:
        receiver.receive(weights_of(trainer, engine.policy_version + 1, ranks))
        engine.acquire_kv()

    timed(times, "refit", device, refit)
    tokens = sum(len(c.completion_ids) for c in completions)
    if ranks is not None:
        times = ranks.max(times)
        tokens = int(ranks.sum({"tokens": tokens})["tokens"])
    return {**times, "tokens": tokens, "samples": len(rewards), "rewards": rewards, **out}


def fingerprint(trainer, ranks) -> dict[str, str] | None:
    """SHA-256 of each BF16 weight after the steps (rank 0; None elsewhere)."""
    if ranks is None:
        state = {k: v.detach().to("cpu", torch.bfloat16) for k, v in trainer.state_dict().items()}
    else:
        state = distributed.full_state_dict(trainer, torch.bfloat16, ranks)
    if state is None:
        return None
    return {
        k: hashlib.sha256(v.view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in state.items()
    }


def worker(args) -> None:
    with distributed.launch(args.device) as ranks:
        device = torch.device(args.device) if ranks is None else ranks.device
        config = model_config(args)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, config.vocab_size, (args.prompts, args.prompt_len), generator=g)
        prompts = prompts.tolist()
        bf16 = torch.bfloat16
        trainer = build_model(
            config, PRECISION, fp4_experts="qat", dtype=bf16, device="cpu" if ranks else device
        )
        init_weights(trainer, std=0.02, seed=0)
        optim = OptimConfig(lr=1e-6)
        if ranks is None:
            optimizer = MasterAdamW(trainer.parameters(), optim)
        else:
            trainer = distributed.shard_policy(trainer, ranks, bf16)
            optimizer = distributed.ShardedAdamW(trainer.parameters(), optim)
        per_rank = len(prompts) if ranks is None else len(ranks.share(len(prompts)))
        engine_config = EngineConfig(
            kv_memory_bytes=(16 << 30) if device.type == "cuda" else (64 << 20),
            max_model_len=args.prompt_len + args.max_tokens,
            max_num_seqs=per_rank * args.samples,
            max_num_batched_tokens=max(8192, args.prompt_len + args.max_tokens),
            capture_routing=True,
            guidance="compact",
        )
        packed = build_model(config, PRECISION, fp4_experts="packed", dtype=bf16, device=device)
        engine = Engine(packed, engine_config)
        receiver = RefitReceiver(engine)
        receiver.receive(weights_of(trainer, 1, ranks))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        steps = [
            one_step(trainer, engine, receiver, optimizer, ranks, prompts, args, seed=s)
            for s in range(args.steps)
        ]
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        peaks = [peak] if ranks is None else ranks.gather(peak)
        weights = fingerprint(trainer, ranks)
        if ranks is None or ranks.writer:
            world = 1 if ranks is None else ranks.world_size
            result = {"world_size": world, "steps": steps, "peak_gib": peaks, "weights": weights}
            args.worker.write_text(json.dumps(result))


def run_worker(args, out: Path, gpus: int | None) -> dict:
    argv = [a for a in sys.argv[1:]]
    script = str(Path(__file__).resolve())
    if gpus is None:
        command = [sys.executable, script, *argv, "--worker", str(out)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc-per-node={gpus}", script, *argv, "--worker", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in distributed.ENVIRONMENT}
    subprocess.run(command, check=True, env=env)
    return json.loads(out.read_text())


def row(result: dict, base: dict | None) -> str:
    timed_steps = result["steps"][1:] or result["steps"]
    rollout = sum(s["tokens"] for s in timed_steps) / sum(s["rollout"] for s in timed_steps)
    train = sum(s["samples"] for s in timed_steps) / sum(s["train"] for s in timed_steps)
    refit = sum(s["refit"] for s in timed_steps) / len(timed_steps)
    cells = [
        str(result["world_size"]),
        f"{rollout:,.0f}",
        f"{train:,.2f}",
        f"{refit:.3f}",
        " / ".join(f"{p:.1f}" for p in result["peak_gib"]),
    ]
    if base is None:
        cells += ["-", "-", "-", "-", "-"]
    else:
        base_steps = base["steps"][1:] or base["steps"]
        base_rollout = sum(s["tokens"] for s in base_steps) / sum(s["rollout"] for s in base_steps)
        base_train = sum(s["samples"] for s in base_steps) / sum(s["train"] for s in base_steps)
        same_rewards = all(
            a["rewards"] == b["rewards"]
            for a, b in zip(result["steps"], base["steps"], strict=True)
        )
        loss_gap = max(
            abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30)
            for a, b in zip(result["steps"], base["steps"], strict=True)
        )
        equal = sum(result["weights"][k] == v for k, v in base["weights"].items())
        cells += [
            f"{rollout / base_rollout:.2f}x",
            f"{train / base_train:.2f}x",
            "yes" if same_rewards else "no",
            f"{loss_gap:.1e}",
            f"{equal}/{len(base['weights'])}",
        ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        worker(args)
        return
    print(run_header(" ".join(["python", *sys.argv])))
    print(
        f"\n{args.layers} layers, {args.prompts} prompts x {args.samples} samples, prompt "
        f"{args.prompt_len} + {args.max_tokens} new tokens, {args.steps} steps (first: warm-up)"
    )
    sync = {"update": "once per update", "micro_batch": "in every micro-batch"}
    gathered = "once per update" if args.keep_gathered else "in every forward and backward"
    print(
        f"{args.gpus} ranks, micro-batches of {args.samples} completions: gradients "
        f"reduce-scattered {sync[args.gradient_sync]} (--gradient-sync {args.gradient_sync}), "
        f"parameters gathered {gathered} (--keep-gathered {args.keep_gathered})\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        one = None if args.no_baseline else run_worker(args, Path(tmp) / "one.json", None)
        many = run_worker(args, Path(tmp) / "many.json", args.gpus)
    print(
        "| GPUs | rollout tok/s | trained samples/s | refit s | peak GiB per GPU | rollout "
        "speed-up | train speed-up | rewards equal | max loss rel. diff | weights equal |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---|---:|---:|")
    if one is not None:
        print(row(one, None))
    print(row(many, one))


if __name__ == "__main__":
    main()
