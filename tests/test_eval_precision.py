"""``run.eval_precision``: the held-out evaluation on a BF16 twin of the rollout engine, refit
from the trainer, is the evaluation of the policy's weights with no FP4 module."""

import dataclasses

import pytest
from tiny_models import qat_model, tiny_config, tiny_precision

from fp4rl import config as run_config
from fp4rl import demo, loop
from fp4rl.checkpoints import latest_checkpoint
from fp4rl.loop import evaluate
from fp4rl.model.checkpoint import save_checkpoint
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.tasks import build_task


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base") / "model"
    config = tiny_config(vocab_size=16)
    save_checkpoint(
        qat_model(tiny_precision("nvfp4"), config=config, seed=0).state_dict(), config, path
    )
    return path


def run_config_for(base, run_dir, eval_precision):
    return run_config.load(
        demo.CONFIG_FILE,
        [
            f"model.path={base}",
            f"run.out_dir={run_dir}",
            "model.device=cpu",
            "model.dtype=bfloat16",
            "run.steps=2",
            "run.eval_every=1",
            "run.eval_samples=2",
            f"run.eval_precision={eval_precision}",
            "rollout.prompts_per_step=8",
            "rollout.max_tokens=3",
            "task.format_reward=0.5",
            "task.num_held_out=32",
            "optim.lr=3e-3",
            "optim.warmup_steps=0",
        ],
    )


def bf16_engine(weights, config):
    """An engine built fresh over ``weights`` with no FP4 module."""
    precision = dataclasses.replace(config.precision, experts="bf16", kv_cache="bf16")
    engine_config = dataclasses.replace(config.engine, capture_routing=False, guidance=None)
    return Engine.from_pretrained(weights, engine_config, precision=precision, device="cpu")


def greedy_tokens(engine, problems, config):
    prompts = [list(p.prompt_ids) for p in problems]
    params = SamplingParams(temperature=0, max_tokens=config.rollout.max_tokens)
    return [c.completion_ids for c in engine.generate(prompts, params)]


def run(monkeypatch, config):
    """Train; per evaluation, the evaluating engine's FP4 layers, greedy held-out tokens and
    numbers."""
    seen = []

    def spy(engine, task, problems, config, **kwargs):
        out = evaluate(engine, task, problems, config, **kwargs)
        seen.append((engine.layout.fp4_layers, greedy_tokens(engine, problems, config), out))
        return out

    monkeypatch.setattr(loop, "evaluate", spy)
    history = loop.train(config, log=lambda _: None)
    return history, seen


def test_bf16_evaluator_measures_the_trainer_weights_without_fp4(tmp_path, base, monkeypatch):
    config = run_config_for(base, tmp_path / "bf16", "bf16")
    history, seen = run(monkeypatch, config)
    assert [m["step"] for m in history] == [0, 1, 2]  # steps 0-1, then the final evaluation
    assert [m["held_out_accuracy"] for m in history if "held_out_accuracy" in m] == [
        out["held_out_accuracy"] for *_, out in seen
    ]
    assert all(layers == () for layers, *_ in seen)  # the twin has no FP4 layer
    task = build_task(config.task)
    problems = task.held_out()
    # Before any update: the base checkpoint; after the last: the policy the run saved, each
    # decoded exactly as an engine built fresh from those weights decodes it.
    start = bf16_engine(base, config)
    assert seen[0][1] == greedy_tokens(start, problems, config)
    assert seen[0][2] == evaluate(start, task, problems, config)
    final = bf16_engine(latest_checkpoint(tmp_path / "bf16") / "model", config)
    assert seen[-1][1] == greedy_tokens(final, problems, config)
    assert seen[-1][2] == evaluate(final, task, problems, config)
    # The policy moved, and the twin followed it (a twin left at the base would repeat step 0).
    assert seen[-1][1] != seen[0][1]

    # The rollout engine evaluates the FP4 policy itself: other tokens from the same weights.
    _, rollout_seen = run(monkeypatch, run_config_for(base, tmp_path / "rollout", "rollout"))
    assert rollout_seen[0][0] != () and rollout_seen[0][1] != seen[0][1]


def test_eval_precision_is_checked():
    with pytest.raises(ValueError, match=r"run.eval_precision must be one of .*'fp4'"):
        run_config.load(None, ["run.eval_precision=fp4"])
