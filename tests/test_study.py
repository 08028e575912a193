"""`fp4rl study` end to end on a tiny setting: two variants, one seed, two steps; the aggregate
is checked against the runs' own metrics, a finished study is skipped and a stopped run resumed
to the same numbers."""

import json
import shutil

import pytest

from fp4rl import demo, study, study_results
from fp4rl.checkpoints import FOLDER
from fp4rl.metrics_log import read_metrics
from fp4rl.train.optim import OptimConfig

TINY = study.Size(
    description="the demo's shape, barely warmed up",
    model={},
    warmup=demo.Warmup(steps=10, check_every=10, optim=OptimConfig(lr=3e-3, warmup_steps=2)),
    warmup_dtype="float32",
    seeds=(0,),
    overrides=(
        "model.device=cpu",  # a resumed run equal to the unstopped one: the CPU's promise
        "run.steps=2",
        "run.eval_every=1",
        "run.eval_samples=1",
        "run.checkpoint_every=1",
        "run.keep_checkpoints=2",
        "align.observe_every=1",
        "rollout.prompts_per_step=8",
        "rollout.max_tokens=4",
        "task.num_held_out=16",
        "task.format_reward=0.5",
    ),
)
VARIANTS = ("nearest", "guided-full")
VOLATILE = (
    "rollout_s",
    "train_s",
    "refit_s",
    "graph_capture_s",
    "rollout_tokens_per_s",
)  # wall-clock


def run(tmp_path, lines):
    return study.run(
        "tiny",
        tmp_path / "study",
        cache_dir=tmp_path / "cache",
        variants=VARIANTS,
        seeds=(0,),
        log=lines.append,
    )


def steady(entries):
    return [{k: v for k, v in m.items() if k not in VOLATILE} for m in entries]


@pytest.fixture
def tiny_size(monkeypatch):
    monkeypatch.setitem(study.SIZES, "tiny", TINY)


def test_study_runs_aggregates_skips_and_resumes(tmp_path, tiny_size):
    lines = []
    results = run(tmp_path, lines)
    out = tmp_path / "study"
    assert "0 of 2 runs done; running 2" in lines
    runs = {v: read_metrics(out / v / "seed0") for v in VARIANTS}
    for entries in runs.values():
        assert [m["step"] for m in entries] == [0, 1, 2]
    assert runs["guided-full"][0]["code_agreement"] == 1.0  # the variants are what they say
    assert runs["nearest"][0]["code_agreement"] < 1.0
    # Both start from the same base policy under the same BF16 evaluator.
    assert runs["nearest"][0]["held_out_greedy"] == runs["guided-full"][0]["held_out_greedy"]

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == list(VARIANTS)
    text = results.read_text()
    for variant, entries in runs.items():
        row = summary[variant]
        assert row["held_out_accuracy"] == entries[-1]["held_out_accuracy"]
        gain = entries[-1]["held_out_greedy"] - entries[0]["held_out_greedy"]
        assert row["held_out_greedy_gain"] == pytest.approx(gain)
        assert row["held_out_accuracy_std"] == 0.0  # one seed
        expected = sum(m["token_mult_prob_error"] for m in entries[:2]) / 2
        assert row["token_mult_prob_error"] == pytest.approx(expected)
        assert f"| {variant} | 1 | {100 * row['held_out_accuracy']:.1f} ± 0.0 |" in text
    # Each run's base and final policy evaluated under its rollout precision, as run.
    evals = {
        v: json.loads((out / v / "seed0" / study_results.ROLLOUT_EVAL).read_text())
        for v in VARIANTS
    }
    assert evals["nearest"]["base"] == evals["guided-full"]["base"]  # one base, one precision
    for variant, row in summary.items():
        final = evals[variant]["final"]
        assert row["rollout_held_out_greedy"] == final["held_out_greedy"]
        assert f"| {variant} | 1 | {100 * final['held_out_accuracy']:.1f} ± 0.0 |" in text
    for name in study_results.CURVES:
        assert (out / name).stat().st_size > 1000 and f"]({name})" in text

    # A finished study: nothing runs again.
    before = {v: (out / v / "seed0" / "metrics.jsonl").read_text() for v in VARIANTS}
    lines.clear()
    run(tmp_path, lines)
    assert "2 of 2 runs done; running 0" in lines
    assert before == {v: (out / v / "seed0" / "metrics.jsonl").read_text() for v in VARIANTS}

    # A run stopped after its first step's checkpoint continues from it to the same numbers.
    stopped = out / "nearest" / "seed0"
    shutil.rmtree(stopped / FOLDER / "step-00000002")
    metrics = (stopped / "metrics.jsonl").read_text().splitlines()
    (stopped / "metrics.jsonl").write_text("\n".join(metrics[:1]) + "\n")
    lines.clear()
    run(tmp_path, lines)
    assert "1 of 2 runs done; running 1" in lines
    assert steady(read_metrics(stopped)) == steady(runs["nearest"])


def test_a_run_directory_of_another_config_is_refused(tmp_path, tiny_size):
    base = study.base_policy(TINY, tmp_path / "cache", log=lambda _: None)
    config = study.run_config_for(TINY, "nearest", 0, base, tmp_path)
    assert study.run_state(config) == "new"
    path = study_results.run_dir(tmp_path, "nearest", 0)
    path.mkdir(parents=True)
    (path / "config.toml").write_text("[run]\nsteps = 3\n")
    with pytest.raises(ValueError, match="holds a run of another config"):
        study.run_state(config)
    with pytest.raises(ValueError, match="unknown variant 'fp8'"):
        study.run_config_for(TINY, "fp8", 0, base, tmp_path)


def test_every_size_loads_and_the_long_size_fits_its_completions():
    """Each size's run config validates; the long size's task writes 21-token completions
    (8 operands, every running sum in 2 digits) that fit its max_tokens and max_model_len."""
    from fp4rl.tasks.arith import held_out_problems

    for size in study.SIZES.values():
        study.size_config(size)
    config = study.size_config(study.SIZES["long"])
    problems = held_out_problems(config.task)
    assert {len(p.answer_ids) for p in problems} == {21} and len(problems) == 100
    longest = max(len(p.prompt_ids) + len(p.answer_ids) for p in problems)
    assert config.rollout.max_tokens >= 21 and longest <= config.engine.max_model_len


def test_base_policy_keys_ignore_task_settings_added_later_while_at_their_defaults():
    """Task settings added after base policies were first cached (``LATER_TASK_SETTINGS``)
    leave the key as it was while at their defaults, so cached policies and the study runs that
    recorded their paths stay valid; set to anything else, they change it."""
    import dataclasses
    import hashlib

    import fp4rl
    from fp4rl.model.presets import demo_qwen3_moe

    size = study.SIZES["small"]
    config = study.size_config(size, [f"model.dtype={size.warmup_dtype}"])
    model = demo_qwen3_moe(**size.model)

    def key(config):
        return demo.base_policy_key(config, model, size.warmup, size.base_seed)

    task = dataclasses.asdict(config.task)
    for name in demo.LATER_TASK_SETTINGS:
        del task[name]
    settings = {
        "fp4rl": fp4rl.__version__,
        "model": dataclasses.asdict(model),
        "precision": dataclasses.asdict(config.precision),
        "task": task,
        "warmup": dataclasses.asdict(size.warmup),
        "dtype": config.model.dtype,
        "seed": size.base_seed,
    }
    before = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    assert key(config) == before
    for change in ("task.num_operands=3", "task.partial_sums=true", "task.fixed_width=4"):
        changed = study.size_config(size, [f"model.dtype={size.warmup_dtype}", change])
        assert key(changed) != before, change
