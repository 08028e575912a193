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
3. `fp4rl.study_results.aggregate`: per variant, curves of held-out accuracy, reward and the
   mismatch metrics with their spread over seeds (PNG), and ``results.md``: the final table,
   mismatch, throughput.

The GRPO run every variant shares is ``fp4rl/configs/study.toml``; `SIZES` says what each
size changes (model shape, warm-up, steps, task). Does not own the loop, the variants' meaning
(`fp4rl.config.AlignSection`), a run's metrics read back (`fp4rl.metrics_log`) or a single
run's report (`fp4rl.report`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from fp4rl import checkpoints, demo, inference, loop
from fp4rl import config as run_config
from fp4rl.metrics_log import read_metrics
from fp4rl.model.presets import demo_qwen3_moe
from fp4rl.study_results import EVAL_KEYS, ROLLOUT_EVAL, aggregate, run_dir
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
