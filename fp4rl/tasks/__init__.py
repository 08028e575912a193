"""Built-in verifiable tasks: prompts with a held-out split and their reward functions.
`fp4rl.tasks.arith` is multi-digit addition over the character vocabulary of
`fp4rl.tasks.tokenizer`. Imports nothing else of fp4rl: a task knows token ids, not models."""

from fp4rl.tasks.arith import (
    Problem,
    TaskConfig,
    held_out_problems,
    make_problem,
    reward,
    split_of,
    train_problems,
)

__all__ = [
    "Problem",
    "TaskConfig",
    "held_out_problems",
    "make_problem",
    "reward",
    "split_of",
    "train_problems",
]
