"""Decode attention at Qwen3-30B-A3B's attention shape: the paged Triton kernel over BF16 and
NVFP4 pages against today's gather + einsum path.

One H200 (about a minute and a half): ``python benchmarks/attention.py``; a CPU smoke check of
the script: ``python benchmarks/attention.py --device cpu`` (toy sizes, Triton's interpreter).
Prints markdown tables and writes them to ``$OUT/attention.md`` when OUT is set.

32 query / 4 KV heads of 128, pages of 16 tokens, BF16 queries, batches of 1, 64 and 256
sequences each at a context of 1k, 2k or 4k tokens, block tables drawn from a shuffled pool
(interleaved, out of order). Compared in the same run, per layer call:
  (a) ``paged_attention.launch`` over BF16 pages;
  (b) the launcher over NVFP4 pages (codes and scales decoded in registers): on the GPU the
      register kernel (``paged_attention_registers``), and beside it (b') the Triton program
      over the same pages with the tile it would take (``plan_for("nvfp4", ...)``);
  (c) today's decode path of ``PagedAttention.attend``: ``KVCache.read`` of every sequence's
      padded context (NVFP4 rows dequantized), ``attend_fp32``, the cast back to BF16 -- over
      BF16 pages and over NVFP4 pages;
  (d) the same decodes through the prefill kernel (``paged_prefill.launch``, segments of one
      token) -- over BF16 and over NVFP4 pages: what a step that also prefills would pay were
      its decodes attended with its prompts in one launch (the engine runs both kernels).
(c)'s output is the specification; (a), (b), (b') and (d) are checked against it at every shape
before they are timed (outputs within one BF16 rounding). Times are CUDA-graph replays (the
GPU's time) after warm-up, median over repeats, each repeat rotating over enough sets of pages,
tables and queries that no call finds its KV in L2; inputs are random, never zeros. The roofline
beside each time is the KV bytes that must be read (B x C x 4 KV heads x K and V x 256 bytes
per token-head in BF16, 64 + 8 + 2 = 74 in NVFP4: codes, block scales, the row's BF16 amax)
over a device-to-device copy measured in the same run. A second table sweeps the number of context
splits and the kernel's tiles.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: toy sizes under Triton's interpreter (a smoke check)",
    )
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--contexts", default="1024,2048,4096")
    parser.add_argument(
        "--tiles",
        default="64:4:3,64:8:2,128:8:2",
        help="other kernel tiles BLOCK_N:WARPS:STAGES[:k][@S] (k: keys first; S context "
        "stretches, else the launcher's split), swept at --sweep-shapes",
    )
    parser.add_argument(
        "--sweep-shapes",
        default="1x1024,64x4096,256x2048",
        help="BATCHxCONTEXT shapes where context splits and tiles are swept",
    )
    return parser.parse_args()


ARGS = parse_args()
if ARGS.device == "cpu":  # kernels must be decorated interpreted: before fp4rl.kernels loads
    os.environ["TRITON_INTERPRET"] = "1"

from _timing import copy_bandwidth, median_ms, report, run_header  # noqa: E402

from fp4rl.kernels import attention_tiles, paged_attention, paged_prefill  # noqa: E402
from fp4rl.kernels.attention_tiles import DecodeTile, stretches_for  # noqa: E402
from fp4rl.rollout.attention import AttentionMetadata, Segment, attend_fp32  # noqa: E402
from fp4rl.rollout.kv_cache import KVCache, KVCacheSpec  # noqa: E402

NVFP4_BYTES = {128: 74}  # per token-head of K or V: codes D/2, E4M3 scales D/16, BF16 amax


def main() -> None:
    cuda = ARGS.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU; --device cpu runs a smoke check under TRITON_INTERPRET")
    device = torch.device(ARGS.device)
    if cuda:
        heads, dim, page = (32, 4), 128, 16
        batches = [int(b) for b in ARGS.batches.split(",")]
        contexts = [int(c) for c in ARGS.contexts.split(",")]
        sweep_shapes = {
            tuple(int(v) for v in s.split("x")) for s in ARGS.sweep_shapes.split(",") if s
        }
        tiles = [parse_tile(t) for t in ARGS.tiles.split(",") if t]
        warmup, repeats, min_bytes = 3, 10, 256 << 20
    else:
        heads, dim, page = (4, 2), 32, 16
        batches, contexts, sweep_shapes = [1, 2], [32, 128], {(1, 128)}
        tiles = [(DecodeTile(32, 4, 2, min_split_tokens=16), None)]
        warmup, repeats, min_bytes = 1, 1, 0
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth(device)
    lines = [
        run_header(" ".join(["python", *sys.argv])),
        "",
        f"{heads[0]} query / {heads[1]} KV heads of {dim}, pages of {page} tokens, BF16 queries, "
        f"every sequence at the full context. Device copy measured in this run: {copy_gbs:.0f} "
        "GB/s (read + write, the best of 1 GiB, 256 MiB and 64 MiB copies). Times: CUDA-graph "
        f"replay, median of {repeats}, us per layer call. Roofline: KV bytes / copy bandwidth.",
        "",
        "| batch | context | (a) BF16 pages us | roofline us | % | (b) NVFP4 pages us | roofline "
        "us | % | (a) / (b) | (b') Triton program us | (b') / (b) | (c) gather BF16 us | (c) "
        "gather NVFP4 us | (c) BF16 / (a) | (c) NVFP4 / (b) | (d) prefill kernel BF16 us | "
        "(d) / (a) | (d) prefill kernel NVFP4 us | (d) / (b) | splits | check (a), (b), (b'), "
        "(d) BF16, (d) NVFP4 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
        "|---:|---:|---|",
    ]
    sweep = [
        "",
        "Sweep (us): the kernel with the context split in S stretches (auto: the launcher's "
        "choice), and other tiles BLOCK_N:WARPS:STAGES at the launcher's split.",
        "",
        "| batch | context | pages | auto (S) | by S | tiles |",
        "|---:|---:|---|---:|---|---|",
    ]
    failed = []
    for batch in batches:
        for context in contexts:
            bench = Bench(batch, context, heads, dim, page, device, min_bytes)
            row, bad = bench.table_row(copy_gbs, warmup, repeats)
            lines.append(row)
            failed += bad
            print(row, flush=True)
            del bench
    # Sweeps last: the main table is printed even if a run is cut short.
    for batch, context in sorted(sweep_shapes):
        bench = Bench(batch, context, heads, dim, page, device, min_bytes)
        for fmt in ("bf16", "nvfp4"):
            sweep.append(bench.sweep_row(fmt, tiles, warmup, repeats))
            print(sweep[-1], flush=True)
        del bench
    again = copy_bandwidth(device)
    lines.insert(3, f"The same copy measured again after the last row: {again:.0f} GB/s.")
    report("attention.md", lines + sweep)
    if failed:
        sys.exit("checks failed: " + "; ".join(failed))


class Bench:
    """One (batch, context): a two-layer cache (layer 0 BF16 pages, layer 1 NVFP4) holding
    ``sets`` disjoint batches of sequences, and per set the queries, block tables and the
    engine's metadata for today's path."""

    def __init__(self, batch, context, heads, dim, page, device, min_bytes):
        self.batch, self.context, self.dim = batch, context, dim
        Hq, K = heads
        self.kv_heads = K
        blocks = -(-context // page)
        nvfp4_bytes = batch * context * K * 2 * NVFP4_BYTES.get(dim, dim // 2 + dim // 16 + 2)
        self.sets = max(1, min(256, -(-min_bytes // nvfp4_bytes)))
        num_blocks = 1 + self.sets * batch * blocks
        spec = KVCacheSpec(layer_formats=("bf16", "nvfp4"), num_kv_heads=K, head_dim=dim,
                           dtype=torch.bfloat16)  # fmt: skip
        self.cache = KVCache(spec, num_blocks, page, device)
        slots = torch.arange(num_blocks * page, device=device)
        k, v = (torch.randn(num_blocks * page, K, dim, device=device).to(torch.bfloat16)
                for _ in range(2))  # fmt: skip
        self.cache.write(0, slots, k, v)
        self.cache.write(1, slots, k, v)
        del k, v, slots
        pool = torch.randperm(num_blocks - 1) + 1  # block 0 stays unused
        self.inputs = []
        for s in range(self.sets):
            table = pool[s * batch * blocks : (s + 1) * batch * blocks].view(batch, blocks)
            meta = AttentionMetadata.build(
                [Segment(row, context - 1, 1) for row in table.tolist()], page, device
            )
            q = torch.randn(batch, Hq, dim, device=device).to(torch.bfloat16)
            decodes = [(i, context - 1, 1) for i in range(batch)]  # (row, start, num)
            plan = paged_prefill.plan(decodes, table.tolist(), Hq // K, device)
            self.inputs.append((q, table.to(torch.int32).to(device),
                                meta.decode_context_B.to(torch.int32), meta, plan))  # fmt: skip
        layers = self.cache.layers
        self.pages = {
            "bf16": (layers[0].k_NBKD, layers[0].v_NBKD),
            "nvfp4": (layers[1].k, layers[1].v),
        }
        self.kv_bytes = {
            "bf16": batch * context * K * 2 * dim * 2,
            "nvfp4": nvfp4_bytes,
        }

    def kernel(self, fmt, **kw):
        k, v = self.pages[fmt]
        return lambda s: paged_attention.launch(s[0], k, v, s[1], s[2], **kw)

    def prefill_kernel(self, fmt):
        k, v = self.pages[fmt]
        return lambda s: paged_prefill.launch(s[0], k, v, s[4], torch.empty_like(s[0]))

    def triton_program(self):
        """The launcher's Triton program over NVFP4 pages, with the tile and split it would
        take were the register kernel not there."""
        programs, device = self.batch * self.kv_heads, self.inputs[0][0].device
        tile, planned = attention_tiles.plan_for("nvfp4", programs, self.tokens, device)
        return self.kernel("nvfp4", config=tile, num_splits=planned)

    def today(self, fmt):
        layer = 0 if fmt == "bf16" else 1

        def run(s):
            q, meta = s[0], s[3]
            k, v = self.cache.read(layer, meta.decode_slots_BC, q.dtype)
            positions = (meta.decode_context_B - 1)[:, None]
            return attend_fp32(q[:, None], k, v, positions, meta.decode_context_B)[:, 0].to(q.dtype)

        return run

    def us(self, fn, warmup, repeats):
        graph = self.is_cuda
        return 1e3 * median_ms(fn, self.inputs, warmup=warmup, repeats=repeats, graph=graph)

    def splits(self, fmt, tile=None, num_splits=None):
        """How many stretches the launcher cuts each context into."""
        programs, device = self.batch * self.kv_heads, self.inputs[0][0].device
        if tile is None:
            q, Hq = self.inputs[0][0], self.inputs[0][0].shape[1]
            kind = attention_tiles.page_format(q, fmt == "nvfp4", self.dim, Hq // self.kv_heads)
            tile, planned = attention_tiles.plan_for(kind, programs, self.tokens, device)
            num_splits = planned if num_splits is None else num_splits
        return stretches_for(programs, self.tokens, tile, device, num_splits)

    def table_row(self, copy_gbs, warmup, repeats):
        bad, t, want = [], {}, {}
        for fmt in ("bf16", "nvfp4"):
            want[fmt] = self.today(fmt)(self.inputs[0])
            verdict = check(self.kernel(fmt)(self.inputs[0]), want[fmt])
            if verdict != "ok":
                bad.append(f"{fmt} pages, batch {self.batch}, context {self.context}: {verdict}")
            t[fmt, "check"] = verdict
            t[fmt, "kernel"] = self.us(self.kernel(fmt), warmup, repeats)
            t[fmt, "today"] = self.us(self.today(fmt), warmup, repeats)
        program = self.triton_program()
        t["program", "check"] = check(program(self.inputs[0]), want["nvfp4"])
        if t["program", "check"] != "ok":
            bad.append(f"Triton program over NVFP4 pages, batch {self.batch}, context "
                       f"{self.context}: {t['program', 'check']}")  # fmt: skip
        t["program", "kernel"] = self.us(program, warmup, repeats)
        for fmt in ("bf16", "nvfp4"):
            t[fmt, "prefill check"] = check(self.prefill_kernel(fmt)(self.inputs[0]), want[fmt])
            if t[fmt, "prefill check"] != "ok":
                bad.append(f"prefill kernel over {fmt} pages, batch {self.batch}, context "
                           f"{self.context}: {t[fmt, 'prefill check']}")  # fmt: skip
            t[fmt, "prefill"] = self.us(self.prefill_kernel(fmt), warmup, repeats)
        roof = {fmt: 1e-3 * b / copy_gbs for fmt, b in self.kv_bytes.items()}  # us
        a, b = t["bf16", "kernel"], t["nvfp4", "kernel"]
        row = (
            f"| {self.batch} | {self.context} | {a:.1f} | {roof['bf16']:.1f} | "
            f"{100 * roof['bf16'] / a:.0f} | {b:.1f} | {roof['nvfp4']:.1f} | "
            f"{100 * roof['nvfp4'] / b:.0f} | {a / b:.2f}x | {t['program', 'kernel']:.1f} | "
            f"{t['program', 'kernel'] / b:.2f}x | {t['bf16', 'today']:.1f} | "
            f"{t['nvfp4', 'today']:.1f} | {t['bf16', 'today'] / a:.1f}x | "
            f"{t['nvfp4', 'today'] / b:.1f}x | {t['bf16', 'prefill']:.1f} | "
            f"{t['bf16', 'prefill'] / a:.2f}x | {t['nvfp4', 'prefill']:.1f} | "
            f"{t['nvfp4', 'prefill'] / b:.2f}x | {self.splits('bf16')} | "
            f"{t['bf16', 'check']}, {t['nvfp4', 'check']}, {t['program', 'check']}, "
            f"{t['bf16', 'prefill check']}, {t['nvfp4', 'prefill check']} |"
        )
        return row, bad

    def sweep_row(self, fmt, tiles, warmup, repeats):
        auto = self.splits(fmt)
        by_splits, seen = [], {auto}
        for n in (1, 2, 3, 4, 5, 6, 8, 12, 16, 32):
            actual = self.splits(fmt, num_splits=n)
            # Stretches shorter than 128 tokens (16 on the CPU) are not worth a look.
            if actual not in seen and self.tokens >= n * (128 if self.is_cuda else 16):
                seen.add(actual)
                us = self.us(self.kernel(fmt, num_splits=n), warmup, repeats)
                by_splits.append(f"{actual}: {us:.1f}")
        want, by_tile = self.today(fmt)(self.inputs[0]), []
        for x, n in tiles:
            if x.registers and fmt == "bf16":
                continue  # the register kernel reads NVFP4 pages only
            verdict = check(self.kernel(fmt, config=x, num_splits=n)(self.inputs[0]), want)
            us = self.us(self.kernel(fmt, config=x, num_splits=n), warmup, repeats)
            by_tile.append(f"{tile_label(x, n)}: {us:.1f}" + ("" if verdict == "ok" else
                                                              f" ({verdict})"))  # fmt: skip
        auto_us = self.us(self.kernel(fmt), warmup, repeats)
        return (f"| {self.batch} | {self.context} | {fmt} | {auto_us:.1f} ({auto}) | "
                f"{', '.join(by_splits)} | {', '.join(by_tile)} |")  # fmt: skip

    @property
    def is_cuda(self) -> bool:
        return self.cache.layers[0].k_NBKD.is_cuda

    @property
    def tokens(self) -> int:
        """Tokens the block tables cover (what the launcher splits)."""
        return self.inputs[0][1].shape[1] * self.cache.block_size


def parse_tile(text: str) -> tuple[DecodeTile, int | None]:
    """``BLOCK_N:WARPS:STAGES``, with ``:k`` appended for the keys-first orientation or ``:r``
    for the register kernel (NVFP4 pages; ``BLOCK_N:1:2:r``), and ``@S`` for S context
    stretches (else the launcher's split): (tile, S or None)."""
    text, _, splits = text.partition("@")
    fields = text.split(":")
    block_n, warps, stages = (int(v) for v in fields[:3])
    tile = DecodeTile(block_n, warps, stages, keys_first="k" in fields[3:],
                      registers="r" in fields[3:])  # fmt: skip
    return tile, int(splits) if splits else None


def tile_label(tile: DecodeTile, splits: int | None = None) -> str:
    label = f"{tile.block_n}:{tile.num_warps}:{tile.num_stages}"
    label += ":k" if tile.keys_first else ":r" if tile.registers else ""
    return label + (f"@{splits}" if splits else "")


def check(got: torch.Tensor, want: torch.Tensor) -> str:
    """'ok' when every output is within one BF16 ulp of the spec's (both round FP32 values that
    differ by FP32 summation order) and none is NaN; else what is wrong."""
    got, want = got.float(), want.float()
    if got.isnan().any() or want.isnan().any():
        return "NaN"
    ulp = torch.where(want == 0, 0.0, 2.0 ** (torch.floor(torch.log2(want.abs())) - 7))
    slack = 2.0**-16 * want.abs().max()
    off = (got - want).abs() > ulp + slack
    if off.any():
        return f"{int(off.sum())} of {off.numel()} outputs off by more than one ulp"
    same = float((got == want).float().mean())
    return "ok" if same > 0.9 else f"only {100 * same:.0f} % bitwise equal"


if __name__ == "__main__":
    main()
