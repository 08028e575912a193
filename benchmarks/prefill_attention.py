"""Prefill attention at Qwen3-30B-A3B's attention shape: the paged Triton prefill kernel over
BF16 and NVFP4 pages against the engine's earlier prefill path.

One H200 (under a minute): ``python benchmarks/prefill_attention.py``; a CPU smoke check of the
script: ``python benchmarks/prefill_attention.py --device cpu`` (toy sizes, Triton's
interpreter). Prints a markdown table and writes it to ``$OUT/prefill_attention.md`` when OUT
is set.

32 query / 4 KV heads of 128, pages of 16 tokens, BF16 queries; a step prefills P prompts of L
tokens each, whose K/V already sit in the cache in interleaved, out-of-order blocks. Compared
in the same run, per layer call:
  (a) ``paged_prefill.launch``: every prompt's tiles in one launch, pages read where they lie
      (NVFP4 codes and scales decoded in registers), the launcher's tile and the other tiles
      of ``--tiles``;
  (b) the engine's earlier prefill path (``PagedAttention.attend`` off the kernel, still its
      spec): per prompt, ``KVCache.read`` of its context (NVFP4 rows dequantized),
      ``attend_fp32`` (FP32 einsums, mask, softmax) and the cast back to BF16.
Before timing, (a) is compared with (b) at every case: the share of outputs that are equal and
the largest difference in units of the BF16 spacing at the row's largest output (the sums' order
moves an output by about 1e-6 of its row's scale, then one rounding), for the launcher's tile
and the worst of the swept tiles. Times are
CUDA-event medians over repeats after warm-up, eager launches (the host's launch time counts
where it exceeds the GPU's).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--cases", default="1x512,1x2048,64x512,8x2048", help="PROMPTSxLENGTH, comma-separated"
    )
    parser.add_argument(
        "--tiles",
        default="128:64:8:2,128:128:8:2,64:64:4:3,64:32:4:2,32:64:4:2",
        help="kernel tiles ROWS:BLOCK_N:WARPS:STAGES (rows: query tokens x 8 heads)",
    )
    parser.add_argument("--repeats", type=int, default=10)
    return parser.parse_args()


def measure(q, pages, segments, tables, group, tiles, repeats) -> str:
    """One case's table cells after the first two: times, speed-up, agreement, the sweep."""
    from _timing import median_ms

    from fp4rl.kernels import paged_prefill
    from fp4rl.kernels.paged_prefill import reference_prefill

    out = torch.empty_like(q)

    def earlier(_):
        return reference_prefill(q, *pages, segments, tables)

    def kernel(plan):
        return paged_prefill.launch(q, *pages, plan, out)

    want = earlier(None)
    plans = [paged_prefill.plan(segments, tables, group, q.device, tile=t) for t in [None, *tiles]]
    # BF16 spacing at each row's (token, head) largest output: an output near 0 of a row whose
    # others are large differs by the rounding of the row's sums, not of its own size.
    spacing = torch.finfo(torch.bfloat16).eps * want.float().abs().amax(-1, keepdim=True)
    steps = [float(((kernel(p).float() - want.float()).abs() / spacing).max()) for p in plans]
    equal = float((kernel(plans[0]) == want).float().mean())
    timed = dict(warmup=2, repeats=repeats if q.is_cuda else 1)
    t_old = median_ms(earlier, [None], **timed)
    t_new, *sweep = [median_ms(kernel, [p], **timed) for p in plans]
    cells = [f"{t_old:.3f}", f"{t_new:.3f}", f"{t_old / t_new:.1f}x", f"{equal:.1%}"]
    cells += [f"{steps[0]:.2f}", f"{max(steps):.2f}", *(f"{t:.3f}" for t in sweep)]
    return " | ".join(cells) + " |"


def main() -> None:
    args = parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(__file__))
    from _timing import run_header

    from fp4rl.kernels.paged_prefill import PrefillTile
    from fp4rl.rollout.kv_cache import KVCache, KVCacheSpec

    device = torch.device(args.device)
    cpu = device.type == "cpu"
    Hq, K, D, page = (8, 2, 32, 16) if cpu else (32, 4, 128, 16)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    if cpu:
        cases = [(2, 40)]
    tiles = [PrefillTile(*(int(v) for v in t.split(":"))) for t in args.tiles.split(",") if t]
    lines = [run_header("python benchmarks/prefill_attention.py"), ""]
    lines += [
        "| pages | prompts x tokens | (b) earlier path ms | (a) kernel ms | speed-up | equal "
        "to (b) | most BF16 steps from (b) | same, any tile | "
        + " | ".join(f"{t.rows}:{t.block_n}:{t.num_warps}:{t.num_stages} ms" for t in tiles)
        + " |",
        "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(tiles),
    ]
    g = torch.Generator(device=device).manual_seed(0)
    for fmt in ("bf16", "nvfp4"):
        for prompts, length in cases:
            per_seq = -(-length // page)
            num_blocks = prompts * per_seq + 1
            spec = KVCacheSpec(
                layer_formats=(fmt,), num_kv_heads=K, head_dim=D, dtype=torch.bfloat16
            )
            cache = KVCache(spec, num_blocks, page, device)
            k, v = (
                torch.randn(num_blocks * page, K, D, generator=g, device=device).to(torch.bfloat16)
                * 2
                for _ in range(2)
            )
            cache.write(0, torch.arange(num_blocks * page, device=device), k, v)
            order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
            tables = [order[i::prompts][:per_seq].tolist() for i in range(prompts)]
            segments = [(i * length, 0, length) for i in range(prompts)]
            q = torch.randn(prompts * length, Hq, D, generator=g, device=device).to(torch.bfloat16)
            row = measure(q, cache.pages(0), segments, tables, Hq // K, tiles, args.repeats)
            lines.append(f"| {fmt} | {prompts} x {length} | {row}")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "prefill_attention.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
