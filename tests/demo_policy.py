"""The demo's warmed-up base policy and the pieces of a GRPO step on it, shared by the loop's
tests (`tests/test_loop.py`, `tests/test_loop_settings.py`)."""

import torch

from fp4rl import config as run_config
from fp4rl import demo
from fp4rl.loop import sampling, setup
from fp4rl.model.weights import load_pretrained
from fp4rl.rollout import Engine
from fp4rl.tasks.arith import ArithTask, reward, train_problems
from fp4rl.train.grpo import group_advantages
from fp4rl.train.optim import MasterAdamW, OptimConfig
from fp4rl.train.step import grpo_update

# A warm-up this short leaves the policy weak but not useless; enough to exercise every part.
SHORT_WARMUP = demo.Warmup(steps=40, check_every=20, optim=OptimConfig(lr=3e-3, warmup_steps=5))


def base_policy(cache):
    """The demo's base policy after `SHORT_WARMUP`, saved under (or reused from) ``cache``."""
    config = run_config.load(demo.CONFIG_FILE)
    return demo.base_policy(config, cache, seed=0, warmup=SHORT_WARMUP, log=lambda _: None)


def rollout_and_advantages(config, engine, step):
    problems = train_problems(config.task, num=8, seed=step)
    params = sampling(config, step, ArithTask.stop_token_ids)
    completions = engine.generate([list(p.prompt_ids) for p in problems], params)
    n = config.rollout.samples_per_prompt
    rewards = torch.tensor(
        [
            [reward(p, c.completion_ids, config.task) for c in completions[g * n : (g + 1) * n]]
            for g, p in enumerate(problems)
        ]
    )
    adv, _ = group_advantages(rewards)
    return completions, adv.flatten().tolist()


def policy_and_engine(base, *overrides):
    config = run_config.load(demo.CONFIG_FILE, [f"model.path={base}", *overrides])
    _, dtype = setup(config)
    policy = load_pretrained(base, config.precision, fp4_experts="qat", dtype=dtype)
    engine = Engine.from_pretrained(base, config.engine, precision=config.precision, dtype=dtype)
    return config, policy, engine


def update(config, policy, completions, advantages, micro_batch_seqs):
    optimizer = MasterAdamW(policy.parameters(), config.optim)
    return grpo_update(
        policy,
        optimizer,
        completions,
        advantages,
        config=config.grpo,
        replay=True,
        guided=True,
        temperature=1.0,
        micro_batch_seqs=micro_batch_seqs,
    )
