"""``fp4rl bench``: the benchmarks of the repository listed with their docstrings' first
paragraphs, one run by name with its own arguments (a CPU smoke run, its table read back), its
exit status passed on, and one-line errors for an unknown name or a missing directory."""

import ast
import re
from pathlib import Path

import pytest

from fp4rl.cli import main
from fp4rl.commands import bench

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_list_names_every_benchmark_with_its_docstring(capsys):
    assert main(["bench", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"benchmarks in {BENCHMARKS} ")
    listed = dict(line.split(maxsplit=1) for line in lines[1:])
    scripts = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
    assert list(listed) == [p.stem for p in scripts]
    assert {"generate", "moe", "attention", "quantize", "refit", "train_step"} <= set(listed)
    for script in scripts:
        first = ast.get_docstring(ast.parse(script.read_text())).split("\n\n")[0]
        assert listed[script.stem] == " ".join(first.split()), script.name


def test_a_smoke_benchmark_runs_through_the_command_with_its_arguments(capfd):
    argv = ["bench", "refit", "--device", "cpu", "--layers", "2", "--hidden", "128"]
    assert main([*argv, "--repeats", "1"]) == 0
    out, err = capfd.readouterr()
    script = BENCHMARKS / "refit.py"
    assert f"fp4rl bench: running {script} --device cpu --layers 2 --hidden 128" in err
    # The script's own table, at the sizes passed through: hidden 128 in every tensor's shape.
    rows = re.findall(r"^\| (w13|w2) \[(\d+)x(\d+)x(\d+)\] \| device copy \|", out, flags=re.M)
    assert {r[0] for r in rows} == {"w13", "w2"} and all("128" in r[1:] for r in rows)


def test_the_transformers_comparison_smoke_run_has_its_table(capfd):
    """hf_generate at tiny shapes: a row per generator and batch, every transformers setup
    timed, and tokens mostly equal to the engine's (the same weights: a wrong name mapping
    would leave ~1/vocab equal; near-ties in BF16 may still part a row, so not all)."""
    pytest.importorskip("transformers", minversion="5.0")
    argv = ["bench", "hf_generate", "--device", "cpu", "--layers", "2", "--hidden", "64"]
    argv += ["--prompt-len", "16", "--max-tokens", "4", "--batches", "1", "3", "--repeats", "1"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    table = [line.strip("| ") for line in out.splitlines() if re.match(r"\| \d+ \| ", line)]
    rows = [line.split(" | ") for line in table]
    generators = [(r[0], r[1].split(" (")[0]) for r in rows]
    per_batch = [
        "fp4rl engine",
        *(f"transformers generate, {c} cache" for c in ("dynamic", "static")),
    ]
    assert generators == [(b, g) for b in ("1", "3") for g in per_batch]
    first_equal = 0
    for batch, _, _, tok_s, ratio, equal, first, prefix in (
        r for r in rows if "transformers" in r[1]
    ):
        assert float(tok_s.replace(",", "")) > 0 and ratio.endswith("x")
        assert 50 <= float(equal.rstrip("%")) <= 100
        agreed, of = map(int, first.split("/"))
        assert of == int(batch) and 0 <= float(prefix) <= 4
        first_equal += agreed
    assert first_equal >= 4  # of 8 rows
    assert re.search(r"^batch 3: engine [\d.]+x transformers \((dynamic|static) cache", out, re.M)
    split = r"^batch 3: the engine's call, [\d.]+ ms: the prompt and first token [\d.]+ ms, then "
    assert re.search(split + r"-?[\d.]+ ms per decode step$", out, re.M)


def test_the_host_share_smoke_run_times_each_part_of_the_engine(capfd):
    """engine_host at tiny shapes on the CPU: the two calls timed, and each engine part's host
    time per call, with as many steps as the call has tokens."""
    pytest.importorskip("transformers", minversion="5.0")  # it builds hf_generate's engine
    argv = ["bench", "engine_host", "--device", "cpu", "--layers", "2", "--hidden", "64"]
    assert main([*argv, "--prompt-len", "16", "--max-tokens", "3", "--repeats", "1"]) == 0
    out = capfd.readouterr().out
    assert re.search(r"^- a call of 3 new tokens, ms: median [\d.]+, min", out, re.M)
    steps = re.findall(r"^\| _launch \| (\d+) \| [\d.]+ \|", out, re.M)
    assert steps == ["1", "3"]  # the prompt's step, then one per decode
    assert re.findall(r"^\| generate \| (\d+) \|", out, re.M) == ["1", "1"]


def test_the_rollout_smoke_run_counts_steps_and_captures(capfd):
    """generate at tiny shapes on the CPU, samples of their own lengths, the pages given back
    before the timed call: a row per engine with its steps, all eager, and no graph captured
    (graphs are the GPU's); each engine seated as its pages hold full-length sequences, rounded
    down to a graph's batch."""
    argv = ["bench", "generate", "--device", "cpu", "--layers", "2", "--hidden", "64"]
    argv += ["--prompts", "2", "--n", "2", "--prompt-len", "8", "--max-tokens", "8"]
    argv += ["--kv-gib", "0.0125"]  # a few pages: the default 8 GiB zeroes slowly on the CPU
    argv += ["--repeats", "1", "--spread-lengths", "--release-kv", "--capture-warmups", "1"]
    argv += ["--capture-warmups-seen", "0", "--max-num-seqs", "fit"]
    argv += ["--variants", "bf16 experts, bf16 kv;nvfp4 experts, nvfp4 kv"]
    assert main(argv) == 0
    cells = r" \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) \|$"  # steps .. capture s
    label = r"^\| (\w+) experts, \w+ kv \((\d+) seats\) \|.*"
    rows = re.findall(label + cells, capfd.readouterr().out, re.M)
    # 13.4 MB of pages hold 3 (BF16, 4,096 bytes a token) and 11 (NVFP4, 1,184) sequences of
    # the engines' 1,024 tokens: graph batches 2 and 8.
    assert [r[:2] for r in rows] == [("bf16", "2"), ("nvfp4", "8")]
    for _, _, steps, eager, preempted, graphs, seconds in rows:
        assert int(steps) == int(eager) > 0 and preempted == "0"
        assert graphs == "0" and float(seconds) == 0


def test_the_benchmarks_exit_status_is_the_commands(capfd):
    assert main(["bench", "attention", "--no-such-option"]) == 2  # the script's argparse
    assert "attention.py: error: unrecognized arguments: --no-such-option" in capfd.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "nope"], "no benchmark 'nope' in .*; there are: attention, .*train_step"),
        (["bench"], "name a benchmark, or --list to see them: attention, "),
        (["bench", "--dir", "{tmp}", "moe"], r"--dir .* is not fp4rl's benchmarks directory"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp4rl bench: error:") and err.count("\n") == 1
    assert re.search(message, err), err


def test_an_installed_package_without_benchmarks_says_where_they_are(tmp_path, monkeypatch, capsys):
    """As from a wheel: nothing beside the package. --dir then finds a checkout's."""
    monkeypatch.setattr(bench, "ROOT", tmp_path / "site-packages")
    assert main(["bench", "--list"]) == 2
    err = capsys.readouterr().err
    assert "an installed package does not carry" in err and "--dir CHECKOUT/benchmarks" in err
    assert main(["bench", "--dir", str(BENCHMARKS), "--list"]) == 0
    assert "refit " in capsys.readouterr().out
