"""The trainer's forwards against the rollout on long, ragged contexts (random-weight tiny model).

    python benchmarks/seam_long.py [--prompts 32] [--samples 4] [--max-tokens 40] [--seeds 0 1]
        [--grouped-decode]

The demo's completions are a few tokens long; here the test suite's tiny model (random
weights, NVFP4 experts and KV in layers 1-2, vocabulary 128) completes prompts of 2-23 random
tokens with up to ``--max-tokens`` more (one stop token), so decode steps batch sequences of
very different contexts and shrink as samples stop. For BF16 and FP32, each trainer forward
(`policy.FORWARDS`) replays the routing and rounds to nearest; its codes are compared with
the rollout's full records (signed codewords, +0 and -0 as one), split into prompt rows (the
engine's prefill) and completion rows (its decode steps), with token_mult_prob_error and max
|dlogp| against the sampled tokens' logprobs; each figure over the prompt sets of ``--seeds``
(agreement and token_mult_prob_error pooled, max |dlogp| the largest).

``--grouped-decode`` measures a proposed change of the engine instead of the engine as it is:
its CPU decode attends each row over exactly its own context, the rows of one context length in
one call (two rows at least), so a row's result no longer depends on which other sequences
share its step (`grouped_decode` patches the rollout's `attend_fp32` in this process only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import engine_config, rollout_model  # noqa: E402

from fp4rl.fp4.reference import unpack_e2m1  # noqa: E402
from fp4rl.model.sites import SiteRecords  # noqa: E402
from fp4rl.records import collate  # noqa: E402
from fp4rl.rollout import Engine, SamplingParams  # noqa: E402
from fp4rl.rollout import attention as rollout_attention  # noqa: E402
from fp4rl.train.observe import signed_index  # noqa: E402
from fp4rl.train.policy import FORWARDS, policy_logprobs, prompt_lens  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--grouped-decode", action="store_true")
    return parser.parse_args()


def grouped_decode(attend):
    """``attend`` (`attend_fp32`) with its decode calls (one query per row: prompts here have two
    tokens at least) split by context length, each group over exactly its context."""

    def decode(q_BQHD, k_BCKD, v_BCKD, q_positions_BQ, context_B):
        if q_BQHD.shape[1] != 1:
            return attend(q_BQHD, k_BCKD, v_BCKD, q_positions_BQ, context_B)
        out = q_BQHD.new_empty(q_BQHD.shape, dtype=torch.float32)
        for C in context_B.unique().tolist():
            rows = (context_B == C).nonzero()[:, 0]
            call = rows.repeat(2) if len(rows) == 1 else rows
            o = attend(q_BQHD[call], k_BCKD[call, :C], v_BCKD[call, :C],
                       q_positions_BQ[call], context_B[call])  # fmt: skip
            out[rows] = o[: len(rows)]
        return out

    return decode


def random_prompts(num: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 24, (num,), generator=g).tolist()
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def compare(qat, batch, forward: str, totals: dict) -> None:
    """Add the agreement of prompt and completion rows, and the logprob gap, to ``totals``."""
    prompt_T = torch.cat(
        [torch.arange(n) < p for n, p in zip(batch.seq_lens, prompt_lens(batch), strict=True)]
    )
    rec = SiteRecords()
    with torch.no_grad():
        logp_N = policy_logprobs(qat, batch, guided=False, capture=rec, forward=forward)
    for key, theirs in batch.guidance.items():
        a = signed_index(unpack_e2m1(rec.sites[key].codes))
        b = signed_index(unpack_e2m1(theirs.codes))
        agree_T = (a == b).view(a.shape[0], -1).sum(-1)
        for name, rows in (("prompt", prompt_T), ("completion", ~prompt_T)):
            totals[name][0] += int(agree_T[rows].sum())
            totals[name][1] += int(rows.sum()) * a[0].numel()
    d_N = logp_N - batch.sampling_logprobs_N
    totals["tmpe"] += [float(d_N.abs().exp().sum()), d_N.numel()]
    totals["max"] = max(totals.get("max", 0.0), float(d_N.abs().max()))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    config = engine_config(
        capture_routing=True,
        guidance="full",
        max_num_seqs=args.prompts * args.samples,
        max_num_batched_tokens=1024,
        kv_memory_bytes=8 << 20,
    )
    params = SamplingParams(n=args.samples, max_tokens=args.max_tokens, seed=1, stop_token_ids=(7,))
    print("| dtype | trainer forward | agreement | prompt rows | completion rows "
          "| token_mult_prob_error | max \\|dlogp\\| |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    lens = []
    if args.grouped_decode:
        rollout_attention.attend_fp32 = grouped_decode(rollout_attention.attend_fp32)
    for dtype in (torch.bfloat16, torch.float32):
        packed, qat = rollout_model("nvfp4", "nvfp4", seed=3, dtype=dtype)
        totals = {f: {"prompt": [0, 0], "completion": [0, 0], "tmpe": []} for f in FORWARDS}
        for seed in args.seeds:
            stats: dict = {}
            out = Engine(packed, config).generate(
                random_prompts(args.prompts, seed), params, stats=stats
            )
            assert stats["preemptions"] == 0  # every prompt prefilled as one segment, once
            batch = collate(out)
            lens += batch.seq_lens
            for forward in FORWARDS:
                compare(qat, batch, forward, totals[forward])
        for forward, t in totals.items():
            agree = t["prompt"][0] + t["completion"][0]
            total = t["prompt"][1] + t["completion"][1]
            tmpe = sum(t["tmpe"][0::2]) / sum(t["tmpe"][1::2])
            print(
                f"| {str(dtype).removeprefix('torch.')} | {forward} | {100 * agree / total:.3f} % "
                f"| {100 * t['prompt'][0] / t['prompt'][1]:.3f} % "
                f"| {100 * t['completion'][0] / t['completion'][1]:.3f} % | {tmpe:.5f} "
                f"| {t['max']:.3g} |"
            )
    print(f"{len(lens)} sequences of {min(lens)}-{max(lens)} tokens")


if __name__ == "__main__":
    main()
