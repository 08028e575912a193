"""The arithmetic task: tokenizer round trip, split disjointness, rewards, determinism."""

import dataclasses
import random

import pytest

from fp4rl.tasks.arith import (
    TaskConfig,
    held_out_problems,
    make_problem,
    make_sum_problem,
    reward,
    split_of,
    sum_split,
    train_problems,
)
from fp4rl.tasks.tokenizer import BOS, EOS, PAD, VOCAB, decode, encode

CONFIG = TaskConfig()


def test_tokenizer_round_trip_and_fixed_ids():
    text = "0123456789+=9+1="
    assert decode(encode(text)) == text
    # The ids are a contract with saved models: specials first, then the characters in order.
    assert (PAD, BOS, EOS) == (0, 1, 2) and len(VOCAB) == 15
    assert encode("0+9=") == [3, 13, 12, 14]
    assert decode([BOS, 4, 13, 5, 14, 6, EOS, PAD]) == "<bos>1+2=3<eos><pad>"


def test_tokenizer_rejects_unknown_text_and_ids():
    with pytest.raises(ValueError, match=r"character '-' at 1 of '1-2' is not in"):
        encode("1-2")
    with pytest.raises(ValueError, match=r"token id 15 is outside the vocabulary \[0, 15\)"):
        decode([3, 15])


def test_problem_layout():
    p = make_problem(58, 67, CONFIG)
    assert decode(p.prompt_ids) == "<bos>58+67=" and decode(p.answer_ids) == "125<eos>"
    reversed_ = make_problem(58, 67, TaskConfig(reverse_answer=True))
    assert decode(reversed_.answer_ids) == "521<eos>"  # 125 written ones digit first


def test_splits_are_disjoint_and_symmetric():
    train = train_problems(CONFIG, num=3000, seed=0)
    held_out = held_out_problems(CONFIG)
    held_pairs = {(p.a, p.b) for p in held_out}
    assert len(held_pairs) == CONFIG.num_held_out  # distinct
    unordered = {frozenset(pair) for pair in held_pairs}
    assert not any(frozenset((p.a, p.b)) in unordered for p in train)  # b+a included
    assert all(split_of(p.b, p.a, CONFIG) == "held_out" for p in held_out)
    # The hash picks about held_out_fraction = 5 % of random problems; 3000 draws give
    # a binomial std of ~0.4 %, so [3 %, 7 %] fails only on a broken hash.
    rng = random.Random(1)
    pairs = [(rng.randrange(1000), rng.randrange(1000)) for _ in range(3000)]
    held = {pair for pair in pairs if split_of(*pair, CONFIG) == "held_out"}
    assert 0.03 < len(held) / len(pairs) < 0.07
    # Thresholds on one hash nest: a larger fraction only moves problems into held-out.
    wider = TaskConfig(held_out_fraction=0.5)
    assert all(split_of(*pair, wider) == "held_out" for pair in held)


def test_digit_range_is_respected_and_covered():
    config = TaskConfig(min_digits=2, max_digits=3)
    problems = train_problems(config, num=400, seed=3)
    lengths = {len(str(x)) for p in problems for x in (p.a, p.b)}
    assert lengths == {2, 3}


def test_generation_is_deterministic_under_a_seed():
    assert train_problems(CONFIG, num=50, seed=7) == train_problems(CONFIG, num=50, seed=7)
    assert train_problems(CONFIG, num=50, seed=7) != train_problems(CONFIG, num=50, seed=8)
    assert held_out_problems(CONFIG) == held_out_problems(TaskConfig())
    assert held_out_problems(CONFIG) != held_out_problems(TaskConfig(held_out_seed=1))
    # Pinned: a change of generator or hash would silently change every reported accuracy.
    first = train_problems(CONFIG, num=2, seed=0)
    assert [(p.a, p.b) for p in first] == [(63, 4), (597, 48)]


@pytest.mark.parametrize(
    "completion, format_reward, expected",
    [
        ("125<eos>", 0.0, 1.0),
        ("125<eos>", 0.1, 1.0),
        ("124<eos>", 0.0, 0.0),
        ("124<eos>", 0.1, 0.1),  # well formed, wrong: the format reward
        ("125", 0.1, 0.0),  # cut off before EOS
        ("1250<eos>", 0.0, 0.0),  # the answer is a prefix, not the answer
        ("125<eos><eos>", 0.1, 0.0),  # anything after EOS
        ("<eos>", 0.1, 0.0),  # no digits
        ("12+5<eos>", 0.1, 0.0),  # not digits only
        ("", 0.1, 0.0),
    ],
)
def test_reward(completion, format_reward, expected):
    problem = make_problem(58, 67, TaskConfig(format_reward=format_reward))
    ids = _ids(completion)
    assert reward(problem, ids, TaskConfig(format_reward=format_reward)) == expected


def _ids(text):
    ids, rest = [], text
    while rest:
        if rest.startswith("<eos>"):
            ids.append(EOS)
            rest = rest[len("<eos>") :]
        else:
            ids += encode(rest[0])
            rest = rest[1:]
    return ids


@pytest.mark.parametrize(
    "key, value",
    [
        ("min_digits", 0),
        ("max_digits", 0),  # < min_digits
        ("reverse_answer", "yes"),
        ("held_out_fraction", 1.0),
        ("num_held_out", 0),
        ("held_out_seed", -1),
        ("format_reward", 1.0),
        ("format_reward", float("nan")),
        ("num_operands", 1),
        ("partial_sums", "yes"),
        ("fixed_width", -1),
    ],
)
def test_config_rejects_naming_key_and_value(key, value):
    with pytest.raises(ValueError, match=rf"task\.{key} .*got {value!r}"):
        TaskConfig(**{key: value})


def test_config_refuses_more_held_out_problems_than_the_split_holds():
    # One-digit operands: 10 x 10 = 100 problems, ~5 held out; 3 is more than half of them.
    with pytest.raises(ValueError, match=r"task\.num_held_out=3 exceeds half of the ~5"):
        TaskConfig(max_digits=1, num_held_out=3)
    assert len(held_out_problems(TaskConfig(max_digits=1, num_held_out=2))) == 2


def test_arith_task_interface_is_the_module_functions():
    """`ArithTask` (what the loop uses) draws, holds out and scores exactly as the functions
    above, with the loop's per-step seed."""
    from fp4rl.tasks import ArithTask, step_seed

    config = TaskConfig(reverse_answer=True)
    task = ArithTask(config)
    assert task.train_examples(seed=3, step=5, num=7) == train_problems(
        config, num=7, seed=step_seed(3, 5)
    )
    assert step_seed(3, 5) == 3 * 1_000_003 + 5  # the loop's seed of step 5 of run seed 3
    assert task.held_out() == held_out_problems(config)
    p = make_problem(58, 67, config)
    assert task.reward(p, p.answer_ids) == 1.0 == reward(p, p.answer_ids, config)
    assert tuple(task.encode_prompt("58+67=")) == p.prompt_ids
    assert (task.stop_token_ids, task.vocab_size) == ((EOS,), len(VOCAB))
    assert task.decode([*p.answer_ids, 15]) == "521<eos><unk:15>"


# --- longer completions: several operands, every running sum written out -------------------

LONG = TaskConfig(max_digits=1, num_operands=8, partial_sums=True, reverse_answer=True)


def test_partial_sums_layout():
    p = make_sum_problem((6, 4, 6, 7, 9, 8, 4, 1), LONG)
    assert decode(p.prompt_ids) == "<bos>6+4+6+7+9+8+4+1="
    # Running sums 10, 16, 23, 32, 40, 44, 45, each written ones digit first.
    assert decode(p.answer_ids) == "01=61=32=23=04=44=54<eos>"
    forward = TaskConfig(max_digits=2, num_operands=3, partial_sums=True)
    assert decode(make_sum_problem((58, 67, 9), forward).answer_ids) == "125=134<eos>"
    # Without partial sums the answer is the total alone; with two operands the two agree.
    total = TaskConfig(max_digits=2, num_operands=3)
    assert decode(make_sum_problem((58, 67, 9), total).answer_ids) == "134<eos>"
    assert make_sum_problem((58, 67), forward) == make_problem(58, 67, CONFIG)
    with pytest.raises(ValueError, match=r"2 or more operands >= 0, got \(5,\)"):
        make_sum_problem((5,), LONG)


def test_several_operands_generation_and_split():
    problems = train_problems(LONG, num=300, seed=2)
    assert {len(p.operands) for p in problems} == {8}
    assert {x for p in problems for x in p.operands} == set(range(10))
    assert train_problems(LONG, num=20, seed=2) == problems[:20]  # deterministic
    lengths = [len(p.answer_ids) for p in problems]
    assert 18 <= sum(lengths) / len(lengths) <= 21  # 7 running sums of 1-2 digits, 6 '=', EOS
    for p in problems[:20]:
        assert reward(p, p.answer_ids, LONG) == 1.0
    held_out = held_out_problems(LONG)
    assert len({p.operands for p in held_out}) == LONG.num_held_out
    # A reordering of a held-out sum is held out too, so training never sees it in any order.
    rng = random.Random(0)
    for p in held_out[:50]:
        shuffled = list(p.operands)
        rng.shuffle(shuffled)
        assert sum_split(shuffled, LONG) == "held_out"
    held = {tuple(sorted(p.operands)) for p in held_out}
    train = train_problems(LONG, num=3000, seed=0)
    assert not any(tuple(sorted(p.operands)) in held for p in train)
    # Two operands hash as they always did (the 2-operand problems and their split are kept).
    assert all(sum_split((a, b), CONFIG) == split_of(a, b, CONFIG) for a, b in [(3, 9), (63, 4)])


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("01=61=32=23=04=44=54<eos>", 1.0),
        ("01=61=32=33=04=44=54<eos>", 0.1),  # a wrong running sum, the right total: wrong
        ("54<eos>", 0.0),  # the total alone is not the chain
        ("01=61=32=23=04=44=54", 0.0),  # cut off before EOS
        ("01=61=32=23=04=44=54=<eos>", 0.0),  # a trailing '='
        ("01==61=32=23=04=44<eos>", 0.0),  # an empty group
        ("01=61=32=23=04=44=54=1<eos>", 0.0),  # one group too many
        ("01=61=32=23+04=44=54<eos>", 0.0),  # not digits and '='
    ],
)
def test_partial_sums_reward_needs_the_whole_chain(completion, expected):
    config = dataclasses.replace(LONG, format_reward=0.1)
    problem = make_sum_problem((6, 4, 6, 7, 9, 8, 4, 1), config)
    assert reward(problem, _ids(completion), config) == expected


def test_held_out_estimate_counts_every_operand():
    # One-digit operands, three of them: 1000 problems, ~50 held out.
    with pytest.raises(ValueError, match=r"num_held_out=26 exceeds half of the ~50 .* 3 operands"):
        TaskConfig(max_digits=1, num_operands=3, num_held_out=26)
    assert len(held_out_problems(TaskConfig(max_digits=1, num_operands=3, num_held_out=25))) == 25


def test_fixed_width_pads_every_operand_and_sum():
    config = dataclasses.replace(LONG, fixed_width=2)
    p = make_sum_problem((6, 4, 6, 7, 9, 8, 4, 1), config)
    assert decode(p.prompt_ids) == "<bos>06+04+06+07+09+08+04+01="
    assert decode(p.answer_ids) == "01=61=32=23=04=44=54<eos>"
    q = make_sum_problem((0, 1, 0, 5, 5, 3, 3, 8), config)
    assert decode(q.answer_ids) == "10=10=60=11=41=71=52<eos>"  # 01, 01, 06, ... reversed
    assert {len(p.answer_ids) for p in train_problems(config, num=50, seed=0)} == {21}
    assert reward(q, _ids("1=1=6=11=41=71=52<eos>"), config) == 0.0  # unpadded is not it
    with pytest.raises(ValueError, match=r"fixed_width=1 cannot hold the largest sum 72 of 8"):
        dataclasses.replace(LONG, fixed_width=1)
    # Operands past the config's digit range, given directly: checked per problem.
    with pytest.raises(ValueError, match=r"fixed_width=2 cannot hold the sums of \(50, 70\)"):
        make_sum_problem((50, 70), dataclasses.replace(LONG, fixed_width=2))
