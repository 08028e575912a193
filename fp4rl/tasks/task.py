"""The one interface the GRPO loop uses for every task, and the data order of a step.

A task hands out examples: records with at least ``prompt_ids`` (the tokens the engine is
prompted with) and whatever the task needs to score a completion of them. The loop asks for a
step's training examples, the held-out set, the reward of a completion, the stop tokens and
the vocabulary the model must cover; it never looks inside an example. Generation outside
training (`fp4rl.inference`) also turns prompt text into ids and completions back into text.

The training examples of a step are a pure function of ``(seed, step, num)``: the step is the
data position, so a run resumed at step ``s`` with the same seed and ``prompts_per_step`` sees
the prompts the uninterrupted run would have seen. Owns that contract and `step_seed`; each
task module owns its own examples and rewards.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Protocol


class Example(Protocol):
    @property
    def prompt_ids(self) -> tuple[int, ...]: ...


class Task(Protocol):
    vocab_size: int  # every token id the task emits or reads is below this
    stop_token_ids: tuple[int, ...]  # generation ends at any of these (kept in the completion)

    def train_examples(self, *, seed: int, step: int, num: int) -> list[Example]:
        """``num`` training examples of step ``step``; a pure function of its arguments."""
        ...

    def held_out(self) -> list[Example]:
        """The evaluation set, fixed by the task's config; never among the training examples."""
        ...

    def reward(self, example: Example, completion_ids: Sequence[int]) -> float:
        """The reward of one completion (its tokens after the prompt, the stop token included
        when generation stopped on it). A reward of 1.0 counts as correct in held-out
        accuracy."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, for logs and generated output."""
        ...

    def encode_prompt(self, text: str) -> list[int]:
        """The prompt ids of a prompt written as text, as the task builds its own prompts."""
        ...


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step`` of a run seeded ``seed``: the arithmetic task's draws and the
    rollout's sampling both derive from it."""
    return seed * 1_000_003 + step


def epoch_order(num_items: int, *, seed: int, epoch: int) -> list[int]:
    """A permutation of ``range(num_items)`` for one pass over a finite dataset, fixed by
    ``(seed, epoch)`` and by nothing else (`random.Random.shuffle` under an integer seed has
    drawn the same permutations since Python 3.2)."""
    key = f"{seed}/{epoch}".encode()
    order = list(range(num_items))
    random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")).shuffle(
        order
    )
    return order
