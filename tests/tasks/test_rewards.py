"""Rewards of text tasks: the built-in answer check and math-verify on worked examples, the
choice between them, and user rewards by import path, failing by name."""

import sys
import textwrap

import pytest

from fp4rl.tasks import rewards
from fp4rl.tasks.rewards import boxed_answer_reward, load_reward

# (completion, reference, reward): what the built-in check accepts, as its docstring says.
BUILT_IN = [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),  # fractions compared exactly
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
    ("the answer is 3/4", "0.75", 1.0),
    ("there are 1,000 of them", "1000", 1.0),  # thousands separators
    ("\\boxed{1,000}", "1000.0", 1.0),
    ("it is 42.", "42", 1.0),  # the last number; a trailing period is not a decimal point
    ("-3 is the answer", "-3", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("first 7, then 8", "7", 0.0),  # the last number counts
    ("\\boxed{7} and later 8", "7", 1.0),  # a boxed answer wins over later numbers
    ("\\boxed{3} then \\boxed{4}", "4", 1.0),  # the last boxed one
    ("\\boxed{x+1}", "x + 1", 1.0),  # text: equal after removing spaces
    ("\\boxed{1+x}", "x+1", 0.0),  # no algebra in the built-in check
    ("\\boxed{\\text{yes}}", "yes", 1.0),
    ("$\\left( 1, 2 \\right)$ \\boxed{\\left(1,2\\right)}", "(1, 2)", 1.0),
    ("\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", 1.0),  # a boxed reference is unboxed
    ("\\boxed{{2}", "2", 1.0),  # braces never close: no boxed answer, the last number
    ("no number here", "5", 0.0),
    ("\\boxed{}", "5", 0.0),
    ("5/0", "5", 0.0),  # no value, and not the same text
]


@pytest.mark.parametrize("completion, reference, expected", BUILT_IN)
def test_built_in_check_on_worked_examples(completion, reference, expected):
    assert boxed_answer_reward(completion, reference, {}) == expected


# math-verify reads what the built-in check cannot: algebra, sets, intervals.
MATH_VERIFY = [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{1+x}", "x + 1", 1.0),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
    ("the answer is 42.", "42", 1.0),
    ("\\boxed{41}", "42", 0.0),
    ("no answer", "5", 0.0),
]


@pytest.mark.parametrize("completion, reference, expected", MATH_VERIFY)
def test_math_verify_on_worked_examples(completion, reference, expected):
    pytest.importorskip("math_verify")
    assert rewards.math_verify_reward(completion, reference, {}) == expected


def test_math_uses_math_verify_when_importable_and_the_built_in_check_otherwise(monkeypatch):
    pytest.importorskip("math_verify")
    assert load_reward("math") == (rewards.math_verify_reward, "math (math-verify)")
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now fails
    assert load_reward("math") == (boxed_answer_reward, "math (built-in boxed/number check)")


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_task_rewards.py").write_text(
        textwrap.dedent(
            """
            def prefix(completion, answer, record):
                return float(completion.startswith(answer)) + record.get("bonus", 0)

            def broken(completion, answer, record):
                return record["value"]

            not_a_function = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_task_rewards", None)


def test_user_reward_by_import_path(user_rewards):
    fn, name = load_reward("my_task_rewards:prefix")
    assert name == "my_task_rewards:prefix"
    assert fn("12 apples", "12", {}) == 1.0 and fn("3", "12", {"bonus": 0.5}) == 0.5
    args = ("my_task_rewards:prefix", "12", "12", {}, "data.jsonl:3")
    assert rewards.checked(fn, *args) == 1.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:f", r"task.reward='no_such_module_xyz:f': cannot import"),
        ("my_task_rewards:missing", r"'my_task_rewards' has no function 'missing'"),
        ("my_task_rewards:not_a_function", r"has no function 'not_a_function'"),
        ("my_task_rewards", r"task.reward must be 'math' or 'module:function'"),
        (":prefix", r"task.reward must be 'math' or 'module:function'"),
    ],
)
def test_user_reward_that_cannot_be_found_is_named(user_rewards, spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward(spec)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "1.0", None, [1.0]])
def test_a_reward_that_is_not_a_finite_number_is_an_error_naming_it_and_the_record(
    user_rewards, value
):
    fn, spec = load_reward("my_task_rewards:broken")
    with pytest.raises(ValueError) as err:
        rewards.checked(fn, spec, "text", "answer", {"value": value}, "data.jsonl:7")
    assert str(err.value) == (
        f"task.reward='my_task_rewards:broken' returned {value!r} for data.jsonl:7: "
        "a reward must be a finite number"
    )
    assert rewards.checked(fn, spec, "", "", {"value": True}, "x") == 1.0  # a bool is 0 or 1


def test_an_exception_in_a_user_reward_names_the_reward_and_the_record(user_rewards):
    fn, spec = load_reward("my_task_rewards:broken")
    with pytest.raises(ValueError) as err:
        rewards.checked(fn, spec, "text", "answer", {}, "data.jsonl:9")
    assert str(err.value) == (
        "task.reward='my_task_rewards:broken' raised KeyError: 'value' for data.jsonl:9"
    )
    assert isinstance(err.value.__cause__, KeyError)  # the reward's own traceback is kept
