"""Looking at a run: its metrics plotted and summarized in ``report.md``.

A run directory holds ``config.toml`` and ``metrics.jsonl`` (`fp4rl.loop`: one JSON object per
step, the last one the final evaluation), read by `fp4rl.metrics_log`. This module owns what is
drawn and written from them afterwards:

- `FIGURES` and `plot`: PNG plots of what the run recorded (`figure_maker`, the matplotlib
  figures they and `fp4rl.study_results` draw on);
- `summary`: ``report.md``'s text, its sections the configuration that defines the run, reward
  and held-out accuracy, the trainer-vs-rollout mismatch, the update, time per phase and what
  is not plotted;
- `write_report`: the plots and ``report.md`` of a run into its report directory.

It does not own which metrics exist (the loop, `fp4rl.train.observe`, `fp4rl.train.step`) or
reading them back and mirroring them to TensorBoard (`fp4rl.metrics_log`, the one module of
fp4rl it imports). matplotlib is an optional extra, imported only when used.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from pathlib import Path

from fp4rl.metrics_log import is_number, read_metrics, series

REPORT_EXTRA = "pip install 'fp4rl[report]'"


def _recorded(entries: list[dict], *patterns: str) -> list[str]:
    """The numeric keys recorded by any entry that match ``patterns`` (regexes), in the
    patterns' order, each pattern's keys sorted with layers in numeric order."""
    recorded = {k for m in entries for k, v in m.items() if k != "step" and is_number(v)}
    out = []
    for pattern in patterns:
        keys = [k for k in recorded - set(out) if re.fullmatch(pattern, k)]
        out += sorted(
            keys, key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)]
        )
    return out


# A figure: its file, title and panels; a panel: its y label and the patterns of the keys it
# draws, one line each. Panels with nothing recorded are left out, figures without panels too.
FIGURES = {
    "reward.png": (
        "Reward and held-out accuracy",
        [
            ("share", [r"reward", r"held_out_accuracy", r"held_out_greedy"]),
            ("KL to the reference policy (k3)", [r"kl"]),  # with grpo.kl_coef > 0
        ],
    ),
    "gap.png": (
        "Trainer vs rollout: logprob gap on the sampled tokens",
        [
            (
                "mean exp(|Δlogp|)",
                [r"token_mult_prob_error", r"observed_token_mult_prob_error"],
            ),
            ("KL (k3 estimate)", [r"observed_kl"]),
            ("max |Δlogp|", [r"observed_max_abs_dlogp"]),
            ("a completion's |Σ Δlogp|, mean and max", [r"observed_seq_.*abs_dlogp"]),
            ("completions past 2x", [r"observed_seq_past_2x"]),
        ],
    ),
    "agreement.png": (
        "Trainer vs rollout agreement at the captured FP4 sites",
        [
            ("codes, per layer", [r"code_agreement", r"code_agreement/layer\d+"]),
            ("codes, per site kind", [r"code_agreement/(?!layer\d+$).+"]),
            (
                "block scales, bits",
                [r"block_scale_agreement", r"mantissa_agreement", r"sparse_bit_agreement"],
            ),
            ("sparse: values recorded", [r"sparse_recorded_share"]),
            ("top-k experts, per layer", [r"router_agreement/layer\d+"]),
        ],
    ),
    "update.png": (
        "The update: clipping, correction, entropy, gradient",
        [
            ("share of tokens", [r"clip_frac_low", r"clip_frac_high", r"correction_frac"]),
            ("mean ratio", [r"ratio_mean", r"is_ratio_mean", r"is_weight_mean"]),
            ("entropy, nats", [r"entropy"]),
            ("gradient norm", [r"grad_norm"]),
        ],
    ),
    "time.png": (
        "Time per phase and rollout throughput",
        [
            ("seconds", [r"rollout_s", r"train_s", r"refit_s", r"graph_capture_s"]),
            ("rollout tokens/s", [r"rollout_tokens_per_s"]),
            ("peak memory, GiB", [r"peak_.+_gib"]),
        ],
    ),
}


def figure_maker(who: str):
    """A function making matplotlib Figures that draw into memory (no pyplot, no global backend
    switch), for ``who`` ("fp4rl report", "fp4rl study"); matplotlib is imported here, and its
    absence named with the extra that provides it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ModuleNotFoundError(
            f"{who} draws with matplotlib ({err}): {REPORT_EXTRA}", name="matplotlib"
        ) from None

    def new_figure(figsize: tuple[float, float]):
        figure = Figure(figsize=figsize, layout="constrained")
        FigureCanvasAgg(figure)
        return figure

    return new_figure


def plot(entries: list[dict], out_dir: Path) -> list[Path]:
    """The PNGs of ``FIGURES`` that have something recorded; a known PNG left from an earlier
    report of a run that no longer has its metrics is removed, so the folder matches the
    summary."""
    new_figure = figure_maker("fp4rl report")
    written = []
    for name, (title, panels) in FIGURES.items():
        drawn = [
            (label, keys) for label, patterns in panels if (keys := _recorded(entries, *patterns))
        ]
        path = out_dir / name
        if not drawn:
            path.unlink(missing_ok=True)
            continue
        figure = new_figure(figsize=(8, 2.6 * len(drawn) + 0.6))
        axes = figure.subplots(len(drawn), 1, sharex=True, squeeze=False)[:, 0]
        for ax, (label, keys) in zip(axes, drawn, strict=True):
            for key in keys:
                steps, values = series(entries, key)
                # An overall value drawn among its parts (code_agreement among its layers).
                parts = any(k.startswith(f"{key}/") for k in keys)
                whole = {"color": "black", "linestyle": "--"} if parts else {}
                marker = "." if len(steps) < 60 else None
                ax.plot(steps, values, marker=marker, label=key, **whole)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
        axes[-1].set_xlabel("step")
        figure.suptitle(title)
        _atomic(path, lambda tmp, f=figure: f.savefig(tmp, format="png", dpi=100))
        written.append(path)
    return written


def _atomic(path: Path, write) -> None:
    """``write(tmp)`` then rename over ``path``: a reader never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# What the summary's configuration table shows, when the run's config.toml sets it: every
# setting that changes the numbers a run computes (its formats, what the rollout records and
# the trainer follows, the trainer's forward, the update's grouping, the evaluator) and the
# run's scale.
ESSENTIALS = {
    "model": ("path", "dtype", "device"),
    "precision": ("experts", "kv_cache", "bf16_first_layers", "bf16_last_layers", "guided_sites"),
    "engine": ("capture_routing", "guidance", "compact_fraction", "sparse_delta"),
    "align": ("replay", "rounding", "trainer_activations", "trainer_forward", "observe_every"),
    "rollout": ("prompts_per_step", "samples_per_prompt", "max_tokens", "temperature"),
    "grpo": ("correction", "tis_cap", "mask_low", "mask_high", "geo_mask_low", "geo_mask_high"),
    "optim": ("lr",),
    "task": ("kind",),
    "run": ("steps", "seed", "eval_every", "eval_precision", "micro_batch_seqs"),
}
# Shown only where they act: a setting -> (the setting that turns it on, its values that do).
ACTS_WHEN = {
    "engine.compact_fraction": ("engine.guidance", ("compact",)),
    "engine.sparse_delta": ("engine.guidance", ("sparse",)),
    "grpo.tis_cap": ("grpo.correction", ("tis", "seq_tis")),
    "grpo.mask_low": ("grpo.correction", ("mask", "seq_mask")),
    "grpo.mask_high": ("grpo.correction", ("mask", "seq_mask")),
    "grpo.geo_mask_low": ("grpo.correction", ("geo_mask",)),
    "grpo.geo_mask_high": ("grpo.correction", ("geo_mask",)),
}
# config.toml leaves out a setting whose value is None (TOML has none); what that means.
WHEN_UNSET = {
    "engine.guidance": "unset: no guidance recorded",
    "align.replay": "unset: replay iff the engine records routing",
    "align.rounding": "unset: guided iff the engine records guidance",
}
GAP = (
    "token_mult_prob_error",
    "observed_token_mult_prob_error",
    "observed_kl",
    "observed_max_abs_dlogp",
    "observed_seq_abs_dlogp",
    "observed_seq_max_abs_dlogp",
    "observed_seq_past_2x",
)
# Within a few ulps of 1 when the sides agree: shown as their distance from 1.
NEAR_ONE = ("token_mult_prob_error", "observed_token_mult_prob_error")
AGREEMENT = (
    r"code_agreement(/.+)?",
    r"adjacent_share",
    r"block_scale_agreement",
    r"mantissa_agreement",
    r"sparse_bit_agreement",
    r"sparse_recorded_share",
    r"router_agreement/.+",
)
PHASES = ("rollout", "train", "refit")


def _fmt(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]


def _read_config(run_dir: Path) -> dict | None:
    path = run_dir / "config.toml"
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML: {err}") from None


def _config_section(config: dict | None) -> list[str]:
    if config is None:
        return ["The run directory has no `config.toml`."]
    rows = []
    for section, keys in ESSENTIALS.items():
        table = config.get(section)
        if not isinstance(table, dict):
            continue
        for key in keys:
            name = f"{section}.{key}"
            if name in ACTS_WHEN:
                on, values = ACTS_WHEN[name]
                if _setting(config, on) not in values:
                    continue
            if key in table:
                rows.append([f"`{name}`", f"`{json.dumps(table[key])}`"])
            elif name in WHEN_UNSET:
                rows.append([f"`{name}`", WHEN_UNSET[name]])
    return [*_table(["setting", "value"], rows), "", "All settings: `config.toml`."]


def _setting(config: dict, name: str):
    """The value of ``section.key`` in a config read from TOML; None when it is not there."""
    section, key = name.split(".")
    table = config.get(section)
    return table.get(key) if isinstance(table, dict) else None


def _extremes(entries: list[dict], key: str) -> tuple[tuple, tuple, tuple, tuple] | None:
    """``(first, last, min, max)`` of a recorded key, each as ``(value, step)``; None when the
    key was never recorded. Non-finite values count for first and last, not for min and max."""
    steps, values = series(entries, key)
    if not steps:
        return None
    pairs = list(zip(values, steps, strict=True))
    finite = [p for p in pairs if math.isfinite(p[0])] or pairs
    low = min(finite, key=lambda p: p[0])
    high = max(finite, key=lambda p: p[0])
    return pairs[0], pairs[-1], low, high


def _at(pair: tuple) -> str:
    return f"{_fmt(pair[0])} (step {pair[1]})"


def _outcome_section(entries: list[dict], pngs: set[str]) -> list[str]:
    rows = []
    for key in ("held_out_accuracy", "held_out_greedy", "reward"):
        if found := _extremes(entries, key):
            first, last, _, best = found
            rows.append([f"`{key}`", _at(first), _at(last), _at(best)])
    lines = _table(["metric", "first", "last", "best"], rows) if rows else ["Nothing recorded."]
    if "reward.png" in pngs:
        lines += ["", "![reward and held-out accuracy](reward.png)"]
    return lines


def _mismatch_section(entries: list[dict], pngs: set[str]) -> list[str]:
    keys = _recorded(entries, *GAP, *AGREEMENT)
    if not keys:
        return [
            "No trainer-vs-rollout metrics were recorded (no update ran and "
            "`align.observe_every` is 0), so there is no gap or agreement plot."
        ]
    rows = []
    for key in keys:
        first, last, low, high = _extremes(entries, key)
        shift, name = (1.0, f"`{key}` - 1") if key in NEAR_ONE else (0.0, f"`{key}`")
        low, high, last = ((v - shift, s) for v, s in (low, high, last))
        rows.append([name, _at(low), _at(high), _fmt(last[0]), len(series(entries, key)[0])])
    lines = _table(["metric", "min", "max", "last", "steps recorded"], rows)
    lines += [
        "",
        "`token_mult_prob_error` is the mean of exp(|logp_train - logp_rollout|) over the "
        "tokens of the step's update (1 when the two sides agree; no value at a step that "
        "trained nothing). The `observed_` gap metrics (the same mean, the k3 estimate of "
        "KL(rollout || trainer) and max |logp_train - logp_rollout|) and the agreements are "
        "measured on the observed batch every `align.observe_every` steps.",
    ]
    if "gap.png" in pngs:
        lines += ["", "![logprob gap](gap.png)"]
    if "agreement.png" in pngs:
        lines += ["", "![agreement per layer and site kind](agreement.png)"]
    else:
        lines += [
            "",
            "No code or routing agreement was recorded (the engine recorded no guidance, or "
            "`align.observe_every` is 0), so there is no agreement plot.",
        ]
    return lines


def _update_section(pngs: set[str]) -> list[str]:
    if "update.png" not in pngs:
        return ["No update ran, so there is no update plot."]
    return [
        "Per update, over its tokens: the shares clipped below and above (r = pi / pi_prox "
        "out of [1 - clip_low, 1 + clip_high] where it binds; r is 1 with one update a "
        "rollout, `grpo.mini_batches` 1) and corrected (rho = pi_prox / rollout past "
        "`grpo.tis_cap`, or masked), the mean r and rho, the entropy of the trainer's "
        "distribution and the gradient norm before clipping; a step of several updates "
        "shows their mean.",
        "",
        "![the update](update.png)",
    ]


def _time_section(entries: list[dict], pngs: set[str]) -> list[str]:
    totals = {p: sum(series(entries, f"{p}_s")[1]) for p in PHASES}
    counted = {p: len(series(entries, f"{p}_s")[0]) for p in PHASES}
    if not any(counted.values()):
        return ["No phase times were recorded."]
    whole = sum(totals.values())
    rows = [
        [p, totals[p], totals[p] / counted[p], f"{100 * totals[p] / whole:.1f} %"]
        for p in PHASES
        if counted[p]
    ]
    lines = _table(["phase", "total s", "mean s per step", "share"], rows)
    _, tokens = series(entries, "generated_tokens")
    rollout_s = [m["rollout_s"] for m in entries if "generated_tokens" in m and "rollout_s" in m]
    if tokens and len(rollout_s) == len(tokens) and sum(rollout_s) > 0:
        _, per_step = series(entries, "rollout_tokens_per_s")
        line = (
            f"Rollout: {_fmt(sum(tokens))} tokens generated in {_fmt(sum(rollout_s))} s, "
            f"{_fmt(sum(tokens) / sum(rollout_s))} tokens/s"
        )
        if per_step:
            line += f" (per step {_fmt(min(per_step))} to {_fmt(max(per_step))})"
        lines += ["", line + ". Held-out evaluations are not timed."]
    peaks = _recorded(entries, r"peak_.+_gib")
    if peaks:
        lines += [
            "",
            "Peak memory: "
            + ", ".join(f"{k} {_fmt(max(series(entries, k)[1]))}" for k in peaks)
            + ".",
        ]
    if "time.png" in pngs:
        lines += ["", "![time per phase and tokens/s](time.png)"]
    return lines


def _rest_section(entries: list[dict]) -> list[str]:
    patterns = [p for _, panels in FIGURES.values() for _, keys in panels for p in keys]
    plotted = set(_recorded(entries, *patterns))
    rest = [k for k in _recorded(entries, r".+") if k not in plotted]
    if not rest:
        return ["Every numeric metric the run recorded is plotted above."]
    return ["Also recorded in `metrics.jsonl`: " + ", ".join(f"`{k}`" for k in rest) + "."]


def summary(run_dir: Path, entries: list[dict], pngs: set[str]) -> str:
    """``report.md``'s text: what the run was, how it went, where its time went."""
    trained = [m["step"] for m in entries if "reward" in m]
    final = entries[-1] if "reward" not in entries[-1] else None
    head = f"{len(trained)} GRPO steps recorded" + (
        f" (steps {trained[0]} to {trained[-1]})" if trained else ""
    )
    head += (
        f"; final evaluation at step {final['step']}."
        if final is not None
        else "; no final evaluation: the run stopped before its end or is still running."
    )
    sections = [
        ("Configuration", _config_section(_read_config(run_dir))),
        ("Reward and held-out accuracy", _outcome_section(entries, pngs)),
        ("Trainer vs rollout", _mismatch_section(entries, pngs)),
        ("The update", _update_section(pngs)),
        ("Time", _time_section(entries, pngs)),
        ("Not plotted", _rest_section(entries)),
    ]
    lines = [f"# Run report: `{run_dir}`", "", head]
    for title, body in sections:
        lines += ["", f"## {title}", "", *body]
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Plots and ``report.md`` of a run into ``out_dir`` (default ``<run_dir>/report``);
    returns the files written, ``report.md`` last."""
    run_dir = Path(run_dir)
    entries = read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot(entries, out)
    text = summary(run_dir, entries, {p.name for p in pngs})
    md = out / "report.md"
    _atomic(md, lambda tmp: tmp.write_text(text))
    return [*pngs, md]
