"""The engine's GPU path through `fp4rl.ops`, walked on the CPU.

`ops` hands a CUDA tensor's work to the kernels and a CPU tensor's to PyTorch, so the CPU suite
never runs the dispatch itself: which kernel a call reaches, with which arguments, after which
checks (a name moved between kernel modules once broke every NVFP4-KV engine on the GPU while
the CPU suite passed). Here the kernels package is handed out for CPU tensors too and Triton's
interpreter runs each kernel: a tiny packed model's prefill, then a decode, through paged BF16
and NVFP4 layers, launches every Triton kernel of the engine's forward (the Gluon register
kernels aside: they need a GPU, and refuse the CPU, so their Triton twins run) and gives the
logits of the PyTorch path."""

import collections

import pytest
import torch
from tiny_models import packed_twin, qat_model, tiny_config, tiny_precision

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from triton.runtime import interpreter  # noqa: E402

from fp4rl import kernels, ops  # noqa: E402
from fp4rl.rollout.attention import AttentionMetadata, PagedAttention, Segment  # noqa: E402
from fp4rl.rollout.kv_cache import KVCache  # noqa: E402
from fp4rl.rollout.model_layout import ModelLayout  # noqa: E402

# Not imported from this directory's conftest: which module `import conftest` finds depends on
# which conftest the run collected first (tests/rollout's, for one, in `pytest -n 2 tests/kernels
# tests/rollout/test_graphs_gpu.py`).
ON_GPU = torch.cuda.is_available()

# The kernels one prefill and one decode step launch, by (module, kernel).
FORWARD_KERNELS = {
    ("expert_sort", "_expert_sort_kernel"),
    ("moe_combine", "_moe_combine_kernel"),
    ("moe_gemm", "_moe_gemm_kernel"),
    ("nearest", "_quantize_kernel"),  # the K/V store into NVFP4 pages
    ("norm_quant", "_add_rms_norm_quantize_kernel"),
    ("norm_rope", "_norm_rope_kernel"),
    ("paged_attention", "_paged_decode_kernel"),
    ("paged_prefill", "_paged_prefill_kernel"),
    ("rms_norm", "_add_rms_norm_kernel"),
    ("rms_norm", "_rms_norm_kernel"),
    ("router", "_logits_kernel"),
    ("router", "_topk_kernel"),
    ("skinny_gemm", "_skinny_gemm_kernel"),
    ("swiglu", "_swiglu_kernel"),
}


def steps(model):
    """Logits of a 6-token prefill, then of one decode, over a fresh paged cache."""
    spec = ModelLayout.of(model).kv
    cache = KVCache(spec, num_blocks=8, block_size=4, device="cpu")
    logits = []
    with torch.inference_mode():
        for start, tokens in ((0, [3, 1, 4, 1, 5, 9]), (6, [2])):
            meta = AttentionMetadata.build([Segment([5, 2, 7], start, len(tokens))], 4, "cpu")
            h = model.hidden_states(torch.tensor(tokens), PagedAttention(cache, meta))
            logits.append(model.logits(h))
    return logits


@pytest.mark.skipif(ON_GPU, reason="the kernels are compiled for the GPU here, not interpreted")
def test_the_engines_gpu_dispatch_runs_every_forward_kernel_on_the_cpu(monkeypatch):
    precision = tiny_precision("nvfp4")  # layers 1 and 2 of 4: NVFP4 experts and KV
    qat = qat_model(precision, config=tiny_config(head_dim=32), dtype=torch.bfloat16)
    model = packed_twin(qat, precision)
    want = steps(model)

    launched = collections.Counter()
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launched[self.fn.__module__.removeprefix("fp4rl.kernels."), self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)
    monkeypatch.setattr(ops, "_kernels", lambda x: kernels)
    got = steps(model)
    assert set(launched) == FORWARD_KERNELS
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape
        # The kernels sum in their own orders: a few BF16 steps at most, not garbage.
        torch.testing.assert_close(g, w, rtol=0, atol=0.02 * float(w.abs().max()), msg=str(step))
