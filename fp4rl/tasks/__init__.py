"""Tasks: where prompts come from and how completions are scored, behind one interface
(`fp4rl.tasks.task.Task`) that the GRPO loop uses for every task.

``[task] kind`` picks one: ``"arith"`` (the default), multi-digit addition over the
character vocabulary of `fp4rl.tasks.tokenizer` (`fp4rl.tasks.arith`); ``"jsonl"``, prompts
and reference answers from a JSONL file, tokenized by a Hugging Face tokenizer
(`fp4rl.tasks.jsonl`, `fp4rl.tasks.hf_tokenizer`) and scored by a reward of
`fp4rl.tasks.rewards`. Imports nothing else of fp4rl but `fp4rl.checks`: a task knows token
ids, not models.
"""

from __future__ import annotations

from fp4rl.tasks.arith import (
    ArithTask,
    Problem,
    TaskConfig,
    held_out_problems,
    make_problem,
    reward,
    split_of,
    train_problems,
)
from fp4rl.tasks.jsonl import JsonlConfig, JsonlTask
from fp4rl.tasks.task import Task, step_seed

CONFIGS = {"arith": TaskConfig, "jsonl": JsonlConfig}  # ``[task] kind`` -> its settings
TaskSettings = TaskConfig | JsonlConfig


def build_task(config: TaskSettings, *, model_dir: str = "", log=print) -> Task:
    """The task ``config`` describes; ``model_dir`` is the policy's directory, the default
    place of a JSONL task's tokenizer. Reading a file reports to ``log``."""
    if isinstance(config, JsonlConfig):
        return JsonlTask(config, model_dir=model_dir, log=log)
    return ArithTask(config)


__all__ = [
    "CONFIGS",
    "ArithTask",
    "JsonlConfig",
    "JsonlTask",
    "Problem",
    "Task",
    "TaskConfig",
    "TaskSettings",
    "build_task",
    "held_out_problems",
    "make_problem",
    "reward",
    "split_of",
    "step_seed",
    "train_problems",
]
