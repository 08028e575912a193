"""Where the model asks `fp4rl.ops` for the engine's decode-glue kernels (the q/k/v and o
projections, the q/k norm + RoPE, the router, the residual add + RMSNorm): each kernel answers
None here, as off the GPU, so the eager formulations run and only the asking is counted."""

import pytest
import torch
from tiny_models import qat_model

from fp4rl import ops
from fp4rl.model.attention import CausalAttention
from fp4rl.model.precision import PrecisionConfig


@pytest.fixture
def glue_calls(monkeypatch):
    """Records which of the decode-glue kernels `fp4rl.ops` is asked for (each answers None, as
    off the GPU, so the eager formulation runs): name -> number of calls."""
    calls = {"project": 0, "norm_rope": 0, "route": 0, "add_rms_norm": 0}

    def asked(name):
        def record(*args, **kwargs):
            calls[name] += 1
            return None

        return record

    for name in calls:
        monkeypatch.setattr(ops, name, asked(name))
    return calls


def test_decode_glue_kernels_are_asked_for_where_they_belong(glue_calls):
    """In inference mode (the engine's steps) each layer asks for a q/k/v and an o projection
    launch and two q/k norm + RoPE launches, and each MoE layer for the router kernels; the residual
    adds are asked for inside the norms after them: two per layer, the first layer's input
    norm having none before it and the final norm one. Without autograd but outside inference
    mode (the trainer's observation) only the norm + RoPE and add + norm kernels, which have
    the bits of the kernels they replace; under autograd none; under replayed routing not the
    router's."""
    model = qat_model(PrecisionConfig(experts="bf16"), dtype=torch.bfloat16)
    tokens, L = torch.tensor([1, 2, 3, 4, 5, 6]), len(model.layers)
    moe = len(model.moe_layers)
    assert moe > 0
    with torch.inference_mode():
        model.hidden_states(tokens, CausalAttention([4, 2]))
    assert glue_calls == {"project": 2 * L, "norm_rope": 2 * L, "route": moe, "add_rms_norm": 2 * L}
    with torch.no_grad():
        model.hidden_states(tokens, CausalAttention([4, 2]))
    assert glue_calls == {"project": 2 * L, "norm_rope": 4 * L, "route": moe, "add_rms_norm": 4 * L}
    model.hidden_states(tokens, CausalAttention([4, 2]))  # parameters want gradients
    assert glue_calls == {"project": 2 * L, "norm_rope": 4 * L, "route": moe, "add_rms_norm": 4 * L}
    routing = torch.zeros(moe, 6, model.config.num_experts_per_tok, dtype=torch.int32)
    with torch.inference_mode():
        model.hidden_states(tokens, CausalAttention([4, 2]), routing=routing)
    assert glue_calls == {"project": 4 * L, "norm_rope": 6 * L, "route": moe, "add_rms_norm": 6 * L}
