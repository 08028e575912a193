"""Code agreement and record bytes of each guidance mode, measured on the same completions.

    BASE=~/.cache/fp4rl/base-...   # the demo's cached base policy (`fp4rl demo` builds it)
    python benchmarks/guidance.py --config fp4rl/configs/demo.toml --set model.path=$BASE \\
        --set model.dtype=bfloat16 --deltas 0.01 0.03 0.1 --steps 0 5 10 15 20 25 30 35

For each listed step's prompt batch (the loop's batches, drawn by `Task.train_examples`, at the
base policy), the engine generates the same completions once per guidance mode: the same seed
and batch give the same tokens (checked), so the records differ and nothing else does. The
trainer's forward of the first ``run.micro_batch_seqs`` completions, with router replay, rounds
every FP4 site to nearest (its own scales), to nearest under the rollout's scales, and guided by
full codes, compact bits, and sparse guidance for each delta; each result is compared with the
rollout's full codes: agreement over all values (signed codewords, +0 and -0 as one), over the
values nearest rounding gets wrong, block scales equal to the rollout's, and guidance bytes per
generated token over the whole batch (prompt rows included, as
`capture_bytes_per_generated_token` counts them), split for sparse guidance into row maxima,
recorded blocks and recorded values. "nearest, derived scales" is sparse guidance
with its value positions left out: nearest rounding under the scales the trainer derives from
the first delta's records. ``token_mult_prob_error`` is mean exp|logp_train - logp_sampled| over
the scored tokens. The recorded shares of values and blocks are printed per site kind. With
``--windows``, also where nearest rounding's misses lie (the trainer following full guidance
upstream), measured three ways, and how many ulps the trainer's row maxima are from the
rollout's (the trainer following the first delta's sparse records).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict

import torch
from _seam import load_seam

from fp4rl.fp4 import E2M1_VALUES, NVFP4Tensor
from fp4rl.fp4.reference import e2m1_rne, scaled_values, unpack_e2m1
from fp4rl.fp4.rounding import e2m1_bracket
from fp4rl.fp4.sparse_guidance import PackedSparse, boundary_distance
from fp4rl.loop import sampling
from fp4rl.model.sites import SiteRecords
from fp4rl.records import TrainBatch, capture_bytes_per_generated_token, collate, record_to
from fp4rl.rollout import Engine
from fp4rl.rollout.generation_config import eos_token_ids
from fp4rl.train.observe import signed_index
from fp4rl.train.policy import policy_logprobs


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--deltas", type=float, nargs="+", default=[0.01, 0.03, 0.1])
    parser.add_argument("--steps", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--windows",
        action="store_true",
        help="also measure where nearest rounding's misses lie (grid units, relative to the "
        "boundary, units of y) and how far the trainer's row maxima are from the rollout's",
    )
    return parser.parse_args()


def signed(t: NVFP4Tensor) -> torch.Tensor:
    return signed_index(unpack_e2m1(t.codes.cpu()))


def scales_only(batch: TrainBatch) -> TrainBatch:
    """Sparse records without their values: nearest rounding under the derived scales."""
    guidance = {
        key: dataclasses.replace(r, counts=torch.zeros_like(r.counts), entries=r.entries[:0])
        for key, r in batch.guidance.items()
    }
    return dataclasses.replace(batch, guidance=guidance)


def trainer_codes(policy, batch: TrainBatch, guided: bool, rollout: TrainBatch):
    """The trainer's signed codes per site, its token_mult_prob_error, and how many of its block
    and global scales equal those of ``rollout``'s full records: ``{name: [equal, total]}``."""
    rec = SiteRecords()
    with torch.no_grad():
        logp_N = policy_logprobs(policy, batch, replay=True, guided=guided, capture=rec)
    d_N = logp_N.cpu() - batch.sampling_logprobs_N
    scales = {"block_scale": [0, 0], "global_scale": [0, 0]}
    for key, t in rec.sites.items():
        want = rollout.guidance[key]
        for name in scales:
            a, b = getattr(t, name).cpu(), getattr(want, name).cpu()
            equal = a.view(torch.uint8) == b.view(torch.uint8)
            scales[name][0] += int(equal.view(*a.shape, -1).all(-1).sum())
            scales[name][1] += a.numel()
    codes = {key: signed(t) for key, t in rec.sites.items()}
    return codes, float(d_N.abs().exp().mean()), scales


class ValueRecords(SiteRecords):
    """`SiteRecords` that also keeps each site's input values."""

    keeps_values = True

    def __init__(self) -> None:
        super().__init__()
        self.values: dict = {}

    def record(self, layer: int, site: str, t: NVFP4Tensor, x=None) -> None:
        super().record(layer, site, t)
        self.values[(layer, site)] = x


def window_stats(policy, full: TrainBatch, sparse_batch: TrainBatch, stats) -> None:
    """Appends to ``stats``: for the trainer following full guidance upstream, each value's
    distance from its nearest boundary under the rollout's scales, three ways, and whether
    nearest rounding misses the rollout's code; for the trainer following ``sparse_batch``, the
    distance in ulps of each row's maximum from the rollout's."""
    table = torch.tensor(E2M1_VALUES)
    rec = ValueRecords()
    with torch.no_grad():
        policy_logprobs(policy, full, replay=True, guided=True, capture=rec)
    for key, x in rec.values.items():
        f = record_to(full.guidance[key], "cpu")
        y, live = scaled_values(x.cpu().unflatten(-1, (-1, 16)), f.block_scale, f.global_scale)
        y = y[live]
        rollout = unpack_e2m1(f.codes).unflatten(-1, (-1, 16))[live]
        stats["miss"].append(signed_index(e2m1_rne(y)) != signed_index(rollout))
        lo, hi = e2m1_bracket(y)
        middle = (table[lo.long()] + table[hi.long()]) / 2
        apart = torch.where(lo != hi, (y.abs() - middle).abs(), torch.inf)
        stats["grid units"].append(boundary_distance(y))
        stats["relative to the boundary"].append(apart / middle)
        stats["units of y"].append(apart)
    rec = ValueRecords()
    with torch.no_grad():
        policy_logprobs(policy, sparse_batch, replay=True, guided=True, capture=rec)
    for key, x in rec.values.items():
        mine = x.cpu().abs().amax(-1, keepdim=True)
        theirs = sparse_batch.guidance[key].row_amax.cpu()
        bits = torch.int16 if mine.element_size() == 2 else torch.int32
        ulps = mine.view(bits).long() - theirs.reshape(mine.shape).view(bits).long()
        stats["amax ulps"].append(ulps.abs().flatten())


def print_windows(stats) -> None:
    miss = torch.cat(stats["miss"])
    print(f"nearest rounding's misses, trainer following full guidance: {miss.float().mean():.4%}")
    for name in ("grid units", "relative to the boundary", "units of y"):
        d = torch.cat(stats[name])
        for cover in (0.9, 0.95, 0.99):
            t = torch.quantile(d[miss].double(), cover).item()
            print(
                f"window {t:.4f} {name} covers {cover:.0%} of the misses, records "
                f"{(d <= t).float().mean():.3%} of the values"
            )
    ulps = torch.cat(stats["amax ulps"])
    within = ", ".join(f"{(ulps <= u).float().mean():.4%} <= {u}" for u in (0, 1, 7, 31, 127))
    print(
        f"trainer's row maxima vs the rollout's ({len(ulps)} rows), ulps: {within}; "
        f"max {int(ulps.max())}"
    )


def sparse_bytes(completions) -> tuple[int, int, int]:
    """Bytes of the packed sparse records of a batch: (row maxima, recorded blocks, recorded
    values)."""
    amax = blocks = values = 0
    for c in completions:
        for r in c.guidance.values():
            assert isinstance(r, PackedSparse)
            amax, blocks, values = (
                amax + r.row_amax.nbytes,
                blocks + r.blocks.nbytes,
                values + r.values.nbytes,
            )
    return amax, blocks, values


def main() -> None:
    args = parse_args()
    config, task, policy, packed = load_seam(args.config, args.overrides)
    path = config.model.path
    modes = {"full": ("full", None), "compact": ("compact", None)}
    modes |= {f"sparse {d:g}": ("sparse", d) for d in args.deltas}
    totals = defaultdict(lambda: defaultdict(float))
    shares = defaultdict(lambda: [0, 0, 0, 0])  # (mode, site): values, recorded, blocks, recorded
    windows = defaultdict(list)
    for step in args.steps:
        num = config.rollout.prompts_per_step
        problems = task.train_examples(seed=config.run.seed, step=step, num=num)
        prompts = [list(p.prompt_ids) for p in problems]
        params = sampling(config, step, task.stop_token_ids)
        runs = {}
        for name, (mode, delta) in modes.items():
            engine_config = dataclasses.replace(
                config.engine, guidance=mode, sparse_delta=delta or config.engine.sparse_delta
            )
            engine = Engine(packed, engine_config, eos_token_ids=eos_token_ids(path))
            runs[name] = engine.generate(prompts, params)
            engine.release_kv()
            same = [c.completion_ids for c in runs[name]] == [
                c.completion_ids for c in runs["full"]
            ]
            assert same, f"step {step}: {name} generated other tokens than full"
        num = config.run.micro_batch_seqs
        full = collate(runs["full"][:num])
        want = {key: signed(t) for key, t in full.guidance.items()}
        variants = {"nearest": trainer_codes(policy, full, guided=False, rollout=full)}
        nearest = variants["nearest"][0]
        wrong = {key: nearest[key] != want[key] for key in want}
        first_sparse = collate(runs[f"sparse {args.deltas[0]:g}"][:num])
        variants["nearest, derived scales"] = trainer_codes(
            policy, scales_only(first_sparse), True, full
        )
        for name in modes:
            variants[name] = trainer_codes(policy, collate(runs[name][:num]), True, full)
        if args.windows:
            window_stats(policy, full, first_sparse, windows)
        for name, (codes, tmpe, scales) in variants.items():
            t = totals[name]
            for key, w in want.items():
                t["agree"] += int((codes[key] == w).sum())
                t["total"] += w.numel()
                t["fixed"] += int((codes[key] == w)[wrong[key]].sum())
                t["wrong"] += int(wrong[key].sum())
            t["tmpe"] += tmpe / len(args.steps)
            for part, (equal, total) in scales.items():
                t[f"{part} equal"] += equal
                t[f"{part} total"] += total
            if name in runs:
                bytes_ = capture_bytes_per_generated_token(runs[name])["guidance"]
                t["bytes"] += bytes_ / len(args.steps)
                if name.startswith("sparse"):
                    generated = sum(len(c.completion_ids) for c in runs[name])
                    parts = zip(("amax", "block", "value"), sparse_bytes(runs[name]), strict=True)
                    for part, n in parts:
                        t[f"{part}_bytes"] += n / generated / len(args.steps)
                    for c in runs[name]:
                        for r in c.guidance.values():
                            for part in ("values", "blocks"):
                                stream = getattr(r, part)
                                t[f"{part} entries"] += int(((stream & 0x80) == 0).sum())
                                t[f"{part} bytes"] += stream.numel()
                    for (_, site), r in collate(runs[name][:num]).guidance.items():
                        share = shares[(name, site)]
                        share[0] += r.shape.numel()
                        share[1] += int(r.counts.sum(dtype=torch.int64))
                        share[2] += r.block_counts.numel() * (r.columns // 16)
                        share[3] += int(r.block_counts.sum(dtype=torch.int64))
                        t["recorded"] += int(r.counts.sum(dtype=torch.int64))
        print(f"step {step} done", flush=True)
    compact = totals["compact"]["bytes"]
    if args.windows:
        print_windows(windows)
    print(f"values compared per mode: {int(totals['full']['total'])}")
    for name, t in totals.items():
        if "recorded" in t:
            print(
                f"{name}: {100 * t['recorded'] / t['total']:.2f} % of the values recorded; "
                f"packed, {8 * t['values bytes'] / t['values entries']:.2f} bits per recorded "
                f"value, {8 * t['blocks bytes'] / max(t['blocks entries'], 1):.2f} per block"
            )
    for (name, site), (values, recorded, blocks, recorded_blocks) in shares.items():
        print(
            f"{name}, {site}: {100 * recorded / values:.3f} % of {values} values, "
            f"{100 * recorded_blocks / blocks:.3f} % of {blocks} blocks recorded"
        )
    print(
        "| trainer rounding | agreement | of nearest's misses | block scales equal "
        "| global scales equal | token_mult_prob_error | guidance B / generated token "
        "| vs compact |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, t in totals.items():
        bytes_ = t.get("bytes")
        split = ""
        if "amax_bytes" in t:
            split = (
                f" = {t['amax_bytes']:.0f} row maxima + {t['block_bytes']:.0f} blocks "
                f"+ {t['value_bytes']:.0f} values"
            )
        print(
            f"| {name} | {100 * t['agree'] / t['total']:.3f} % "
            f"| {100 * t['fixed'] / max(t['wrong'], 1):.1f} % "
            f"| {100 * t['block_scale equal'] / t['block_scale total']:.3f} % "
            f"| {100 * t['global_scale equal'] / t['global_scale total']:.3f} % "
            f"| {t['tmpe']:.5f} "
            f"| {'—' if bytes_ is None else f'{bytes_:.0f}{split}'} "
            f"| {'—' if bytes_ is None else f'{bytes_ / compact:.2f}'} |"
        )


if __name__ == "__main__":
    main()
