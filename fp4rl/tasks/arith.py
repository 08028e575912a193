"""Multi-digit addition as a verifiable task: problems, a held-out split, and the reward.

A prompt is ``<bos>a+b=``; the answer is the decimal sum followed by ``<eos>`` (written least
significant digit first with ``reverse_answer``, the order in which the carries are computed).
The operands' digit counts are the difficulty knob: each operand gets a digit count drawn
uniformly from ``[min_digits, max_digits]``, then a value with exactly that many digits.

Owns problem generation, the train / held-out split, the reward and `ArithTask`, this task
behind the interface of `fp4rl.tasks.task`. Does not own the vocabulary
(`fp4rl.tasks.tokenizer`), sampling, or the evaluation loop.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from fp4rl import checks
from fp4rl.tasks.task import step_seed
from fp4rl.tasks.tokenizer import BOS, EOS, VOCAB, decode, encode

Split = Literal["train", "held_out"]
_DIGIT_IDS = frozenset(encode("0123456789"))


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskConfig:
    kind: Literal["arith"] = "arith"  # ``[task]`` without a kind is this task
    min_digits: int = 1  # digits of each operand, drawn uniformly in [min_digits, max_digits]
    max_digits: int = 3
    reverse_answer: bool = False  # answer least significant digit first
    held_out_fraction: float = 0.05  # of all problems, chosen by a hash of the operand pair
    num_held_out: int = 256  # distinct problems in the evaluation set
    held_out_seed: int = 0
    format_reward: float = 0.0  # reward for a wrong answer that is digits followed by EOS

    def __post_init__(self) -> None:
        checks.choice("task.kind", self.kind, ("arith",))
        checks.integer("task.min_digits", self.min_digits, 1)
        checks.integer("task.max_digits", self.max_digits, self.min_digits)
        checks.boolean("task.reverse_answer", self.reverse_answer)
        checks.number(
            "task.held_out_fraction", self.held_out_fraction, "in (0, 1)", lambda v: 0 < v < 1
        )
        checks.integer("task.num_held_out", self.num_held_out, 1)
        checks.integer("task.held_out_seed", self.held_out_seed, 0)
        checks.number("task.format_reward", self.format_reward, "in [0, 1)", lambda v: 0 <= v < 1)
        # Drawing distinct held-out problems by rejection must end: ask for at most half of
        # the problems the split is expected to hold.
        numbers = sum(10 if d == 1 else 9 * 10 ** (d - 1) for d in self._digit_range())
        expected = self.held_out_fraction * numbers**2
        if self.num_held_out > expected / 2:
            raise ValueError(
                f"task.num_held_out={self.num_held_out} exceeds half of the ~{expected:.0f} "
                f"held-out problems with {self.min_digits}..{self.max_digits} digits"
            )

    def _digit_range(self) -> range:
        return range(self.min_digits, self.max_digits + 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    a: int
    b: int
    prompt_ids: tuple[int, ...]  # <bos> a + b =
    answer_ids: tuple[int, ...]  # the answer's digits, then <eos>: the completion worth 1.0


def make_problem(a: int, b: int, config: TaskConfig) -> Problem:
    if min(a, b) < 0:
        raise ValueError(f"operands must be >= 0, got {a}, {b}")
    answer = str(a + b)[:: -1 if config.reverse_answer else 1]
    return Problem(
        a=a,
        b=b,
        prompt_ids=(BOS, *encode(f"{a}+{b}=")),
        answer_ids=(*encode(answer), EOS),
    )


def split_of(a: int, b: int, config: TaskConfig) -> Split:
    """Which split ``a+b`` belongs to; ``b+a`` always goes with it, so a held-out sum is never
    seen in training in the other order. Depends on the operands and ``held_out_fraction``
    only, so changing the digit range does not move a problem between splits, and a larger
    fraction only moves problems from train into held-out (one hash, nested thresholds)."""
    key = f"{min(a, b)}+{max(a, b)}".encode()
    h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return "held_out" if h < config.held_out_fraction * 2**64 else "train"


def _operand(rng: random.Random, config: TaskConfig) -> int:
    digits = rng.choice(config._digit_range())
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def train_problems(config: TaskConfig, *, num: int, seed: int) -> list[Problem]:
    """``num`` problems drawn independently (repeats possible) from the train split."""
    checks.integer("task.num", num, 0)
    checks.integer("task.seed", seed, 0)
    rng, out = random.Random(seed), []
    while len(out) < num:
        a, b = _operand(rng, config), _operand(rng, config)
        if split_of(a, b, config) == "train":
            out.append(make_problem(a, b, config))
    return out


def held_out_problems(config: TaskConfig) -> list[Problem]:
    """The evaluation set: ``num_held_out`` distinct held-out problems, fixed by the config."""
    rng, seen, out = random.Random(config.held_out_seed), set(), []
    # A backstop for the estimate in TaskConfig: a tiny digit range can hold fewer problems.
    for _ in range(1000 * config.num_held_out):
        a, b = _operand(rng, config), _operand(rng, config)
        if (a, b) not in seen and split_of(a, b, config) == "held_out":
            seen.add((a, b))
            out.append(make_problem(a, b, config))
            if len(out) == config.num_held_out:
                return out
    raise ValueError(
        f"task.num_held_out={config.num_held_out}: found only {len(out)} distinct held-out "
        f"problems with {config.min_digits}..{config.max_digits} digits"
    )


def reward(problem: Problem, completion_ids: Sequence[int], config: TaskConfig) -> float:
    """1.0 for exactly the answer followed by EOS (nothing after it); ``format_reward`` for
    another well-formed answer (one or more digits, then EOS); 0.0 otherwise, including a
    completion cut off before its EOS."""
    ids = tuple(completion_ids)
    if ids == problem.answer_ids:
        return 1.0
    well_formed = len(ids) >= 2 and ids[-1] == EOS and all(i in _DIGIT_IDS for i in ids[:-1])
    return config.format_reward if well_formed else 0.0


class ArithTask:
    """The addition task behind the loop's task interface: the character vocabulary, stop at
    EOS, problems of step ``s`` drawn with the seed ``step_seed(seed, s)``."""

    stop_token_ids = (EOS,)
    vocab_size = len(VOCAB)

    def __init__(self, config: TaskConfig) -> None:
        self.config = config

    def train_examples(self, *, seed: int, step: int, num: int) -> list[Problem]:
        return train_problems(self.config, num=num, seed=step_seed(seed, step))

    def held_out(self) -> list[Problem]:
        return held_out_problems(self.config)

    def reward(self, example: Problem, completion_ids: Sequence[int]) -> float:
        return reward(example, completion_ids, self.config)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; an id past the vocabulary (the model's may be larger: the demo's
        has 16 rows for 15 tokens) is written ``<unk:ID>``."""
        return "".join(decode([i]) if 0 <= i < len(VOCAB) else f"<unk:{i}>" for i in ids)

    def encode_prompt(self, text: str) -> list[int]:
        """``"12+34="`` -> ``<bos>12+34=``, the layout of `make_problem`'s prompts."""
        return [BOS, *encode(text)]
