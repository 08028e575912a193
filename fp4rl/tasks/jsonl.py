"""Prompts and reference answers from a JSONL file, scored by a text reward.

Each line is one JSON object; ``prompt_field`` and ``answer_field`` name its prompt (a
non-empty string) and reference answer (a non-empty string, or a number written as text).
Whitespace-only lines are not records. A bad record -- invalid JSON, not an object, a missing
or empty field, a prompt longer than ``max_prompt_tokens`` once tokenized, a reference the
``"math"`` reward cannot read -- stops the run naming ``file:line`` and the cause
(``on_bad_record = "error"``), or is left out and reported with every other one in one message
(``"skip"``).

The held-out set is chosen by prompt text: distinct prompts are ranked by a hash of
``held_out_seed`` and the text, and the first ``num_held_out`` (or ``held_out_fraction`` of
them, rounded) are held out with every record that repeats them, so no held-out prompt is
ever trained on. The order does not depend on the file's line order. Training reads the other
records in epochs, each a permutation fixed by the run's seed and the epoch
(`fp4rl.tasks.task.epoch_order`); step ``s`` takes positions ``s * num ... (s + 1) * num - 1``
of that stream.

Owns reading and checking the file, the split and the data order. Does not own the tokenizer
(`fp4rl.tasks.hf_tokenizer`) or the reward functions (`fp4rl.tasks.rewards`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from fp4rl import checks
from fp4rl.tasks import rewards
from fp4rl.tasks.hf_tokenizer import HfTokenizer
from fp4rl.tasks.task import epoch_order

OnBadRecord = Literal["skip", "error"]


def _text(name: str, value, *, empty_ok: bool = False) -> None:
    if not isinstance(value, str) or (not empty_ok and not value):
        raise ValueError(
            f"{name} must be a {'' if empty_ok else 'non-empty '}string, got {value!r}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class JsonlConfig:
    kind: Literal["jsonl"] = "jsonl"
    path: str = ""  # the JSONL file
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    reward: str = "math"  # "math" or "module:function" (see fp4rl.tasks.rewards)
    tokenizer: str = ""  # a local Hugging Face model directory; "": model.path
    chat_template: bool = False  # the prompt as one user message in the tokenizer's template
    max_prompt_tokens: int = 512  # longer prompts (after the template) are bad records
    on_bad_record: OnBadRecord = "error"
    held_out_fraction: float = 0.05  # of the distinct prompts
    num_held_out: int | None = None  # a count of distinct prompts instead of the fraction
    held_out_seed: int = 0

    def __post_init__(self) -> None:
        checks.choice("task.kind", self.kind, ("jsonl",))
        _text("task.path", self.path)
        _text("task.prompt_field", self.prompt_field)
        _text("task.answer_field", self.answer_field)
        _text("task.reward", self.reward)
        if self.reward != "math" and ":" not in self.reward:
            raise ValueError(
                f"task.reward must be 'math' or 'module:function', got {self.reward!r}"
            )
        _text("task.tokenizer", self.tokenizer, empty_ok=True)
        checks.boolean("task.chat_template", self.chat_template)
        checks.integer("task.max_prompt_tokens", self.max_prompt_tokens, 1)
        checks.choice("task.on_bad_record", self.on_bad_record, get_args(OnBadRecord))
        checks.number(
            "task.held_out_fraction", self.held_out_fraction, "in (0, 1)", lambda v: 0 < v < 1
        )
        if self.num_held_out is not None:
            checks.integer("task.num_held_out", self.num_held_out, 1)
        checks.integer("task.held_out_seed", self.held_out_seed, 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Record:
    line: int  # 1-based line number in the file
    prompt_ids: tuple[int, ...]  # the prompt, templated when asked, tokenized
    answer: str
    data: dict  # the whole JSON object, handed to the reward


class JsonlTask:
    """The JSONL task behind the loop's task interface (`fp4rl.tasks.task.Task`)."""

    def __init__(self, config: JsonlConfig, *, model_dir: str = "", log=print) -> None:
        tokenizer_dir = config.tokenizer or model_dir
        if not tokenizer_dir:
            raise ValueError("task.tokenizer is empty and so is model.path: name a model directory")
        self.config = config
        self.tokenizer = HfTokenizer(tokenizer_dir)
        if config.chat_template and self.tokenizer.chat_template is None:
            raise ValueError(
                f"task.chat_template=true but {tokenizer_dir} has no chat template "
                "(chat_template.jinja or tokenizer_config.json's chat_template)"
            )
        self.reward_fn, reward_name = rewards.load_reward(config.reward)
        records = read_records(config, self.encode_prompt, self._reference_problem, log=log)
        self.train_records, self._held_out = split(records, config)
        self.vocab_size = self.tokenizer.vocab_size
        self.stop_token_ids = self.tokenizer.stop_token_ids
        self._orders: dict[tuple[int, int], list[int]] = {}  # the last epoch_order, kept
        log(
            f"task: {config.path}: {len(self.train_records)} train / {len(self._held_out)} "
            f"held-out records, reward {reward_name}, stop tokens {list(self.stop_token_ids)}"
        )

    def encode_prompt(self, prompt: str) -> list[int]:
        if not self.config.chat_template:
            return self.tokenizer.encode(prompt)
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(text, add_special_tokens=False)

    def train_examples(self, *, seed: int, step: int, num: int) -> list[Record]:
        out = []
        for position in range(step * num, (step + 1) * num):
            epoch, i = divmod(position, len(self.train_records))
            if (seed, epoch) not in self._orders:
                self._orders = {
                    (seed, epoch): epoch_order(len(self.train_records), seed=seed, epoch=epoch)
                }
            out.append(self.train_records[self._orders[seed, epoch][i]])
        return out

    def held_out(self) -> list[Record]:
        return list(self._held_out)

    def reward(self, example: Record, completion_ids: Sequence[int]) -> float:
        where = f"{self.config.path}:{example.line}"
        text = self.tokenizer.decode(completion_ids)
        return rewards.checked(
            self.reward_fn, self.config.reward, text, example.answer, example.data, where
        )

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def _reference_problem(self, answer: str) -> str | None:
        if self.reward_fn is rewards.math_verify_reward and not rewards.parse_reference(answer):
            return f"math-verify reads no answer in {answer!r}"
        return None


def read_records(
    config: JsonlConfig,
    encode: Callable[[str], list[int]],
    reference_problem: Callable[[str], str | None],
    *,
    log=print,
) -> list[Record]:
    """The good records of the file, in file order; bad ones raise or are reported (by
    ``config.on_bad_record``)."""
    path = Path(config.path)
    if not path.is_file():
        raise FileNotFoundError(f"task.path={config.path!r}: no such file")
    good, bad = [], []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            record, cause = _parse(text, line, config, encode, reference_problem)
            if cause is None:
                good.append(record)
            elif config.on_bad_record == "error":
                raise ValueError(
                    f"{config.path}:{line}: {cause} (task.on_bad_record='skip' leaves such "
                    "records out)"
                )
            else:
                bad.append(f"line {line}: {cause}")
    if bad:
        log(
            f"task: {config.path}: skipped {len(bad)} bad record(s) of {len(bad) + len(good)}: "
            + "; ".join(bad)
        )
    if not good:
        raise ValueError(f"task.path={config.path!r} holds no good record")
    return good


def _parse(text, line, config, encode, reference_problem) -> tuple[Record | None, str | None]:
    """``(record, None)``, or ``(None, cause)`` for a bad record."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err.msg} at column {err.colno})"
    if not isinstance(data, dict):
        return None, f"not a JSON object but {type(data).__name__}"
    prompt, answer = data.get(config.prompt_field), data.get(config.answer_field)
    for field, value in ((config.prompt_field, prompt), (config.answer_field, answer)):
        if value is None:
            return None, f"no {field!r} field"
    if not isinstance(prompt, str):
        return None, f"{config.prompt_field!r} is a {type(prompt).__name__}, not a string"
    if not prompt.strip():
        return None, f"empty prompt {config.prompt_field!r}"
    if isinstance(answer, int | float) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        return None, f"{config.answer_field!r} is a {type(answer).__name__}, not a string or number"
    if not answer.strip():
        return None, f"empty answer {config.answer_field!r}"
    cause = reference_problem(answer)
    if cause is not None:
        return None, cause
    ids = encode(prompt)
    if len(ids) > config.max_prompt_tokens:
        return (
            None,
            f"prompt of {len(ids)} tokens > task.max_prompt_tokens={config.max_prompt_tokens}",
        )
    return Record(line=line, prompt_ids=tuple(ids), answer=answer, data=data), None


def split(records: list[Record], config: JsonlConfig) -> tuple[list[Record], list[Record]]:
    """``(train, held_out)``, each in file order; see the module docstring."""
    prompts = sorted({_prompt(r, config) for r in records}, key=lambda p: (_rank(p, config), p))
    num = config.num_held_out
    name = "num_held_out"
    if num is None:
        num, name = round(config.held_out_fraction * len(prompts)), "held_out_fraction"
    if not 1 <= num < len(prompts):
        value = getattr(config, name)
        raise ValueError(
            f"task.{name}={value} holds out {num} of the {len(prompts)} distinct prompts of "
            f"{config.path}: both the held-out set and the training set need at least one"
        )
    held = set(prompts[:num])
    train = [r for r in records if _prompt(r, config) not in held]
    return train, [r for r in records if _prompt(r, config) in held]


def _prompt(record: Record, config: JsonlConfig) -> str:
    return record.data[config.prompt_field]


def _rank(prompt: str, config: JsonlConfig) -> bytes:
    return hashlib.blake2b(f"{config.held_out_seed}\n{prompt}".encode(), digest_size=8).digest()
