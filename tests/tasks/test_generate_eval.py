"""``fp4rl generate`` and ``fp4rl eval`` on the tiny model directory: their output against the
engine and `fp4rl.loop.evaluate` run directly with the same settings, both precisions, input
from a file or stdin, a run directory's latest checkpoint, and bad input as exit status 2."""

import io
import json
import textwrap

import pytest
from tiny_hf import model_dir

from fp4rl import config as run_config
from fp4rl.cli import main
from fp4rl.inference import load_engine
from fp4rl.loop import evaluate
from fp4rl.rollout import SamplingParams
from fp4rl.tasks import build_task

pytest.importorskip("tokenizers")

PROMPTS = ["what is 2+3?", "what is 10+7?", "say 5"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model directory, a JSONL task file and a TOML config for them."""
    root = tmp_path_factory.mktemp("inference")
    model = model_dir(root / "model")
    data = root / "data.jsonl"
    rows = [{"q": f"what is {i}+{i % 3}?", "a": str(i + i % 3)} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = root / "run.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            [model]
            path = "{model}"
            dtype = "float32"
            device = "cpu"
            [precision]
            kv_cache = "nvfp4"
            bf16_first_layers = 1
            bf16_last_layers = 1
            [engine]
            block_size = 4
            kv_memory_bytes = 4194304
            max_model_len = 128
            max_num_seqs = 16
            max_num_batched_tokens = 256
            capture_routing = true
            guidance = "full"
            [rollout]
            max_tokens = 6
            [task]
            kind = "jsonl"
            path = "{data}"
            prompt_field = "q"
            answer_field = "a"
            chat_template = true
            max_prompt_tokens = 100
            num_held_out = 4
            [run]
            eval_samples = 2
            threads = 1
            """
        )
    )
    return model, data, config


def direct(config, prompts, precision, params):
    """What the engine itself generates for the task's prompts: the reference."""
    task = build_task(config.task, model_dir=config.model.path, log=lambda _: None)
    engine = load_engine(config, precision, task)
    return task, engine.generate([task.encode_prompt(p) for p in prompts], params)


@pytest.mark.parametrize("precision", ["config", "bf16"])
def test_generate_writes_what_the_engine_generates(files, tmp_path, precision):
    _, _, config_file = files
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"q": p}) + "\n" for p in PROMPTS[:2]) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--config", str(config_file), "--input", str(prompts)]
    argv += ["--output", str(out), "--samples", "3", "--precision", precision]
    assert main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    config = run_config.load(config_file)
    task, done = direct(
        config,
        PROMPTS[:2],
        precision,
        SamplingParams(n=3, temperature=1.0, max_tokens=6, stop_token_ids=(2, 5), seed=0),
    )
    assert [(r["line"], r["sample"], r["prompt"]) for r in records] == [
        (line, sample, PROMPTS[line - 1]) for line in (1, 2) for sample in range(3)
    ]
    for record, c in zip(records, done, strict=True):
        ids = list(c.completion_ids)
        assert record["completion_tokens"] == len(ids)
        assert record["finish_reason"] == c.finish_reason
        assert record["completion"] == task.decode(ids[:-1] if c.finish_reason == "stop" else ids)


def test_generate_reads_plain_lines_from_stdin_and_writes_stdout(files, monkeypatch, capsys):
    _, _, config_file = files
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(PROMPTS) + "\n"))
    assert main(["generate", "--config", str(config_file), "--text", "--greedy"]) == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in captured.out.splitlines()]
    config = run_config.load(config_file)
    task, done = direct(
        config,
        PROMPTS,
        "config",
        SamplingParams(temperature=0, max_tokens=6, stop_token_ids=(2, 5)),
    )
    assert [r["prompt"] for r in records] == PROMPTS
    for record, c in zip(records, done, strict=True):
        ids = list(c.completion_ids)
        assert record["completion"] == task.decode(ids[:-1] if c.finish_reason == "stop" else ids)
    assert "train / 4 held-out records" in captured.err  # the task's report, not in the output


@pytest.mark.parametrize("precision", ["config", "bf16"])
def test_eval_reports_what_the_loop_measures(files, capsys, precision):
    _, _, config_file = files
    assert main(["eval", "--config", str(config_file), "--precision", precision]) == 0
    result = json.loads(capsys.readouterr().out)
    config = run_config.load(config_file)
    task = build_task(config.task, model_dir=config.model.path, log=lambda _: None)
    engine = load_engine(config, precision, task)
    expected = evaluate(engine, task, task.held_out(), config)
    assert {k: result[k] for k in expected} == expected
    assert result["num_held_out"] == 4 and result["eval_samples"] == 2
    described = "bf16" if precision == "bf16" else "experts nvfp4, kv_cache nvfp4"
    assert result["precision"] == described


def test_eval_of_a_run_directory_uses_its_latest_checkpoint(files, tmp_path, capsys):
    from fp4rl.loop import train

    _, _, config_file = files
    out_dir = tmp_path / "run"
    overrides = [f"run.out_dir={out_dir}", "run.steps=1", "rollout.prompts_per_step=2"]
    train(run_config.load(config_file, overrides), log=lambda _: None)
    assert main(["eval", str(out_dir)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == str(out_dir / "checkpoints" / "step-00000001" / "model")
    assert 0 <= result["held_out_accuracy"] <= 1 and 0 <= result["held_out_greedy"] <= 1


@pytest.mark.parametrize(
    "argv, stdin, message",
    [
        (["generate", "--config", "{config}"], '{"q": "a"}\nnot json\n', "<stdin>:2: not valid"),
        (["generate", "--config", "{config}"], '{"p": "a"}\n', "<stdin>:1: no non-empty string"),
        (["generate", "--config", "{config}"], "\n", "<stdin> holds no prompt"),
        (["generate", "--config", "{config}", "--text"], "9" * 130 + "\n", "<stdin>:1: prompt of"),
        (["generate", "--config", "{config}", "--samples", "0"], "", "--samples must be >= 1"),
        (["generate", "--config", "{config}", "--precision", "fp8"], "a\n", "--precision must"),
        (["eval", "{model}"], "", "is a checkpoint directory: name the settings"),
        (["eval"], "", "name a run or checkpoint directory, or a config file"),
        (["eval", "{model}/nowhere"], "", "is not a directory"),
    ],
)
def test_bad_input_exits_2_with_a_one_line_cause(files, monkeypatch, capsys, argv, stdin, message):
    model, _, config_file = files
    argv = [a.format(config=config_file, model=model) for a in argv]
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"fp4rl {argv[0]}: error: ") and message in err


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_help_lists_the_options(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    options = ["--config", "--precision", "--set"]
    if command == "generate":
        options += ["--input", "--output", "--text", "--field", "--samples", "--greedy"]
    for option in options:
        assert option in out
