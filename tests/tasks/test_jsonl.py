"""The JSONL task: bad records reported by line or refused, the held-out split, the data order
of a step, its [task] settings, and two GRPO steps of the loop on a tiny model directory
holding a real HF tokenizer and chat template, with a user's reward."""

import json
import random
import sys
import textwrap

import pytest
from tiny_hf import VOCAB_SIZE, model_dir, save_tokenizer

from fp4rl import config as run_config
from fp4rl.tasks import JsonlConfig, JsonlTask, build_task

pytest.importorskip("tokenizers")

GOOD = [{"id": i, "prompt": f"what is {i}+{i % 7}?", "answer": str(i + i % 7)} for i in range(20)]
# (line, cause) of every bad line of `write_data`'s file, in file order.
BAD = [
    (3, "not valid JSON (Expecting value at column 1)"),
    (5, "not a JSON object but list"),
    (7, "no 'prompt' field"),
    (9, "no 'answer' field"),
    (11, "empty prompt 'prompt'"),
    (13, "'prompt' is a int, not a string"),
    (15, "empty answer 'answer'"),
    (17, "prompt of 101 tokens > task.max_prompt_tokens=60"),
]
BAD_LINES = {
    3: "not json",
    5: "[1, 2]",
    7: '{"answer": "3"}',
    9: '{"prompt": "what is 1+1?"}',
    11: '{"prompt": "   ", "answer": "1"}',
    13: '{"prompt": 5, "answer": "1"}',
    15: '{"prompt": "what is 0?", "answer": ""}',
    17: json.dumps({"prompt": "1" * 100, "answer": "1"}),  # <bos> + 100 characters
}


def write_data(path, good=GOOD):
    """``good`` records on the lines without a bad one, a blank line (not a record) at 19."""
    records, lines = iter(good), []
    for line in range(1, len(good) + len(BAD_LINES) + 2):
        if line in BAD_LINES:
            lines.append(BAD_LINES[line])
        elif line == 19:
            lines.append("   ")
        else:
            lines.append(json.dumps(next(records)))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def data(tmp_path):
    save_tokenizer(tmp_path)
    return write_data(tmp_path / "data.jsonl")


def task(data, log=None, **settings):
    settings = {"tokenizer": str(data.parent), "max_prompt_tokens": 60, **settings}
    return JsonlTask(JsonlConfig(path=str(data), **settings), log=log or (lambda _: None))


def test_bad_records_are_refused_naming_file_and_line(data):
    with pytest.raises(ValueError) as err:
        task(data)
    line, cause = BAD[0]
    assert str(err.value) == (
        f"{data}:{line}: {cause} (task.on_bad_record='skip' leaves such records out)"
    )


def test_skipped_records_are_reported_in_one_message_with_every_line(data):
    lines = []
    t = task(data, lines.append, on_bad_record="skip")
    causes = "; ".join(f"line {line}: {cause}" for line, cause in BAD)
    total = len(GOOD) + len(BAD)
    assert lines[0] == f"task: {data}: skipped {len(BAD)} bad record(s) of {total}: {causes}"
    kept = sorted(r.data["id"] for r in [*t.train_records, *t.held_out()])
    assert kept == list(range(len(GOOD)))  # every good record, none twice
    assert lines[1].startswith(f"task: {data}: 19 train / 1 held-out records, reward math")


def test_records_hold_the_tokenized_prompt_and_the_answer_as_text(data):
    t = task(data, on_bad_record="skip", num_held_out=1)
    record = next(r for r in [*t.train_records, *t.held_out()] if r.data["id"] == 12)
    assert record.answer == "17" and t.decode(record.prompt_ids) == "what is 12+5?"
    assert record.prompt_ids == tuple(t.tokenizer.encode("what is 12+5?"))
    numbers = data.parent / "numbers.jsonl"
    numbers.write_text('{"prompt": "p", "answer": 7}\n{"prompt": "q", "answer": 2.5}\n')
    numeric = task(numbers, num_held_out=1)
    assert sorted(r.answer for r in [*numeric.train_records, *numeric.held_out()]) == ["2.5", "7"]


def test_chat_template_wraps_the_prompt_as_a_user_turn(data):
    t = task(data, on_bad_record="skip", chat_template=True, max_prompt_tokens=100)
    record = t.train_records[0]
    text = t.tokenizer.apply_chat_template([{"role": "user", "content": record.data["prompt"]}])
    assert record.prompt_ids == tuple(t.tokenizer.encode(text, add_special_tokens=False))
    assert t.decode(record.prompt_ids).endswith(f"{record.data['prompt']}\nassistant\n")


def test_split_is_by_prompt_deterministic_and_independent_of_line_order(data, tmp_path):
    t = task(data, on_bad_record="skip", held_out_fraction=0.25)
    held = {r.data["prompt"] for r in t.held_out()}
    assert len(held) == 5  # 25 % of 20 distinct prompts
    assert not held & {r.data["prompt"] for r in t.train_records}
    # A repeated prompt goes with its first copy; the file's order does not matter.
    shuffled = [*GOOD, GOOD[0], GOOD[1]]
    random.Random(0).shuffle(shuffled)
    other = task(write_data(tmp_path / "b.jsonl", shuffled), on_bad_record="skip")
    other_25 = task(write_data(tmp_path / "c.jsonl", shuffled), held_out_fraction=0.25, **SKIP)
    assert {r.data["prompt"] for r in other_25.held_out()} == held
    assert not {r.data["prompt"] for r in other.held_out()} & {
        r.data["prompt"] for r in other.train_records
    }
    # A count instead of the fraction, and another seed, choose other prompts.
    assert len(task(data, num_held_out=3, **SKIP).held_out()) == 3
    reseeded = task(data, held_out_fraction=0.25, held_out_seed=1, **SKIP)
    assert {r.data["prompt"] for r in reseeded.held_out()} != held


SKIP = {"on_bad_record": "skip"}


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"held_out_fraction": 0.01}, r"task.held_out_fraction=0.01 holds out 0 of the 20"),
        ({"num_held_out": 20}, r"task.num_held_out=20 holds out 20 of the 20 distinct prompts"),
    ],
)
def test_split_needs_both_sides(data, settings, message):
    with pytest.raises(ValueError, match=message):
        task(data, **SKIP, **settings)


def test_a_step_s_examples_are_a_pure_function_of_seed_and_step(data):
    t = task(data, **SKIP, num_held_out=4)  # 16 train records
    ids = {(seed, step): [r.data["id"] for r in t.train_examples(seed=seed, step=step, num=4)]
           for seed in (0, 1) for step in reversed(range(8))}  # fmt: skip
    fresh = task(data, **SKIP, num_held_out=4)
    for (seed, step), got in ids.items():
        assert [r.data["id"] for r in fresh.train_examples(seed=seed, step=step, num=4)] == got
    train_ids = sorted(r.data["id"] for r in t.train_records)
    for epoch in (0, 1):  # four steps of four are one epoch: every record once
        steps = range(4 * epoch, 4 * epoch + 4)
        assert sorted(i for s in steps for i in ids[0, s]) == train_ids
    assert [ids[0, s] for s in range(4)] != [ids[0, s] for s in range(4, 8)]  # reshuffled
    assert ids[0, 0] != ids[1, 0]
    # Positions 10-19 straddle two epochs: the end of the first, the start of the second.
    straddle = [r.data["id"] for r in t.train_examples(seed=0, step=1, num=10)]
    assert straddle == [*ids[0, 2][2:], *ids[0, 3], *ids[0, 4]]


def test_math_verify_refuses_a_reference_it_cannot_read(tmp_path):
    pytest.importorskip("math_verify")
    save_tokenizer(tmp_path)
    records = [{"prompt": f"q{i}", "answer": "5"} for i in range(3)]
    records.append({"prompt": "q", "answer": "\\boxed{"})  # a box that never closes
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(
        ValueError, match=r"d.jsonl:4: math-verify reads no answer in '\\\\boxed\{'"
    ):
        task(data, num_held_out=1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task.kind=csv"], r"task.kind must be one of \('arith', 'jsonl'\), got 'csv'"),
        (["task.kind=jsonl"], r"task.path must be a non-empty string, got ''"),
        (
            ["task.kind=jsonl", "task.path=a", "task.min_digits=2"],
            r"task.min_digits is not a setting; \[task\] with kind = 'jsonl' takes answer_field",
        ),
        (["task.path=a"], r"task.path is not a setting; \[task\] with kind = 'arith' takes"),
        (["task.kind=jsonl", "task.path=a", "task.reward=f"], r"task.reward must be 'math' or"),
        (
            ["task.kind=jsonl", "task.path=a", "task.on_bad_record=ignore"],
            r"task.on_bad_record must be one of \('skip', 'error'\)",
        ),
        (["task.kind=jsonl", "task.path=a", "task.num_held_out=0"], r"task.num_held_out must be"),
        (
            ["task.kind=jsonl", "task.path=a", "task.max_prompt_tokens=4096"],
            r"task.max_prompt_tokens=4096 leaves no room to generate within "
            r"engine.max_model_len=4096",
        ),
    ],
)
def test_task_settings_are_checked_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        run_config.load(None, overrides)


def test_task_settings_round_trip_through_toml(tmp_path):
    c = run_config.load(None, ["task.kind=jsonl", "task.path=d.jsonl", "task.num_held_out=3"])
    file = tmp_path / "config.toml"
    file.write_text(run_config.to_toml(c))
    assert run_config.load(file) == c and c.task.num_held_out == 3


def test_a_missing_file_or_tokenizer_is_named(tmp_path):
    save_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"task.path='.*nowhere.jsonl': no such file"):
        task(tmp_path / "nowhere.jsonl")
    with pytest.raises(ValueError, match=r"task.tokenizer is empty and so is model.path"):
        build_task(JsonlConfig(path=str(tmp_path / "d.jsonl")))
    save_tokenizer(tmp_path, chat_template=None)
    with pytest.raises(ValueError, match=r"task.chat_template=true but .* has no chat template"):
        task(tmp_path / "d.jsonl", chat_template=True)


# --- two GRPO steps of the loop -------------------------------------------------------------

USER_REWARD = """
CALLS = []

def digits(completion, answer, record):
    CALLS.append((completion, answer, record["id"]))
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
"""


@pytest.fixture
def user_reward(tmp_path, monkeypatch):
    (tmp_path / "jsonl_loop_reward.py").write_text(textwrap.dedent(USER_REWARD))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("jsonl_loop_reward", None)


def loop_config(model, data, out_dir, **task_settings):
    return run_config.from_dict(
        {
            "model": {"path": str(model), "dtype": "float32", "device": "cpu"},
            "precision": {"kv_cache": "nvfp4", "bf16_first_layers": 1, "bf16_last_layers": 1},
            "engine": {
                "block_size": 4,
                "kv_memory_bytes": 4 << 20,
                "max_model_len": 128,
                "max_num_seqs": 16,
                "max_num_batched_tokens": 256,
                "capture_routing": True,
                "guidance": "full",
            },
            "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_tokens": 6},
            "optim": {"lr": 1e-3},
            "task": {
                "kind": "jsonl",
                "path": str(data),
                "reward": "jsonl_loop_reward:digits",
                "chat_template": True,
                "max_prompt_tokens": 100,  # the template adds 42 tokens to a prompt
                "on_bad_record": "skip",
                "num_held_out": 2,
                **task_settings,
            },
            "align": {"observe_every": 1},
            "run": {
                "steps": 2,
                "out_dir": str(out_dir),
                "eval_every": 1,
                "eval_samples": 1,
                "micro_batch_seqs": 8,
                "threads": 1,
            },
        }
    )


def test_two_grpo_steps_on_a_jsonl_file_with_a_user_reward(tmp_path, user_reward):
    from fp4rl.loop import train

    model = model_dir(tmp_path / "model")
    data = write_data(tmp_path / "data.jsonl")
    config = loop_config(model, data, tmp_path / "run")
    lines = []
    history = train(config, log=lines.append)

    import jsonl_loop_reward

    calls = jsonl_loop_reward.CALLS
    t = build_task(config.task, model_dir=str(model), log=lambda _: None)
    held, n = t.held_out(), config.rollout.samples_per_prompt
    evals = len(held) * (config.run.eval_samples + 1)  # sampled + greedy
    assert len(calls) == 3 * evals + 2 * 4 * n  # evaluations before steps 0, 1 and at the end
    by_id = {r.data["id"]: r for r in [*t.train_records, *held]}
    for completion, answer, record_id in calls:
        assert answer == by_id[record_id].answer
        assert "<" not in completion  # no character of the vocabulary: special tokens left out
    for step in (0, 1):
        start = (step + 1) * evals + step * 4 * n
        step_calls = calls[start : start + 4 * n]
        expected = [r.data["id"] for r in t.train_examples(seed=0, step=step, num=4)]
        assert [c[2] for c in step_calls] == [i for i in expected for _ in range(n)]
        rewards = [jsonl_loop_reward.digits(*c[:2], by_id[c[2]].data) for c in step_calls]
        assert history[step]["reward"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-6)
    assert [m["policy_version"] for m in history] == [0, 1, 2]
    assert any(m["trained_samples"] > 0 for m in history[:2])  # a reward with variance trains
    assert history[0]["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-5)
    skipped = next(line for line in lines if "skipped" in line)
    assert all(f"line {line}:" in skipped for line, _ in BAD)
    assert "reward jsonl_loop_reward:digits, stop tokens [2, 5]" in lines[1]


def test_the_model_must_cover_the_tokenizer(tmp_path, user_reward):
    from tiny_models import qat_model, tiny_config, tiny_precision

    from fp4rl.loop import train
    from fp4rl.model.checkpoint import save_checkpoint

    small = qat_model(tiny_precision(), config=tiny_config(vocab_size=32))
    save_checkpoint(small.state_dict(), small.config, tmp_path / "model")
    save_tokenizer(tmp_path / "model")
    config = loop_config(tmp_path / "model", write_data(tmp_path / "d.jsonl"), tmp_path / "run")
    with pytest.raises(ValueError, match=rf"vocab_size=32 does not cover the task's {VOCAB_SIZE}"):
        train(config, log=lambda _: None)
