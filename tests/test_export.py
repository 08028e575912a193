"""`fp4rl export` against the engine it serves the weights of.

The NVFP4 export is held to the rollout engine's packed experts bit for bit (codes, block
scales) and to the format's global-scale convention bit for bit (the FP32 reciprocal). Reading
it back is held to what each reader's arithmetic can give: a reader written here from the
format's description (value = e2m1 * weight_scale / weight_global_scale) to one FP32 ulp of the
engine's weights, and bit for bit where the FP32 reciprocal of the stored scale gives back the
engine's scale; compressed-tensors' own decompressor to one BF16 ulp. The BF16 export is held to
the trainer's weights bit for bit through transformers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from assertions import assert_bitwise
from safetensors import safe_open
from tiny_models import engine_config, qat_model, tiny_config, tiny_precision

from fp4rl.cli import main
from fp4rl.config import load, to_toml
from fp4rl.export import export
from fp4rl.model.checkpoint import save_checkpoint, writer
from fp4rl.model.config import ModelConfig
from fp4rl.model.experts import PackedExperts
from fp4rl.ops import dequantize
from fp4rl.rollout import Engine

# The tiny model's precision: layer 0 dense, 1-2 NVFP4 experts, 3 a BF16 boundary MoE layer.
PRECISION = ["precision.bf16_first_layers=1", "precision.bf16_last_layers=1"]
ZERO_EXPERT = 3  # of layer 1: all of its W1 and W3 are zero, so its W1+W3 group scale is 0
# The amax of layer 2's expert 0 W2 (the other weights are ~N(0, 0.1)): its global scale
# 1.0234375 / 2688 is the FP32 reciprocal of no FP32 value, so no stored scale gives it back.
NO_INVERSE_AMAX = 1.0234375
GENERATION_CONFIG = b'{"eos_token_id": 7}\n'


def save_policy(path: Path, seed: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """A trainer's policy saved as a checkpoint (with a generation config); its state dict."""
    model = qat_model(tiny_precision(), seed=seed, dtype=dtype)
    state = model.state_dict()
    state["layers.1.mlp.experts.w13"][ZERO_EXPERT] = 0
    state["layers.2.mlp.experts.w2"][0, 0, 0] = NO_INVERSE_AMAX
    save_checkpoint(state, model.config, path)
    (path / "generation_config.json").write_bytes(GENERATION_CONFIG)
    return state


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            found.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return found


def engine_experts(checkpoint: Path, dtype=torch.bfloat16) -> dict[int, PackedExperts]:
    """The rollout engine's packed experts for ``checkpoint``, by layer."""
    precision = load(None, PRECISION).precision
    engine = Engine.from_pretrained(checkpoint, engine_config(), precision=precision, dtype=dtype)
    return {m.layer: m for m in engine.model.modules() if isinstance(m, PackedExperts)}


def projections(experts: PackedExperts):
    """``(hub module name, packed weight, expert, rows)`` of every projection of a layer."""
    I = experts.intermediate  # noqa: E741
    for j in range(experts.num_experts):
        prefix = f"model.layers.{experts.layer}.mlp.experts.{j}."
        yield prefix + "gate_proj", experts.w13_packed, j, slice(0, I)
        yield prefix + "up_proj", experts.w13_packed, j, slice(I, 2 * I)
        yield prefix + "down_proj", experts.w2_packed, j, slice(None)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``(out, tensors, config_json, engine experts by layer)`` of one NVFP4 export."""
    root = tmp_path_factory.mktemp("export")
    save_policy(root / "policy", seed=3)
    result = export(root / "policy", root / "out", overrides=PRECISION)
    assert result.fp4_layers == (1, 2)
    config_json = json.loads((root / "out" / "config.json").read_text())
    return root / "out", read_tensors(root / "out"), config_json, engine_experts(root / "policy")


# ---- the engine's bytes, the format's convention --------------------------------------------


def test_packed_experts_are_the_engines_bytes(exported):
    _, tensors, _, engine = exported
    assert sorted(engine) == [1, 2]
    packed_names = set()
    for experts in engine.values():
        for module, w, j, rows in projections(experts):
            assert_bitwise(tensors[module + ".weight_packed"], w.codes[j, rows], module)
            assert_bitwise(tensors[module + ".weight_scale"], w.block_scale[j, rows], module)
            packed_names |= {module + s for s in (".weight_packed", ".weight_scale")}
            packed_names.add(module + ".weight_global_scale")
    # Nothing else is quantized, and no FP4 expert is also stored in BF16.
    assert {n for n in tensors if not n.endswith((".weight", ".bias"))} == packed_names
    assert not any(re.search(r"layers\.[12]\.mlp\.experts\.\d+\..*\.weight$", n) for n in tensors)
    assert all(tensors[n].dtype == torch.bfloat16 for n in tensors if n.endswith(".weight"))


def test_global_scales_are_the_fp32_reciprocal_the_format_divides_by(exported):
    _, tensors, _, engine = exported
    for experts in engine.values():
        for module, w, j, _ in projections(experts):
            stored, s = tensors[module + ".weight_global_scale"], w.global_scale[j].reshape(1)
            assert stored.dtype == torch.float32 and stored.shape == (1,)
            if experts.layer == 1 and j == ZERO_EXPERT and "down" not in module:
                # A group that quantized to zero: zero codes and block scales; its scale is 1
                # (any scale decodes it to zero; the reciprocal of 0 would be infinite).
                assert s.item() == 0 and stored.item() == 1.0
                assert not tensors[module + ".weight_scale"].float().any()
                continue
            assert_bitwise(stored, 1.0 / s, module)
        for j in range(experts.num_experts):  # W1 and W3 share one scale per expert
            prefix = f"model.layers.{experts.layer}.mlp.experts.{j}."
            assert_bitwise(
                tensors[prefix + "gate_proj.weight_global_scale"],
                tensors[prefix + "up_proj.weight_global_scale"],
                prefix,
            )


# ---- reading it back -------------------------------------------------------------------------

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def read_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor):
    """A reader written from the format's description alone: two 4-bit codes per byte, the
    first element in the low nibble; a code is sign | 3-bit index into E2M1; every 16 values
    along a row share one E4M3 scale; value = e2m1 * weight_scale / weight_global_scale.
    Returns ``(e2m1 * weight_scale [exact, FP32], value [float64])``."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[nibbles & 0x7]
    e2m1 = torch.where(nibbles & 0x8 != 0, -magnitude, magnitude)
    per_value = scale.to(torch.float64).repeat_interleave(16, dim=-1)
    unscaled = e2m1 * per_value  # exact: 2 x 4 significant bits
    return unscaled.float(), unscaled / global_scale.to(torch.float64)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their dtype lie between ``a`` and ``b`` (same sign)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    assert torch.equal(torch.signbit(a), torch.signbit(b))
    return (a.view(ints).int() - b.view(ints).int()).abs()


def test_a_reader_from_the_format_description_gets_the_engines_weights(exported):
    _, tensors, _, engine = exported
    exact_groups = off_by_one_groups = 0
    for experts in engine.values():
        engine_fp32 = [
            dequantize(w, torch.float32) for w in (experts.w13_packed, experts.w2_packed)
        ]
        engine_bf16 = experts.dequantized()  # what the engine's GEMMs multiply by
        for module, w, j, rows in projections(experts):
            which = 0 if w is experts.w13_packed else 1
            want32, want16 = engine_fp32[which][j, rows], engine_bf16[which][j, rows]
            unscaled, value = read_nvfp4(
                *(tensors[f"{module}.{n}"] for n in ("weight_packed", "weight_scale")),
                tensors[module + ".weight_global_scale"],
            )
            # The codes and block scales alone: the engine's values before its global scale.
            s = w.global_scale[j].reshape(1)
            assert_bitwise(unscaled * s, want32, module)
            # The description's division by the stored reciprocal rounds once more than the
            # engine's product: within one FP32 ulp of the engine's weights, never further.
            assert ulps_apart(value.float(), want32).max() <= 1, module
            # A reader that multiplies by the FP32 reciprocal of the stored scale (as vLLM's
            # loaders do) gets the engine's scale back when that reciprocal round-trips, and
            # then the engine's weights bit for bit, in FP32 and in the engine's BF16.
            s_back = 1.0 / tensors[module + ".weight_global_scale"]
            if torch.equal(s_back, s) or not s.item():  # (a zero group decodes to zero)
                mine = unscaled * s_back
                assert_bitwise(mine, want32, module)
                assert_bitwise(mine.bfloat16(), want16, module)
                exact_groups += 1
            else:
                assert ulps_apart(s_back, s).item() == 1, module
                off_by_one_groups += 1
    # FP32 division has no exact inverse for every scale: 17 % of FP32 values are the FP32
    # reciprocal of no FP32 value. Both cases occur here (NO_INVERSE_AMAX makes sure of one).
    assert exact_groups > 0 and off_by_one_groups > 0, (exact_groups, off_by_one_groups)


def test_compressed_tensors_reads_the_export(exported):
    ct = pytest.importorskip("compressed_tensors", minversion="0.20")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    _, tensors, config_json, engine = exported
    config = QuantizationConfig.model_validate(config_json["quantization_config"])
    assert config.format == ct.CompressionFormat.nvfp4_pack_quantized.value
    (scheme,) = config.config_groups.values()
    preset = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    assert scheme.input_activations is None and scheme.output_activations is None  # A16
    for key in ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic"):
        assert getattr(scheme.weights, key) == getattr(preset.weights, key), key
    differ = total = 0
    for experts in engine.values():
        engine_bf16 = experts.dequantized()
        for module, w, j, rows in projections(experts):
            stored = {n: tensors[f"{module}.{n}"] for n in ("weight_packed", "weight_scale")}
            stored["weight_global_scale"] = tensors[module + ".weight_global_scale"]
            got = NVFP4PackedCompressor.decompress(stored, scheme)["weight"]
            want = engine_bf16[0 if w is experts.w13_packed else 1][j, rows]
            # Its arithmetic rounds weight_scale / weight_global_scale to FP32 before the E2M1
            # factor (the engine multiplies the exact e2m1 * weight_scale by its scale), then
            # casts to BF16: one BF16 ulp apart at most (0.3 % of the values here).
            apart = ulps_apart(got.bfloat16(), want)
            assert apart.max() <= 1, module
            differ, total = differ + int(apart.sum()), total + want.numel()
    assert differ < total / 100, (differ, total)


# ---- what config.json declares ----------------------------------------------------------------


def test_quantization_config_lists_everything_left_bf16(exported):
    out, tensors, config_json, _ = exported
    q = config_json["quantization_config"]
    assert (q["quant_method"], q["format"], q["quantization_status"]) == (
        "compressed-tensors",
        "nvfp4-pack-quantized",
        "compressed",
    )
    (group,) = q["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    assert q["kv_cache_scheme"] is None
    bf16_modules = {n.rpartition(".")[0] for n in tensors if n.endswith((".weight", ".bias"))}
    fp4_modules = {n.rpartition(".")[0] for n in tensors if n.endswith(".weight_packed")}
    assert set(q["ignore"]) == bf16_modules | {"lm_head"}
    assert len(q["ignore"]) == len(set(q["ignore"])) and not fp4_modules & set(q["ignore"])
    for kind in (
        "model.embed_tokens",
        "model.norm",
        "lm_head",
        "model.layers.1.input_layernorm",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.gate",  # the router
        "model.layers.0.mlp.down_proj",  # the dense layer
        "model.layers.3.mlp.experts.5.up_proj",  # a routed expert of a BF16 boundary layer
    ):
        assert kind in q["ignore"], kind
    assert "model.layers.2.mlp.experts.5.up_proj" in fp4_modules
    # The rest of config.json is the model's; fp4rl's own loader refuses a quantized checkpoint.
    assert {k: v for k, v in config_json.items() if k != "quantization_config"} == (
        tiny_config().to_hf_dict()
    )
    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_pretrained_dir(out)
    assert (out / "generation_config.json").read_bytes() == GENERATION_CONFIG


def test_qwen2_moe_shared_experts_and_biases_stay_bf16(tmp_path):
    config = tiny_config(
        architecture="qwen2_moe", qk_norm=False, attention_bias=True,
        shared_expert_intermediate_size=48,
    )  # fmt: skip
    model = qat_model(tiny_precision(), config=config, dtype=torch.bfloat16)
    save_checkpoint(model.state_dict(), config, tmp_path / "policy")
    export(tmp_path / "policy", tmp_path / "out", overrides=PRECISION)
    tensors = read_tensors(tmp_path / "out")
    ignore = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"][
        "ignore"
    ]
    for module in ("shared_expert.gate_proj", "shared_expert.down_proj", "shared_expert_gate"):
        assert f"model.layers.1.mlp.{module}" in ignore, module
        assert tensors[f"model.layers.1.mlp.{module}.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.self_attn.q_proj.bias"].dtype == torch.bfloat16
    assert ignore.count("model.layers.1.self_attn.q_proj") == 1
    for experts in engine_experts(tmp_path / "policy").values():
        for module, w, j, rows in projections(experts):
            assert_bitwise(tensors[module + ".weight_packed"], w.codes[j, rows], module)


# ---- the BF16 export, run directories, the command ----------------------------------------


def test_bf16_export_loads_in_transformers_as_the_trainers_weights(tmp_path):
    transformers = pytest.importorskip("transformers", minversion="5.0")
    state = save_policy(tmp_path / "policy", seed=5)
    export(tmp_path / "policy", tmp_path / "out", format="bf16")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.dtype == torch.bfloat16
    for name, tensor in state.items():
        hf = (
            name.replace("mlp.router.", "mlp.gate.")
            .replace("experts.w13", "experts.gate_up_proj")
            .replace("experts.w2", "experts.down_proj")
        )
        assert_bitwise(
            model.get_parameter(hf if name == "lm_head.weight" else "model." + hf), tensor, name
        )


def test_a_run_directory_exports_its_latest_complete_checkpoint_with_its_settings(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    # The run's engine holds FP32 weights (as the demo's does): its experts are quantized from
    # FP32 values, and so are the export's.
    (run / "config.toml").write_text(to_toml(load(None, [*PRECISION, "model.dtype=float32"])))
    for step, seed in ((1, 11), (2, 12)):
        save_policy(run / "checkpoints" / f"step-{step:08d}" / "model", seed, torch.float32)
    # A checkpoint still being written (or left by a killed save) has another name.
    save_policy(run / "checkpoints" / ".step-00000003.partial-h-1-2-0123456789ab" / "model", 13)
    result = export(run, tmp_path / "out")
    latest = run / "checkpoints" / "step-00000002" / "model"
    assert result.checkpoint == latest and result.fp4_layers == (1, 2)
    tensors = read_tensors(tmp_path / "out")
    for experts in engine_experts(latest, torch.float32).values():
        for module, w, j, rows in projections(experts):
            assert_bitwise(tensors[module + ".weight_packed"], w.codes[j, rows], module)
            assert_bitwise(tensors[module + ".weight_scale"], w.block_scale[j, rows], module)


def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    save_policy(tmp_path / "policy", seed=3)
    write, written = writer._write_safetensors, []

    def write_one_then_fail(file, tensors):
        if written:
            raise OSError("disk full")
        written.append(file)
        write(file, tensors)

    monkeypatch.setattr(writer, "_write_safetensors", write_one_then_fail)
    with pytest.raises(OSError, match="disk full"):
        export(tmp_path / "policy", tmp_path / "out", overrides=PRECISION, max_shard_bytes=40_000)
    assert written and sorted(p.name for p in tmp_path.iterdir()) == ["policy"]


def test_the_command_writes_and_refuses_with_a_one_line_cause(tmp_path, capsys):
    save_policy(tmp_path / "policy", seed=3)
    policy, out = str(tmp_path / "policy"), str(tmp_path / "out")
    assert (
        main(
            [
                "export",
                policy,
                "--format",
                "nvfp4",
                out,
                *sum((["--set", s] for s in PRECISION), []),
            ]
        )
        == 0
    )
    assert "routed experts of layers [1, 2] NVFP4" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    cases = {
        "exists and is not an empty directory": [policy, out],
        "--format must be one of ('nvfp4', 'bf16'), got 'int4'": [
            policy,
            str(tmp_path / "o2"),
            "--format",
            "int4",
        ],
        "is neither a checkpoint directory": [str(tmp_path / "empty"), str(tmp_path / "o3")],
        "is not a directory": [str(tmp_path / "missing"), str(tmp_path / "o4")],
        "export takes precision.KEY=VALUE": [policy, str(tmp_path / "o5"), "--set", "run.steps=3"],
        # The defaults keep 2 + 4 boundary layers BF16: none of this 4-layer model is left.
        "leaves no FP4 layer": [policy, str(tmp_path / "o6")],
    }
    for cause, args in cases.items():
        assert main(["export", *args]) == 2, cause
        err = capsys.readouterr().err
        assert err.startswith("fp4rl export: error: ") and cause in err, err
        assert err.count("\n") == 1, err
    assert not any((tmp_path / f"o{k}").exists() for k in range(2, 7))


def test_help_names_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("RUN_DIR|CHECKPOINT", "OUT", "--format", "--set", "--device", "nvfp4", "bf16"):
        assert option in out, option


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantizing_on_the_gpu_writes_the_same_files(tmp_path):
    # On CUDA the engine's quantize call runs the Triton kernels, bitwise twins of the
    # reference: the export's files are the same, byte for byte.
    save_policy(tmp_path / "policy", seed=3)
    for device in ("cpu", "cuda"):
        export(tmp_path / "policy", tmp_path / device, overrides=PRECISION, device=device)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (tmp_path / "cpu" / name).read_bytes() == (tmp_path / "cuda" / name).read_bytes()
