"""Reward functions of text tasks, named in ``task.reward``.

Every reward has one signature::

    fn(completion: str, answer: str, record: dict) -> float

``completion`` is the decoded completion (special tokens, the stop token among them, left
out), ``answer`` the record's reference answer as text, ``record`` the whole JSON object of the
record (for rewards that need more fields). It returns a finite number; 1.0 counts as correct
in held-out accuracy.

- ``"math"``: `math_verify_reward` when the ``math-verify`` package is importable
  (``pip install 'fp4rl[math]'``), else `boxed_answer_reward`.
- ``"module:function"``: a function found by import path (``my_rewards:exact``); the module
  must be importable (installed, or on ``PYTHONPATH``).

Owns the built-in answer check and resolving a name to a function. Does not own decoding or
which records exist (`fp4rl.tasks.jsonl`).
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import re
from collections.abc import Callable
from fractions import Fraction

Reward = Callable[[str, str, dict], float]


def load_reward(spec: str) -> tuple[Reward, str]:
    """``(function, description)`` for ``task.reward``; the description names what runs."""
    if spec == "math":
        try:
            import math_verify  # noqa: F401
        except ImportError:
            return boxed_answer_reward, "math (built-in boxed/number check)"
        return math_verify_reward, "math (math-verify)"
    module_name, colon, name = spec.partition(":")
    if not colon or not module_name or not name:
        raise ValueError(f"task.reward must be 'math' or 'module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"task.reward={spec!r}: cannot import {module_name!r}: {err}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"task.reward={spec!r}: {module_name!r} has no function {name!r}")
    return fn, spec


def checked(fn: Reward, spec: str, completion: str, answer: str, record: dict, where: str):
    """``fn``'s reward as a float. An exception inside ``fn``, or a non-number or non-finite
    result, is a ValueError naming the reward and the record (``where``)."""
    try:
        value = fn(completion, answer, record)
    except Exception as err:
        raise ValueError(
            f"task.reward={spec!r} raised {type(err).__name__}: {err} for {where}"
        ) from err
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(
            f"task.reward={spec!r} returned {value!r} for {where}: a reward must be a finite number"
        )
    return float(value)


def math_verify_reward(completion: str, answer: str, record: dict) -> float:
    """1.0 when math-verify finds the completion's answer equal to the reference, else 0.0.

    The reference is read by `parse_reference`; math-verify extracts the completion's last
    boxed or final answer and compares symbolically (numbers to 6 decimals, fractions,
    expressions, sets, intervals, equations)."""
    from math_verify import parse, verify

    return 1.0 if verify(parse_reference(answer), parse(completion)) else 0.0


@functools.lru_cache(maxsize=1 << 16)  # a reference is read once, not once per sample
def parse_reference(answer: str) -> list:
    """math-verify's reading of a reference answer; empty when it can read none. A reference
    without ``$`` or ``\\boxed`` is read as one LaTeX formula (``$answer$``), so ``x + 1`` is
    the expression, not its last number; as written when that reads nothing."""
    from math_verify import parse

    if "$" in answer or "\\boxed" in answer:
        return parse(answer)
    return parse(f"${answer}$") or parse(answer)


def boxed_answer_reward(completion: str, answer: str, record: dict) -> float:
    """1.0 when the completion's final answer equals the reference, else 0.0.

    The final answer is the content of the completion's last ``\\boxed{...}`` (braces
    balanced) and, when there is none, its last number. The reference is the content of its
    last ``\\boxed{...}`` if it has one, else the whole text. Both are normalized: ``$``,
    ``\\left``, ``\\right``, ``\\!``, ``\\,``, ``\\;``, a ``\\text{...}`` wrapper's braces, spaces,
    and a trailing ``.`` are removed; ``\\dfrac`` / ``\\tfrac`` become ``\\frac``. Two answers that
    both read as numbers (integers or decimals, optional sign, ``,`` thousands separators,
    ``a/b``, ``\\frac{a}{b}``, a trailing ``%`` dropped) are compared exactly as fractions, so
    ``0.5`` equals ``1/2`` and ``\\frac{1}{2}``, and ``1,000`` equals ``1000``; anything else
    must be the same text after normalization (``x+1`` equals ``x + 1``, not ``1+x``)."""
    final = final_answer(completion)
    if final is None:
        return 0.0
    reference = last_boxed(answer)
    reference = normalize(answer if reference is None else reference)
    final = normalize(final)
    a, b = as_number(final), as_number(reference)
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    return 1.0 if final == reference and final != "" else 0.0


_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|\.\d+)")


def final_answer(text: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, nested braces kept; None if there is none or
    its braces never close."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


_TEXT = re.compile(r"\\text\{([^{}]*)\}")


def normalize(text: str) -> str:
    text = _TEXT.sub(r"\1", text)
    for drop in ("$", "\\left", "\\right", "\\!", "\\,", "\\;"):
        text = text.replace(drop, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = "".join(text.split())
    return text.removesuffix(".")


_FRAC = re.compile(r"([-+]?)\\frac\{([-+]?\d+)\}\{(\d+)\}")
_PLAIN = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


def as_number(text: str) -> Fraction | None:
    """The exact value of a normalized answer that is a number, else None."""
    text = text.removesuffix("\\%").removesuffix("%")
    frac = _FRAC.fullmatch(text)
    if frac:
        sign, num, den = frac.groups()
        return _ratio(Fraction(num), Fraction(den), sign == "-")
    parts = text.split("/")
    if len(parts) == 2 and all(_PLAIN.fullmatch(p) for p in parts):
        return _ratio(_plain(parts[0]), _plain(parts[1]), False)
    return _plain(text) if _PLAIN.fullmatch(text) else None


def _plain(text: str) -> Fraction:
    return Fraction(text.replace(",", ""))


def _ratio(num: Fraction, den: Fraction, negative: bool) -> Fraction | None:
    if den == 0:
        return None
    return -num / den if negative else num / den
