"""`fp4rl study`: the TRACE comparison in miniature: the rollout variants trained by GRPO from
one base policy, several seeds each, and what their runs recorded, aggregated.

1. The base policy: a small MoE of the size's shape, warmed up on the built-in addition task
   (`fp4rl.demo.base_policy`, cached by its settings), shared by every run.
2. GRPO (`fp4rl.loop.train`) from it for each variant of `VARIANTS` and each seed, one run
   directory each (``<out>/<variant>/seed<N>``), every run evaluated on held-out problems by
   the same BF16 evaluator (``run.eval_precision = "bf16"``). A finished run is skipped, a
   stopped one resumed from its latest checkpoint, so a study continues where it stopped.
   Each finished run's base and final policy are also evaluated on an engine of the run's own
   rollout precision (`rollout_evaluation`): the policy as it was sampled and would be served.
3. `aggregate`: per variant, curves of held-out accuracy, reward and the mismatch metrics with
   their spread over seeds (PNG), and ``results.md``: the final table, mismatch, throughput.

The GRPO run every variant shares is ``fp4rl/configs/study.toml``; `SIZES` says what each
size changes (model shape, warm-up, steps, task). Does not own the loop, the variants' meaning
(`fp4rl.config.AlignSection`) or a single run's report (`fp4rl.report`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from fp4rl import checkpoints, demo, inference, loop
from fp4rl import config as run_config
from fp4rl.model.presets import demo_qwen3_moe
from fp4rl.report import REPORT_EXTRA, read_metrics, series
from fp4rl.train.optim import OptimConfig

CONFIG_FILE = Path(__file__).resolve().parent / "configs" / "study.toml"

# The rollout variants of the comparison: name -> (what it is, its overrides of study.toml).
# The engine records full codes in the nearest variant too, so its code agreement is measured
# (what it records costs rollout time, not numerics); the asymmetric one has no FP4 activation
# in the trainer to compare, so its engine records routing only.
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bf16": (
        "BF16 rollout and BF16 trainer (no FP4 anywhere)",
        (
            "precision.experts=bf16",
            "precision.kv_cache=bf16",
            "engine.capture_routing=false",
            "engine.guidance=none",
        ),
    ),
    "nearest": (
        "NVFP4 rollout, plain QAT trainer rounding to nearest (W4A4), router replay",
        ("align.rounding=nearest",),
    ),
    "asymmetric": (
        "NVFP4 rollout, W4A16 trainer (expert activations and KV in BF16), router replay",
        (
            "engine.guidance=none",
            "align.rounding=nearest",
            "align.trainer_activations=bf16",
        ),
    ),
    "guided-compact": (
        "NVFP4 rollout, trainer following its compact records (latter half of the layers)",
        ("engine.guidance=compact",),
    ),
    "guided-full": (
        "NVFP4 rollout, trainer following its full records (every FP4 site)",
        ("engine.guidance=full",),
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Size:
    """One setting of the study: the base policy's shape and warm-up, and its overrides of
    ``study.toml``."""

    description: str
    model: dict  # `demo_qwen3_moe` overrides
    warmup: demo.Warmup
    warmup_dtype: str  # the warm-up's model.dtype (GRPO runs in study.toml's)
    seeds: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    base_seed: int = 0


SIZES = {
    "small": Size(
        description="4 MoE layers, hidden 64, 32 experts top-4 (0.8M parameters), every layer "
        "NVFP4; 1-2 digit addition; 100 steps of 64 prompts x 8; for 2 CPU cores",
        model=dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=32),
        warmup=demo.Warmup(),
        warmup_dtype="float32",
        seeds=(0, 1, 2),
    ),
    "long": Size(
        description="the small shape on a sum of 8 one-digit operands, every running sum "
        "written out in 2 digits (21-token completions); 40 steps of 32 prompts x 8; for 2 CPU "
        "cores",
        model=dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=32),
        warmup=demo.Warmup(steps=3000, target_accuracy=0.4, check_every=50),
        warmup_dtype="float32",
        seeds=(0, 1),
        overrides=(
            "task.num_operands=8",
            "task.partial_sums=true",
            "task.fixed_width=2",
            "task.max_digits=1",
            "task.num_held_out=100",
            "engine.max_model_len=48",
            "rollout.prompts_per_step=32",
            "rollout.max_tokens=24",
            "run.steps=40",
            "run.eval_samples=2",
            "run.checkpoint_every=20",
        ),
    ),
    "full": Size(
        description="8 MoE layers, hidden 384, 64 experts top-4 (~98M parameters, 9M active), "
        "every layer NVFP4; 1-3 digit addition; 300 steps of 128 prompts x 8; for one GPU",
        model=dict(
            hidden_size=384,
            intermediate_size=768,
            moe_intermediate_size=160,
            num_hidden_layers=8,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=64,
            num_experts_per_tok=4,
        ),
        warmup=demo.Warmup(
            steps=4000, batch=256, optim=OptimConfig(lr=1e-3, warmup_steps=100, max_grad_norm=1.0)
        ),
        warmup_dtype="bfloat16",
        seeds=(0, 1, 2, 3, 4),
        overrides=(
            "task.max_digits=3",
            "rollout.prompts_per_step=128",
            "rollout.max_tokens=6",
            "run.steps=300",
            "run.eval_every=20",
            "align.observe_every=20",
            "run.checkpoint_every=50",
            "run.threads=0",
            "engine.kv_memory_bytes=1073741824",
        ),
    ),
}


def size_config(size: Size, overrides=()) -> run_config.RunConfig:
    """study.toml with the size's overrides, then the caller's."""
    return run_config.load(CONFIG_FILE, [*size.overrides, *overrides])


def base_policy(size: Size, cache_dir: Path, overrides=(), log=print) -> Path:
    """The size's warmed-up base policy (built once, then reused from ``cache_dir``)."""
    config = size_config(size, [*overrides, f"model.dtype={size.warmup_dtype}"])
    return demo.base_policy(
        config,
        cache_dir,
        seed=size.base_seed,
        warmup=size.warmup,
        model=demo_qwen3_moe(**size.model),
        log=log,
    )


def run_config_for(size: Size, variant: str, seed: int, base: Path, out: Path, overrides=()):
    """The resolved config of one run of the study."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")
    return size_config(
        size,
        [
            *VARIANTS[variant][1],
            *overrides,
            f"model.path={base}",
            f"run.seed={seed}",
            f"run.out_dir={run_dir(out, variant, seed)}",
        ],
    )


def run_dir(out: Path, variant: str, seed: int) -> Path:
    return Path(out) / variant / f"seed{seed}"


def run_state(config: run_config.RunConfig) -> str:
    """``"done"``, ``"resume"`` (a checkpoint to continue from) or ``"new"``. A run directory
    whose config is another one is an error: the study never mixes runs of two configs. The
    saved config is read as this version reads it (a setting added since takes its default)."""
    path = Path(config.run.out_dir)
    saved = path / "config.toml"
    if saved.is_file() and run_config.load(saved) != config:
        raise ValueError(
            f"{path} holds a run of another config (its config.toml differs from this study's "
            "run): remove it or choose another --out"
        )
    if (path / "metrics.jsonl").is_file():
        entries = read_metrics(path)
        last = entries[-1]
        if last["step"] == config.run.steps and "reward" not in last:
            return "done"  # the final evaluation is written last
    return "resume" if checkpoints.latest_checkpoint(path) is not None else "new"


def _train(config: run_config.RunConfig, resume: bool) -> str:
    """One run, its log lines to ``<run dir>/log.txt`` (a worker process's entry point)."""
    path = Path(config.run.out_dir)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "log.txt", "a") as log_file:

        def log(line: str) -> None:
            log_file.write(line + "\n")
            log_file.flush()

        loop.train(config, log=log, resume=resume)
    return str(path)


def run(
    size_name: str,
    out: Path,
    *,
    cache_dir: Path,
    variants: tuple[str, ...] = tuple(VARIANTS),
    seeds: tuple[int, ...] | None = None,
    overrides: tuple[str, ...] = (),
    jobs: int = 1,
    log=print,
) -> Path:
    """The whole study: base policy, every run not yet done, then `aggregate`; returns the
    path of ``results.md``."""
    if size_name not in SIZES:
        raise ValueError(f"unknown size {size_name!r}; sizes: {', '.join(SIZES)}")
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    size = SIZES[size_name]
    seeds = size.seeds if seeds is None else seeds
    out = Path(out)
    log(f"size {size_name}: {size.description}")
    base = base_policy(size, cache_dir, overrides, log)
    configs = [
        run_config_for(size, v, s, base, out, overrides) for s in seeds for v in variants
    ]  # checked before the first run starts; seed by seed, so a stopped study has whole seeds
    todo = [(c, state) for c in configs if (state := run_state(c)) != "done"]
    log(f"{len(configs) - len(todo)} of {len(configs)} runs done; running {len(todo)}")
    start = time.perf_counter()
    if jobs == 1:
        for config, state in todo:
            log(f"{state} {config.run.out_dir}")
            _train(config, state == "resume")
    else:
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(_train, c, state == "resume") for c, state in todo]
            for future in futures:
                log(f"finished {future.result()} ({time.perf_counter() - start:.0f}s)")
    for config in configs:
        rollout_evaluation(config, log=log)
    (out / "study.json").write_text(
        json.dumps(
            {
                "size": size_name,
                "base_policy": str(base),
                "variants": list(variants),
                "seeds": list(seeds),
                "overrides": list(overrides),
            },
            indent=1,
        )
        + "\n"
    )
    return aggregate(out, variants=variants, seeds=seeds, log=log)


ROLLOUT_EVAL = "eval_rollout_precision.json"
EVAL_KEYS = ("held_out_accuracy", "held_out_greedy")


def rollout_evaluation(config: run_config.RunConfig, *, log=print) -> dict:
    """``{"base": {...}, "final": {...}}``: held-out accuracy of the run's base policy and of its
    last checkpoint on an engine of the run's own precision (`fp4rl.inference.evaluate_policy`,
    the evaluation the loop does), kept in the run directory's ``eval_rollout_precision.json``
    and read back from it once there."""
    path = Path(config.run.out_dir)
    if (path / ROLLOUT_EVAL).is_file():
        return json.loads((path / ROLLOUT_EVAL).read_text())
    latest = checkpoints.latest_checkpoint(path)
    if latest is None or latest.name != f"step-{config.run.steps:08d}":
        raise ValueError(f"{path} has no checkpoint of its last step {config.run.steps}")
    out = {}
    for name, weights in (("base", config.model.path), ("final", latest / "model")):
        at = run_config.load(path / "config.toml", [f"model.path={json.dumps(str(weights))}"])
        scores = inference.evaluate_policy(at, "config", log=log)
        out[name] = {k: scores[k] for k in EVAL_KEYS}
    checkpoints.write_atomic(path / ROLLOUT_EVAL, json.dumps(out, indent=1) + "\n")
    log(f"{path}: under its rollout precision {out}")
    return out


# --- aggregation ---------------------------------------------------------------------------

# The mismatch metrics of the table: FP4 codes (full records) or mantissa bits (compact
# records) the trainer reproduced, and the logprob gap of the update's and observe's tokens.
MISMATCH = ("code_agreement", "mantissa_agreement", "token_mult_prob_error", "observed_kl")
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
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ModuleNotFoundError(
            f"fp4rl study draws with matplotlib ({err}): {REPORT_EXTRA}", name="matplotlib"
        ) from None
    written = []
    for name, (title, panels) in CURVES.items():
        keys = [k for k in panels if any(band(r, k)[0] for r in runs.values())]
        figure = Figure(figsize=(8, 3.2 * len(keys) + 0.6), layout="constrained")
        FigureCanvasAgg(figure)
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
        "KL (k3) | rollout tokens/s | step time (s) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for variant, row in table.items():
        cells = [
            _pm(row, "code_agreement", 3, 100),
            _pm(row, "mantissa_agreement", 3, 100),
            _pm(row, "token_mult_prob_error", 5),
            _pm(row, "observed_kl", 6),
            _pm(row, "rollout_tokens_per_s", 0),
            _pm(row, "step_s", 2),
        ]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Mismatch: agreement and KL (k3 estimate, sampled tokens) measured every "
        "`align.observe_every` steps before the update, token_mult_prob_error (mean "
        "exp(|Δlogp|)) by every update over its tokens; each run's mean, then mean ± std over "
        "seeds. Throughput and step time (rollout + train + refit): each run's median step, "
        "then mean ± std.",
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in figures]
    return "\n".join(lines) + "\n"


def aggregate(out: Path, *, variants=tuple(VARIANTS), seeds=(0, 1, 2), log=print) -> Path:
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
