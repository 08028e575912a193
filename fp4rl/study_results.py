"""What `fp4rl study` writes and reads back: the layout of a study directory (`run_dir`, each run's
``eval_rollout_precision.json``) and the aggregation of its finished runs (`aggregate`): per
variant, curves of held-out accuracy, reward and the mismatch metrics with their spread over
seeds (PNG), ``summary.json`` and ``results.md`` (the final table, mismatch, throughput).

Does not own how the runs are made (`fp4rl.study`) or a single run's report (`fp4rl.report`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from fp4rl.metrics_log import read_metrics, series
from fp4rl.report import figure_maker

ROLLOUT_EVAL = "eval_rollout_precision.json"
EVAL_KEYS = ("held_out_accuracy", "held_out_greedy")


def run_dir(out: Path, variant: str, seed: int) -> Path:
    """The run directory of one variant and seed in a study's ``out``."""
    return Path(out) / variant / f"seed{seed}"


# The mismatch metrics of the table: FP4 codes (full records) or mantissa bits (compact
# records) the trainer reproduced, and the logprob gap of the update's and observe's tokens.
MISMATCH = (
    "code_agreement",
    "mantissa_agreement",
    "token_mult_prob_error",
    "observed_kl",
    "observed_seq_abs_dlogp",
)
# The figures: file -> (title, the keys drawn, one panel each).
CURVES = {
    "accuracy.png": (
        "Held-out accuracy (BF16 evaluator)",
        ["held_out_accuracy", "held_out_greedy"],
    ),
    "reward.png": ("Training reward", ["reward"]),
    "mismatch.png": (
        "Trainer vs rollout",
        ["code_agreement", "mantissa_agreement", "token_mult_prob_error"],
    ),
}
LABELS = {
    "held_out_accuracy": "held-out accuracy, sampled",
    "held_out_greedy": "held-out accuracy, greedy",
    "reward": "reward (mean over the step's samples)",
    "code_agreement": "FP4 code agreement (full records)",
    "mantissa_agreement": "mantissa-bit agreement (compact)",
    "token_mult_prob_error": "token_mult_prob_error - 1 (update)",
}
EXCESS = {"token_mult_prob_error"}  # drawn as value - 1 on a log scale


def load_runs(out: Path, variants, seeds) -> tuple[dict, dict]:
    """Each variant's finished runs' entries, and their `rollout_evaluation` (None for a run
    without one); an unfinished run is an error naming it."""
    runs, evals = {}, {}
    for variant in variants:
        runs[variant], evals[variant] = [], []
        for seed in seeds:
            path = run_dir(out, variant, seed)
            entries = read_metrics(path)
            if "reward" in entries[-1]:
                raise ValueError(
                    f"{path} has not finished (its last entry is step {entries[-1]['step']}, "
                    "not the final evaluation)"
                )
            runs[variant].append(entries)
            saved = path / ROLLOUT_EVAL
            evals[variant].append(json.loads(saved.read_text()) if saved.is_file() else None)
    return runs, evals


def spread(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def band(
    runs: list[list[dict]], key: str
) -> tuple[list[int], list[float], list[float], list[float]]:
    """``(steps, mean, min, max)`` over the seeds at the steps every seed recorded ``key``."""
    per_seed = [dict(zip(*series(entries, key), strict=True)) for entries in runs]
    steps = sorted(set.intersection(*(set(s) for s in per_seed)))
    values = [[s[step] for s in per_seed] for step in steps]
    return (
        steps,
        [statistics.fmean(v) for v in values],
        [min(v) for v in values],
        [max(v) for v in values],
    )


def summarize(runs: dict, evals: dict | None = None) -> dict[str, dict[str, float]]:
    """Per variant: final held-out accuracy (mean, std over seeds) and its gain over step 0,
    by the BF16 evaluator and (``rollout_*``, when every seed has one) under the rollout's
    precision; the mismatch metrics averaged over each run's measurements; the run's median
    rollout tokens/s and step time (rollout + train + refit)."""
    table = {}
    for variant, seed_runs in runs.items():
        row: dict[str, float] = {"seeds": len(seed_runs)}
        pairs = {"": [(e[0], e[-1]) for e in seed_runs]}
        seed_evals = (evals or {}).get(variant, [None])
        if all(seed_evals):
            pairs["rollout_"] = [(e["base"], e["final"]) for e in seed_evals]
        for prefix, start_end in pairs.items():
            for key in EVAL_KEYS:
                finals = [end[key] for _, end in start_end]
                gains = [end[key] - start[key] for start, end in start_end]
                row[prefix + key], row[f"{prefix}{key}_std"] = spread(finals)
                row[f"{prefix}{key}_gain"], row[f"{prefix}{key}_gain_std"] = spread(gains)
        for key in MISMATCH:
            means = [statistics.fmean(v) for e in seed_runs if (v := series(e, key)[1])]
            if means:
                row[key], row[f"{key}_std"] = spread(means)
        for key, parts in (
            ("rollout_tokens_per_s", ("rollout_tokens_per_s",)),
            ("step_s", ("rollout_s", "train_s", "refit_s")),
        ):
            medians = [
                statistics.median(sum(m[p] for p in parts) for m in e if "reward" in m)
                for e in seed_runs
            ]
            row[key], row[f"{key}_std"] = spread(medians)
        table[variant] = row
    return table


def plot(runs: dict[str, list[list[dict]]], out: Path) -> list[Path]:
    """The PNGs of `CURVES`: each variant's mean over seeds, its min-max shaded; a panel no
    run recorded is left out."""
    new_figure = figure_maker("fp4rl study")
    written = []
    for name, (title, panels) in CURVES.items():
        keys = [k for k in panels if any(band(r, k)[0] for r in runs.values())]
        figure = new_figure(figsize=(8, 3.2 * len(keys) + 0.6))
        axes = figure.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
        for ax, key in zip(axes, keys, strict=True):
            for index, (variant, seed_runs) in enumerate(runs.items()):
                steps, mean, low, high = band(seed_runs, key)
                if not steps:
                    continue
                if key in EXCESS:
                    mean, low, high = ([v - 1 for v in vs] for vs in (mean, low, high))
                    ax.set_yscale("log")
                color = f"C{index}"
                ax.plot(
                    steps, mean, color=color, label=variant, marker="." if len(steps) < 40 else None
                )
                ax.fill_between(steps, low, high, color=color, alpha=0.15, linewidth=0)
            ax.set_ylabel(LABELS[key])
            if key not in EXCESS:
                ax.ticklabel_format(axis="y", useOffset=False)  # 0.99999, not 1e-5 + 0.9999
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
        axes[-1].set_xlabel("GRPO step")
        figure.suptitle(f"{title}: mean over seeds, min-max shaded")
        path = out / name
        figure.savefig(path, dpi=110)
        written.append(path)
    return written


def _pm(row: dict, key: str, digits: int, scale: float = 1.0) -> str:
    if key not in row:
        return "—"
    return f"{scale * row[key]:.{digits}f} ± {scale * row[f'{key}_std']:.{digits}f}"


def _accuracy_table(table: dict, prefix: str) -> list[str]:
    lines = [
        "| variant | seeds | held-out sampled, final | gain over step 0 | held-out greedy, "
        "final | gain over step 0 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for variant, row in table.items():
        keys = [prefix + k + end for k in EVAL_KEYS for end in ("", "_gain")]
        cells = [_pm(row, k, 1, 100) for k in keys]
        lines.append(f"| {variant} | {row['seeds']:.0f} | " + " | ".join(cells) + " |")
    return lines


def markdown(table: dict[str, dict[str, float]], figures: list[Path]) -> str:
    """The tables and figure links of ``results.md`` (figures linked by file name)."""
    lines = [
        "By the BF16 evaluator (the trained weights, no FP4 module):",
        "",
        *_accuracy_table(table, ""),
        "",
        "Under each variant's own rollout precision (its base and final policy on an engine "
        "like its rollout's):",
        "",
        *_accuracy_table(table, "rollout_"),
        "",
        "Accuracy in %, mean ± sample standard deviation over seeds.",
        "",
        "| variant | code agreement (%) | mantissa agreement (%) | token_mult_prob_error | "
        "KL (k3) | a completion's mean abs(Σ Δlogp) | rollout tokens/s | step time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, row in table.items():
        cells = [
            _pm(row, "code_agreement", 3, 100),
            _pm(row, "mantissa_agreement", 3, 100),
            _pm(row, "token_mult_prob_error", 5),
            _pm(row, "observed_kl", 6),
            _pm(row, "observed_seq_abs_dlogp", 4),
            _pm(row, "rollout_tokens_per_s", 0),
            _pm(row, "step_s", 2),
        ]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Mismatch: agreement, KL (k3 estimate, sampled tokens) and a completion's summed gap "
        "(nats) measured every `align.observe_every` steps before the update, "
        "token_mult_prob_error (mean "
        "exp(|Δlogp|)) by every update over its tokens; each run's mean, then mean ± std over "
        "seeds. Throughput and step time (rollout + train + refit): each run's median step, "
        "then mean ± std.",
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in figures]
    return "\n".join(lines) + "\n"


def aggregate(out: Path, *, variants, seeds, log=print) -> Path:
    """Curves, ``summary.json`` and ``results.md`` in ``out`` from its finished runs."""
    out = Path(out)
    runs, evals = load_runs(out, variants, seeds)
    table = summarize(runs, evals)
    figures = plot(runs, out)
    (out / "summary.json").write_text(json.dumps(table, indent=1, allow_nan=False) + "\n")
    path = out / "results.md"
    path.write_text(markdown(table, figures))
    for variant, row in table.items():
        acc = _pm(row, "held_out_accuracy", 1, 100)
        log(f"{variant:>15}: held-out sampled {acc} %")
    log(f"wrote {path}")
    return path
