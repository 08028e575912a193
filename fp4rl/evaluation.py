"""Held-out evaluation: the metric, and the engine it is measured on.

- `evaluate`: the held-out accuracy of the policy as an engine holds it, sampled and greedy;
  with several ranks, each rank's engine takes its share of the problems and the counts are
  summed.
- `Evaluator`: the engine ``run.eval_precision`` names, kept holding the trainer's weights:
  the rollout engine itself, or a BF16 twin refit from the trainer when the policy has moved.

Does not own when the loop evaluates (`fp4rl.loop`), the reward (`fp4rl.tasks`) or the refit
protocol (`fp4rl.refit`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from fp4rl.config import RunConfig
from fp4rl.distributed import Ranks, weights_of
from fp4rl.refit import RefitReceiver
from fp4rl.rollout import Engine, SamplingParams
from fp4rl.tasks import Task


def evaluate(
    engine: Engine,
    task: Task,
    problems: list,
    config: RunConfig,
    *,
    on_finish=None,
    ranks: Ranks | None = None,
) -> dict[str, float]:
    """Held-out accuracy of the policy as the engine holds it: ``held_out_accuracy``, the share
    of completions with the full reward 1.0 sampled as the rollout samples (its temperature,
    ``run.eval_samples`` per problem, the same seed at every evaluation), and
    ``held_out_greedy``, greedy decoding. ``on_finish(n)`` is told of finished samples. With
    ``ranks``, each rank's engine takes its share of the problems and the counts are summed."""
    if ranks is None:
        mine = range(len(problems))
    else:
        mine = ranks.share(len(problems), "the held-out problems (task.num_held_out)")
    prompts = [list(p.prompt_ids) for p in problems[mine.start : mine.stop]]
    r = config.rollout
    params = {
        "held_out_accuracy": SamplingParams(
            n=config.run.eval_samples,
            temperature=r.temperature,
            max_tokens=r.max_tokens,
            stop_token_ids=task.stop_token_ids,
            seed=config.run.seed,
            cdf_order=r.cdf_order,
        ),
        "held_out_greedy": SamplingParams(
            temperature=0, max_tokens=r.max_tokens, stop_token_ids=task.stop_token_ids
        ),
    }
    out = {}
    for key, sampling_params in params.items():
        done = engine.generate(
            prompts, sampling_params, on_finish=on_finish, first_prompt_index=mine.start
        )
        n = sampling_params.n
        exact = [
            task.reward(problems[mine.start + i // n], c.completion_ids) == 1.0
            for i, c in enumerate(done)
        ]
        if ranks is None:
            out[key] = sum(exact) / len(exact)
        else:
            counts = ranks.sum({"exact": sum(exact), "all": len(exact)})
            out[key] = counts["exact"] / counts["all"]
    return out


class Evaluator:
    """The engine held-out evaluation runs on, as ``run.eval_precision`` names it: the rollout
    engine itself ("rollout"), or a twin over the same checkpoint with every module in the
    model's dtype and none FP4 ("bf16": no FP4 experts, BF16 KV, nothing recorded), so runs of
    any rollout precision are measured by one evaluator. The twin is refit from the trainer
    when the rollout engine's policy version has moved past its own, and holds KV pages only
    while it evaluates."""

    def __init__(self, engine: Engine, config: RunConfig, *, dtype, device, ranks=None) -> None:
        self.rollout_engine, self.ranks = engine, ranks
        self.engine, self.receiver = engine, None
        if config.run.eval_precision == "bf16":
            precision = dataclasses.replace(config.precision, experts="bf16", kv_cache="bf16")
            engine_config = dataclasses.replace(config.engine, capture_routing=False, guidance=None)
            self.engine = Engine.from_pretrained(
                config.model.path, engine_config, precision=precision, dtype=dtype, device=device
            )
            self.engine.release_kv()
            self.receiver = RefitReceiver(self.engine)

    @contextlib.contextmanager
    def current(self, policy) -> Iterator[Engine]:
        """The evaluating engine, holding the weights of ``policy`` (the trainer, at the rollout
        engine's policy version) and its KV pages for the duration of the block."""
        if self.receiver is None:
            yield self.engine
            return
        version = self.rollout_engine.policy_version
        if self.engine.policy_version != version:
            self.receiver.receive(weights_of(policy, version, self.ranks))
        self.engine.acquire_kv()
        try:
            yield self.engine
        finally:
            self.engine.release_kv()
