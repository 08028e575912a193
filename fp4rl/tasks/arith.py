"""Multi-digit addition as a verifiable task: problems, a held-out split, and the reward.

A prompt is ``<bos>a+b=``; the answer is the decimal sum followed by ``<eos>`` (written least
significant digit first with ``reverse_answer``, the order in which the carries are computed).
The operands' digit counts are the difficulty knob: each operand gets a digit count drawn
uniformly from ``[min_digits, max_digits]``, then a value with exactly that many digits.

``num_operands`` and ``partial_sums`` make the completions long: ``<bos>3+5+7+2=`` is answered
``8=15=17<eos>`` with ``partial_sums``, every running sum written out (each reversed with
``reverse_answer``) and separated by ``=``, the last one the total. The reward is still exact:
the whole written chain must be right. ``fixed_width`` zero-pads every operand and running sum
to that many digits (``<bos>03+05+07+02=`` -> ``80=51=71<eos>``): each running sum then sits
at the same distance from the operand it adds, which a small model finds far more easily.

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
(_EQUALS,) = encode("=")


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
    num_operands: int = 2  # terms of the sum, each drawn as above
    partial_sums: bool = False  # the completion writes every running sum, '='-separated
    fixed_width: int = 0  # zero-pad operands and sums to this many digits (0: natural width)

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
        checks.integer("task.num_operands", self.num_operands, 2)
        checks.boolean("task.partial_sums", self.partial_sums)
        checks.integer("task.fixed_width", self.fixed_width, 0)
        largest = self.num_operands * (10**self.max_digits - 1)
        if self.fixed_width and len(str(largest)) > self.fixed_width:
            raise ValueError(
                f"task.fixed_width={self.fixed_width} cannot hold the largest sum {largest} of "
                f"{self.num_operands} operands of {self.max_digits} digits"
            )
        # Drawing distinct held-out problems by rejection must end: ask for at most half of
        # the problems the split is expected to hold.
        numbers = sum(10 if d == 1 else 9 * 10 ** (d - 1) for d in self._digit_range())
        expected = self.held_out_fraction * numbers**self.num_operands
        if self.num_held_out > expected / 2:
            raise ValueError(
                f"task.num_held_out={self.num_held_out} exceeds half of the ~{expected:.0f} "
                f"held-out problems with {self.min_digits}..{self.max_digits} digits and "
                f"{self.num_operands} operands"
            )

    def _digit_range(self) -> range:
        return range(self.min_digits, self.max_digits + 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    operands: tuple[int, ...]
    prompt_ids: tuple[int, ...]  # <bos> a + b + ... =
    answer_ids: tuple[int, ...]  # the answer's digits, then <eos>: the completion worth 1.0

    @property
    def a(self) -> int:
        return self.operands[0]

    @property
    def b(self) -> int:
        return self.operands[1]


def make_problem(a: int, b: int, config: TaskConfig) -> Problem:
    """The problem ``a+b`` (`make_sum_problem` of two operands)."""
    return make_sum_problem((a, b), config)


def make_sum_problem(operands: Sequence[int], config: TaskConfig) -> Problem:
    """The problem ``operands[0]+operands[1]+...``; its answer is the total, or with
    ``config.partial_sums`` every running sum from the second operand on, '='-separated."""
    operands = tuple(operands)
    if len(operands) < 2 or min(operands) < 0:
        raise ValueError(f"a sum needs 2 or more operands >= 0, got {operands}")
    running = [sum(operands[: k + 1]) for k in range(1, len(operands))]
    written = running if config.partial_sums else running[-1:]
    width = config.fixed_width
    if width and len(str(max(running))) > width:
        raise ValueError(f"task.fixed_width={width} cannot hold the sums of {operands}")
    step = -1 if config.reverse_answer else 1
    answer = "=".join(f"{s:0{width}d}"[::step] for s in written)
    return Problem(
        operands=operands,
        prompt_ids=(BOS, *encode("+".join(f"{x:0{width}d}" for x in operands) + "=")),
        answer_ids=(*encode(answer), EOS),
    )


def split_of(a: int, b: int, config: TaskConfig) -> Split:
    """Which split ``a+b`` belongs to (`sum_split` of two operands)."""
    return sum_split((a, b), config)


def sum_split(operands: Sequence[int], config: TaskConfig) -> Split:
    """Which split a sum belongs to; every reordering of its operands goes with it, so a
    held-out sum is never seen in training in another order. Depends on the operands and
    ``held_out_fraction`` only, so changing the digit range does not move a problem between
    splits, and a larger fraction only moves problems from train into held-out (one hash,
    nested thresholds). Two operands hash as ``"min+max"``, as before sums had more."""
    key = "+".join(map(str, sorted(operands))).encode()
    h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return "held_out" if h < config.held_out_fraction * 2**64 else "train"


def _operand(rng: random.Random, config: TaskConfig) -> int:
    digits = rng.choice(config._digit_range())
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _operands(rng: random.Random, config: TaskConfig) -> tuple[int, ...]:
    return tuple(_operand(rng, config) for _ in range(config.num_operands))


def train_problems(config: TaskConfig, *, num: int, seed: int) -> list[Problem]:
    """``num`` problems drawn independently (repeats possible) from the train split."""
    checks.integer("task.num", num, 0)
    checks.integer("task.seed", seed, 0)
    rng, out = random.Random(seed), []
    while len(out) < num:
        operands = _operands(rng, config)
        if sum_split(operands, config) == "train":
            out.append(make_sum_problem(operands, config))
    return out


def held_out_problems(config: TaskConfig) -> list[Problem]:
    """The evaluation set: ``num_held_out`` distinct held-out problems, fixed by the config."""
    rng, seen, out = random.Random(config.held_out_seed), set(), []
    # A backstop for the estimate in TaskConfig: a tiny digit range can hold fewer problems.
    for _ in range(1000 * config.num_held_out):
        operands = _operands(rng, config)
        if operands not in seen and sum_split(operands, config) == "held_out":
            seen.add(operands)
            out.append(make_sum_problem(operands, config))
            if len(out) == config.num_held_out:
                return out
    raise ValueError(
        f"task.num_held_out={config.num_held_out}: found only {len(out)} distinct held-out "
        f"problems with {config.min_digits}..{config.max_digits} digits and "
        f"{config.num_operands} operands"
    )


def reward(problem: Problem, completion_ids: Sequence[int], config: TaskConfig) -> float:
    """1.0 for exactly the answer followed by EOS (nothing after it), so with ``partial_sums``
    every running sum must be right; ``format_reward`` for another well-formed answer (as many
    '='-separated groups of one or more digits as the answer has, then EOS); 0.0 otherwise,
    including a completion cut off before its EOS."""
    ids = tuple(completion_ids)
    if ids == problem.answer_ids:
        return 1.0
    groups = config.num_operands - 1 if config.partial_sums else 1
    well_formed = len(ids) >= 2 and ids[-1] == EOS and _digit_groups(ids[:-1]) == groups
    return config.format_reward if well_formed else 0.0


def _digit_groups(ids: Sequence[int]) -> int:
    """How many non-empty groups of digits ``ids`` is, separated by single '='; 0 if it is
    anything else."""
    groups, length = 0, 0
    for i in (*ids, _EQUALS):
        if i == _EQUALS:
            if length == 0:
                return 0
            groups, length = groups + 1, 0
        elif i in _DIGIT_IDS:
            length += 1
        else:
            return 0
    return groups


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
        """``"12+34="`` -> ``<bos>12+34=``, the layout of `make_sum_problem`'s prompts."""
        return [BOS, *encode(text)]
