"""Looking at a run: a short GRPO run of the loop with the mismatch observed at every step and
TensorBoard on; its report's plots read back as images, its summary's numbers equal to those
recomputed from metrics.jsonl, its TensorBoard scalars equal to metrics.jsonl's values; and
``fp4rl report`` refusing a run directory without a readable metrics file, naming the line."""

import dataclasses
import json
import re
import shutil
import sys

import numpy as np
import pytest

from fp4rl import config as run_config
from fp4rl import demo
from fp4rl.cli import main
from fp4rl.config import AlignSection
from fp4rl.metrics_log import TensorBoardLog, read_metrics
from fp4rl.model.precision import PrecisionConfig
from fp4rl.report import ESSENTIALS, FIGURES, summary, write_report
from fp4rl.train.optim import OptimConfig

STEPS = 3


def event_accumulator():
    return pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Three GRPO steps of the demo's setup, small: BF16 with nearest rounding, so the trainer's
    codes differ from the rollout's somewhere and the agreement is not trivially 1; a format
    reward, so groups differ and every step trains."""
    from fp4rl.loop import train

    event_accumulator()  # run.tensorboard needs it
    cache, out = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp("run")
    overrides = ["model.dtype=bfloat16", "model.device=cpu"]
    base_config = run_config.load(demo.CONFIG_FILE, overrides)
    warmup = demo.Warmup(steps=20, check_every=20, optim=OptimConfig(lr=3e-3, warmup_steps=5))
    base = demo.base_policy(base_config, cache, seed=0, warmup=warmup, log=lambda _: None)
    config = run_config.load(
        demo.CONFIG_FILE,
        [
            *overrides,
            f"model.path={base}",
            f"run.out_dir={out}",
            f"run.steps={STEPS}",
            "run.eval_every=2",
            "run.tensorboard=true",
            "align.observe_every=1",
            "align.rounding=nearest",
            "rollout.prompts_per_step=16",
            "task.num_held_out=32",
            "task.format_reward=0.5",
        ],
    )
    train(config, log=lambda _: None)
    return out


def jsonl(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tables(md: str) -> dict[str, list[str]]:
    """Every table row of ``md``: its first cell (backticks dropped) -> the other cells."""
    rows = {}
    for line in md.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("metric", "setting", "phase"):
            rows[cells[0].replace("`", "")] = cells[1:]
    return rows


def at(value, step):
    return f"{value:.6g} (step {step})"


def test_the_run_records_what_the_report_draws(run_dir):
    entries = jsonl(run_dir)
    assert [m["step"] for m in entries] == list(range(STEPS + 1))
    for m in entries[:STEPS]:
        assert m["trained_samples"] > 0 and "loss" in m
        assert "code_agreement/layer1" in m and "code_agreement/expert_input" in m
        # The update's gap (over its tokens) and the observed batch's, side by side.
        assert {"token_mult_prob_error", "observed_token_mult_prob_error"} <= set(m)
    # BF16, nearest rounding: the two sides' codes differ at some step and site.
    assert min(m["code_agreement"] for m in entries[:STEPS]) < 1.0


def test_report_plots_are_images_and_its_numbers_are_the_metrics(run_dir, tmp_path):
    matplotlib_image = pytest.importorskip("matplotlib.image")
    written = write_report(run_dir, tmp_path / "report")
    assert [p.name for p in written] == [*FIGURES, "report.md"]
    for png in written[:-1]:
        pixels = matplotlib_image.imread(png)
        assert pixels.ndim == 3 and min(pixels.shape[:2]) >= 200, png.name
        assert pixels[..., :3].std() > 0.05, f"{png.name} is blank"
    md = written[-1].read_text()
    for link in re.findall(r"!\[[^]]*\]\(([^)]+)\)", md):
        assert (written[-1].parent / link).is_file(), link
    assert set(re.findall(r"\(([a-z]+\.png)\)", md)) == set(FIGURES)

    entries, rows = jsonl(run_dir), tables(md)
    assert f"{STEPS} GRPO steps recorded (steps 0 to {STEPS - 1})" in md
    assert f"final evaluation at step {STEPS}" in md
    assert rows["run.steps"] == [f"`{STEPS}`"] and rows["align.rounding"] == ['`"nearest"`']
    assert rows["align.trainer_forward"] == ['`"packed"`']
    for key in ("held_out_accuracy", "held_out_greedy", "reward"):
        got = [(m[key], m["step"]) for m in entries if key in m]
        best = max(got, key=lambda p: p[0])  # the first step that reached it
        assert rows[key] == [at(*got[0]), at(*got[-1]), at(*best)], key
    assert [m["step"] for m in entries if "held_out_accuracy" in m] == [0, 2, 3]
    for key in (
        "observed_kl",
        "observed_max_abs_dlogp",
        "code_agreement",
        "code_agreement/layer2",
        "code_agreement/k",
    ):
        got = [(m[key], m["step"]) for m in entries if key in m]
        low, high = min(got, key=lambda p: p[0]), max(got, key=lambda p: p[0])
        assert rows[key] == [at(*low), at(*high), f"{got[-1][0]:.6g}", str(STEPS)], key
    for key in ("token_mult_prob_error", "observed_token_mult_prob_error"):
        gap = [(m[key] - 1, m["step"]) for m in entries[:STEPS]]
        assert rows[f"{key} - 1"][:2] == [
            at(*min(gap, key=lambda p: p[0])),
            at(*max(gap, key=lambda p: p[0])),
        ], key
    for phase in ("rollout", "train", "refit"):
        seconds = [m[f"{phase}_s"] for m in entries[:STEPS]]
        assert rows[phase][:2] == [f"{sum(seconds):.6g}", f"{sum(seconds) / STEPS:.6g}"]
    tokens = sum(m["generated_tokens"] for m in entries[:STEPS])
    rate = tokens / sum(m["rollout_s"] for m in entries[:STEPS])
    assert f"{tokens} tokens generated" in md and f"{rate:.6g} tokens/s" in md


def test_a_run_without_mismatch_metrics_gets_no_agreement_plot(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    gap = re.compile(r".+_agreement(/.+)?|adjacent_share|sparse_recorded_share|observed_.+")
    plain = tmp_path / "run"
    plain.mkdir()
    lines = [
        json.dumps({k: v for k, v in m.items() if not gap.fullmatch(k)}) for m in jsonl(run_dir)
    ]
    (plain / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (plain / "report").mkdir()
    (plain / "report" / "agreement.png").write_bytes(b"left by an earlier report")
    written = write_report(plain)
    names = ["reward.png", "gap.png", "update.png", "time.png", "report.md"]
    assert [p.name for p in written] == names
    assert not (plain / "report" / "agreement.png").exists()
    md = written[-1].read_text()
    assert "so there is no agreement plot" in md and "agreement.png" not in md
    assert "has no `config.toml`" in md


def test_tensorboard_scalars_are_the_metrics(run_dir):
    ea = event_accumulator()
    board = ea.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={ea.SCALARS: 0})
    board.Reload()
    entries = jsonl(run_dir)
    want: dict[str, dict[int, float]] = {}
    for m in entries:
        for key, value in m.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                want.setdefault(key, {})[m["step"]] = value
    assert set(board.Tags()["scalars"]) == set(want)
    assert {"code_agreement/layer1", "held_out_accuracy", "loss", "rollout_s"} <= set(want)
    for key, by_step in want.items():
        got = {e.step: e.value for e in board.Scalars(key)}
        # TensorBoard stores scalars as float32.
        assert got == {s: float(np.float32(v)) for s, v in by_step.items()}, key


def test_tensorboard_purge_step_replaces_the_steps_run_again(tmp_path):
    ea = event_accumulator()
    with TensorBoardLog(tmp_path) as board:
        for step in range(5):
            board.write({"step": step, "reward": float(step)})
    with TensorBoardLog(tmp_path, purge_step=2) as board:  # resumed at step 2
        for step in (2, 3):
            board.write({"step": step, "reward": 10.0 + step})
    events = ea.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [
        (0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="purge_step must be an int >= 0 or None, got -1"):
        TensorBoardLog(tmp_path, purge_step=-1)


def test_missing_extras_name_the_install_command(monkeypatch, run_dir, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install 'fp4rl[tensorboard]'")):
        TensorBoardLog(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    assert main(["report", str(run_dir), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp4rl report: error:") and "pip install 'fp4rl[report]'" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("resume", [False, True])
def test_train_without_tensorboard_stops_in_one_line_before_loading(
    monkeypatch, tmp_path, capsys, resume
):
    """run.tensorboard = true and no tensorboard package: exit status 2 and one line, before
    the task, the models or the run directory are touched (a model.path that does not exist
    would be the error otherwise)."""
    from fp4rl import checkpoints, loop

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setattr(loop, "load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    run = tmp_path / "run"
    overrides = [f"model.path={tmp_path / 'absent'}", f"run.out_dir={run}"]
    if resume:
        run.mkdir()
        config = run_config.load(demo.CONFIG_FILE, overrides)
        checkpoints.write_atomic(run / "config.toml", run_config.to_toml(config))
        argv = ["train", "--resume", str(run), "--set", "run.tensorboard=true"]
    else:
        argv = ["train", "--config", str(demo.CONFIG_FILE), "--set", "run.tensorboard=true"]
        argv += [word for o in overrides for word in ("--set", o)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp4rl train: error: run.tensorboard = true needs the tensorboard")
    assert err.count("\n") == 1 and "pip install 'fp4rl[tensorboard]'" in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == (["config.toml", "run"] if resume else [])


def test_run_tensorboard_must_be_a_bool():
    with pytest.raises(ValueError, match="run.tensorboard must be a bool, got 'yes'"):
        run_config.load(None, ["run.tensorboard=yes"])


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "has no metrics.jsonl"),
        ("", "holds no entries"),
        ('{"step": 0}\n{"step": 1\n', r"metrics.jsonl:2: not a JSON object"),
        ('{"step": 0}\n[1, 2]\n', r"metrics.jsonl:2: not a JSON object"),
        (
            '{"step": 0}\n{"reward": 1.0}\n',
            r"metrics.jsonl:2: 'step' must be an int >= 0, got None",
        ),
        ('{"step": 0}\n{"step": 1}\n{"step": 0}\n', r"metrics.jsonl:3: step 0 follows step 1"),
    ],
)
def test_cli_refuses_a_run_without_readable_metrics(tmp_path, capsys, content, message):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp4rl report: error:") and err.count("\n") == 1
    assert re.search(message, err), err
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        read_metrics(tmp_path)


def test_cli_writes_the_report_and_lists_it(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("tensorboard", "checkpoints"))
    assert main(["report", str(copy)]) == 0
    listed = capsys.readouterr().out.split()
    assert listed == [str(copy / "report" / name) for name in [*FIGURES, "report.md"]]


def test_agreement_of_compact_sparse_and_live_routing_runs_is_drawn_and_listed(tmp_path):
    """Keys the loop's own run above does not record (compact and sparse guidance, live
    routing) are plotted and summarized too; a key the report does not know is listed."""
    pytest.importorskip("matplotlib")
    entries = [
        {
            "step": s,
            "reward": 0.5,
            "block_scale_agreement": 1.0 - s / 100,
            "mantissa_agreement": 0.99,
            "sparse_bit_agreement": 0.98 + s / 1000,
            "sparse_recorded_share": 0.03,
            "router_agreement/layer10": 0.7,
            "router_agreement/layer2": 0.8,
            "new_metric": 7,
        }
        for s in range(3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in entries))
    written = write_report(tmp_path)
    assert [p.name for p in written] == ["reward.png", "agreement.png", "report.md"]
    md = written[-1].read_text()
    rows = tables(md)
    assert rows["block_scale_agreement"][:3] == [at(0.98, 2), at(1.0, 0), "0.98"]
    assert rows["sparse_bit_agreement"][:2] == [at(0.98, 0), at(0.982, 2)]
    keys = [k for k in rows if k.startswith("router_agreement")]
    assert keys == ["router_agreement/layer2", "router_agreement/layer10"]  # layers in order
    assert "Also recorded in `metrics.jsonl`: `new_metric`." in md
    assert "no final evaluation" in md


def configuration(config: run_config.RunConfig, tmp_path) -> dict[str, list[str]]:
    """The rows of the configuration table of a run directory holding ``config``."""
    (tmp_path / "config.toml").write_text(run_config.to_toml(config))
    md = summary(tmp_path, [{"step": 0, "reward": 0.5}], set())
    section = md[md.index("## Configuration") : md.index("## Reward")]
    return tables(section)


@pytest.mark.parametrize(
    "overrides, shown, hidden",
    [
        (
            [
                "engine.capture_routing=true",
                "engine.guidance=compact",
                "engine.compact_fraction=0.25",
                "grpo.correction=mask",
            ],
            {
                "engine.guidance": '`"compact"`',
                "engine.compact_fraction": "`0.25`",
                "grpo.mask_low": "`0.5`",
                "grpo.mask_high": "`2.0`",
                "align.replay": "unset: replay iff the engine records routing",
            },
            ("engine.sparse_delta", "grpo.tis_cap"),
        ),
        (
            [
                "engine.guidance=sparse",
                "engine.sparse_delta=0.05",
                "align.trainer_forward=packed_fp32",
                "align.replay=false",
                "align.rounding=nearest",
                "run.eval_precision=bf16",
                "run.micro_batch_seqs=16",
            ],
            {
                "engine.sparse_delta": "`0.05`",
                "align.trainer_forward": '`"packed_fp32"`',
                "align.replay": "`false`",
                "run.eval_precision": '`"bf16"`',
                "run.micro_batch_seqs": "`16`",
                "grpo.tis_cap": "`2.0`",
                "precision.guided_sites": "`["
                + ", ".join(json.dumps(s) for s in PrecisionConfig().guided_sites)
                + "]`",
            },
            ("engine.compact_fraction", "grpo.mask_low"),
        ),
        (
            ["grpo.correction=seq_tis", "grpo.tis_cap=3"],  # the sequence corrections too
            {"grpo.correction": '`"seq_tis"`', "grpo.tis_cap": "`3.0`"},
            ("grpo.mask_low", "grpo.mask_high"),
        ),
        (
            ["grpo.correction=seq_mask"],
            {"grpo.mask_low": "`0.5`", "grpo.mask_high": "`2.0`"},
            ("grpo.tis_cap", "grpo.geo_mask_low"),
        ),
        (
            ["grpo.correction=geo_mask", "grpo.geo_mask_high=1.05"],
            {"grpo.geo_mask_low": "`0.98`", "grpo.geo_mask_high": "`1.05`"},
            ("grpo.tis_cap", "grpo.mask_low"),
        ),
        (
            [],  # no guidance: the table says so rather than leaving the row out
            {"engine.guidance": "unset: no guidance recorded", "model.device": '`"auto"`'},
            ("engine.compact_fraction", "engine.sparse_delta"),
        ),
    ],
)
def test_the_configuration_table_shows_what_changes_the_numbers(tmp_path, overrides, shown, hidden):
    rows = configuration(run_config.load(None, overrides), tmp_path)
    for key, value in shown.items():
        assert rows[key] == [value], key
    for key in hidden:
        assert key not in rows, key


def test_every_precision_and_align_setting_is_in_the_configuration_table():
    """A setting added to ``[precision]`` or ``[align]`` changes the numbers a run computes:
    the report must show it."""
    for section, cls in (("precision", PrecisionConfig), ("align", AlignSection)):
        assert {f.name for f in dataclasses.fields(cls)} <= set(ESSENTIALS[section]), section
