"""What every refit test checks an engine against, shared by the in-process tests and the
two-process worker (`refit_dist_worker.py`).

The tiny model of `tiny_models` in FP32 on the CPU (the GPU tests ask for BF16) with layers 1-2
FP4 (packed experts, NVFP4 KV), layer 3 MoE with BF16 experts and layer 0 dense: a refit meets
every kind of weight.
"""

from __future__ import annotations

import torch
from assertions import assert_bitwise, assert_nvfp4_equal
from tiny_models import packed_twin, qat_model, tiny_precision

from fp4rl.fp4 import reference
from fp4rl.model.experts import PackedExperts
from fp4rl.rollout import Engine, EngineConfig, SamplingParams

PRECISION = tiny_precision("nvfp4", "nvfp4")
ENGINE = EngineConfig(
    block_size=4, kv_memory_bytes=1 << 20, max_model_len=32, max_num_seqs=8,
    max_num_batched_tokens=64,
)  # fmt: skip
GREEDY = SamplingParams(n=1, max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [77, 5]]


def trainer(seed: int, **where):
    """The trainer's model (QAT experts; FP32 on the CPU unless ``dtype``, ``device`` say
    otherwise) with weights drawn from ``seed``."""
    return qat_model(PRECISION, seed=seed, **where)


def engine(seed: int, **where) -> Engine:
    """An engine built fresh (weights loaded by `load_weights`) from ``trainer(seed)``."""
    return Engine(packed_twin(trainer(seed, **where), PRECISION), ENGINE)


def storage(model) -> dict[str, int]:
    """Address of every tensor the engine's model holds, packed codes and scales included."""
    ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
    for name, m in model.named_modules():
        if isinstance(m, PackedExperts):
            for leaf in ("w13", "w2"):
                members = getattr(m, f"{leaf}_packed").tensors()
                for part, t in zip(("codes", "block_scale", "global_scale"), members, strict=True):
                    ptrs[f"{name}.{leaf}.{part}"] = t.data_ptr()
    return ptrs


def assert_engine_holds(engine: Engine, trainer) -> None:
    """The engine holds ``trainer``'s weights: BF16 modules bitwise; packed experts' codes and
    scales bitwise equal to the `fp4rl.fp4` reference quantization (``scaling=2``, on the CPU)
    of the trainer's values, whatever quantized them in the engine (the Triton kernels on the
    GPU), and the weights its GEMMs see bitwise equal to those of the trainer's QAT forward."""
    theirs = dict(trainer.named_modules())
    params = dict(trainer.named_parameters())
    for name, p in engine.model.named_parameters():
        assert_bitwise(p.detach(), params[name].detach().cpu(), name)
    for name, m in engine.model.named_modules():
        if not isinstance(m, PackedExperts):
            continue
        qat = theirs[name]
        for leaf in ("w13", "w2"):
            want = reference.quantize(getattr(qat, leaf).detach().cpu(), scaling=2)
            assert_nvfp4_equal(getattr(m, f"{leaf}_packed"), want, f"{name}.{leaf}")
        with torch.no_grad():
            for leaf, got, want in zip(("w13", "w2"), m.dequantized(), qat.weights(), strict=True):
                assert_bitwise(got, want.cpu(), f"{name}.{leaf} as the GEMM sees it")


def greedy(engine: Engine) -> list[tuple[tuple[int, ...], torch.Tensor, int]]:
    return [
        (c.completion_ids, c.logprobs, c.policy_version) for c in engine.generate(PROMPTS, GREEDY)
    ]


def assert_generates_like(engine: Engine, fresh: Engine, *, atol: float = 0.0) -> None:
    """Greedy completions equal those of an engine built fresh, and their logprobs bitwise
    (within ``atol`` if given: a GPU GEMM whose reduction order is not fixed)."""
    for (ids, logprobs, version), (want_ids, want_logprobs, _) in zip(
        greedy(engine), greedy(fresh), strict=True
    ):
        assert ids == want_ids
        if atol:
            torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=atol)
        else:
            assert_bitwise(logprobs, want_logprobs, "logprobs")
        assert version == engine.policy_version
