"""Run configs: TOML tables onto the components' frozen sections, overrides, errors by name."""

import pytest

from fp4rl import config as run_config
from fp4rl.cli import main
from fp4rl.demo import CONFIG_FILE


def test_defaults_and_a_file_with_overrides(tmp_path):
    default = run_config.load()
    assert default.precision.experts == "nvfp4" and default.engine.guidance is None
    file = tmp_path / "run.toml"
    file.write_text(
        '[precision]\nkv_cache = "nvfp4"\nguided_sites = ["k", "v"]\n[run]\nsteps = 7\n'
    )
    c = run_config.load(
        file,
        ["run.steps=9", "optim.lr=1e-5", "engine.guidance=full", "engine.capture_routing=true"],
    )
    assert c.precision.kv_cache == "nvfp4" and c.precision.guided_sites == ("k", "v")
    assert (c.run.steps, c.optim.lr, c.engine.guidance) == (9, 1e-5, "full")


def test_resolved_config_round_trips_through_toml(tmp_path):
    c = run_config.load(CONFIG_FILE, ["model.path=/some/dir", "run.seed=3"])
    file = tmp_path / "config.toml"
    file.write_text(run_config.to_toml(c))
    assert run_config.load(file) == c


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["precison.experts=bf16"], r"\[precison\] is not a config section"),
        (["precision.expert=bf16"], r"precision.expert is not a setting; \[precision\] takes"),
        (["precision.experts=fp8"], r"precision.experts must be one of \('bf16', 'nvfp4'\)"),
        (["run.steps=0"], r"run.steps must be an int >= 1, got 0"),
        (["grpo.correction=clip"], r"grpo.correction must be one of"),
        (["engine.guidance=partial"], r"engine.guidance must be one of"),
        (["rollout.samples_per_prompt=1"], r"rollout.samples_per_prompt must be an int >= 2"),
        (["rollout.cdf_order=sorted"], r"rollout.cdf_order must be one of \('probability', "),
        (["steps=3"], r"--set takes section.key=value"),
        (["align.replay=true"], r"align.replay=true needs the rollout's routing record"),
        (["align.rounding=guided"], r"align.rounding='guided' needs the rollout's codes"),
        (
            ["engine.guidance=full", "align.replay=false", "engine.capture_routing=true"],
            r"align.rounding='guided' needs router replay",
        ),
        (
            [
                "engine.guidance=full",
                "engine.capture_routing=true",
                "align.trainer_activations=bf16",
            ],
            r"align.trainer_activations='bf16' has no FP4 activations to guide",
        ),
        (
            ["align.trainer_forward=engine"],
            r"align.trainer_forward='engine' follows prompts prefilled whole: set "
            r"engine.chunked_prefill=false",
        ),
    ],
)
def test_mistakes_name_the_key_and_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        run_config.load(None, overrides)


def test_cli_exits_2_with_a_one_line_cause(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nsteps = -1\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp4rl train: error: run.steps must be an int >= 1, got -1")
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err
    broken = tmp_path / "broken.toml"
    broken.write_text("[run\n")
    assert main(["train", "--config", str(broken)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["train"], ["demo"]])
def test_help_explains_every_option(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in {(): ["train", "demo"], ("train",): ["--config", "--set"]}.get(
        tuple(command), ["--seeds", "--steps", "--cache-dir", "--out-dir", "--set"]
    ):
        assert option in out


def test_align_follows_what_the_engine_records_unless_told_otherwise():
    recorded = ["engine.capture_routing=true", "engine.guidance=compact"]
    assert run_config.load(None, recorded).align.resolve(
        run_config.load(None, recorded).engine
    ) == (
        True,
        True,
    )
    nearest = run_config.load(None, [*recorded, "align.rounding=nearest"])
    assert nearest.align.resolve(nearest.engine) == (True, False)
    plain = run_config.load()
    assert plain.align.resolve(plain.engine) == (False, False)
