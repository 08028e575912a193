"""The q/k norm + RoPE kernel against the two kernels it replaces (RMSNorm, then RoPE), bit for
bit, and the attention layer's forward with and without it."""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import DTYPES, assert_same_values  # noqa: E402

from fp4rl import ops  # noqa: E402
from fp4rl.kernels import norm_rope, rms_norm, rope  # noqa: E402
from fp4rl.model.layers import RopeTables  # noqa: E402

EPS = 1e-6


def case(T, H, D, dtype, seed, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, D, generator=g) * scale).to(dtype)
    weight = (1 + torch.randn(D, generator=g) / 4).to(dtype)
    tables = RopeTables(torch.randint(0, 40000, (T,), generator=g), D, 1_000_000.0, dtype)
    return x, weight, tables.cos, tables.signed_sin


def check(x, weight, cos, sin, device, what):
    x, weight, cos, sin = (t.to(device) for t in (x, weight, cos, sin))
    got = norm_rope.launch(x, weight, EPS, cos, sin)
    want = rope.launch(rms_norm.launch(x, weight, EPS), cos, sin).cpu()
    assert_same_values(got, want, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 3, 16), (1, 1, 2), (3, 9, 64), (2, 4, 128), (0, 4, 8)])
def test_the_two_kernels_bits(device, dtype, shape):
    check(*case(*shape, dtype, seed=sum(shape)), device, f"{dtype} {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_rows(device, dtype):
    """A zero row, an infinity, a NaN, signed zeros and a zero table entry, as the two do."""
    x, weight, cos, sin = case(4, 2, 8, dtype, seed=3)
    x[0, 0] = 0.0
    x[0, 1, 2] = float("inf")
    x[1, 0, 5] = float("nan")
    x[1, 1, :4] = -0.0
    cos[2] = 0.0
    sin[3, :4] = -0.0
    check(x, weight, cos, sin, device, str(dtype))


def test_checks_name_the_values(device):
    x, weight, cos, sin = (t.to(device) for t in case(2, 2, 8, torch.float32, seed=1))
    with pytest.raises(ValueError, match=r"weight torch.bfloat16 of shape \(8,\)"):
        norm_rope.launch(x, weight.to(torch.bfloat16), EPS, cos, sin)
    with pytest.raises(ValueError, match=r"weight torch.float32 of shape \(4,\)"):
        norm_rope.launch(x, weight[:4].contiguous(), EPS, cos, sin)
    with pytest.raises(ValueError, match=r"cos_TD must be torch.float32 of shape \(2, 8\); got"):
        norm_rope.launch(x, weight, EPS, cos[:1].contiguous(), sin)
    with pytest.raises(ValueError, match="x_THD must be contiguous"):
        norm_rope.launch(x.transpose(0, 1), weight, EPS, cos, sin)


def test_ops_leaves_the_cpu_to_the_caller():
    x, weight, cos, sin = case(2, 2, 8, torch.float32, seed=2)
    assert ops.norm_rope(x, weight, EPS, cos, sin) is None


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 256, 2048])
@pytest.mark.parametrize("H", [32, 4])
def test_real_shapes_on_gpu(T, H):
    """Qwen3-30B-A3B's q (32 heads) and k (4 heads) rows of 128."""
    check(*case(T, H, 128, torch.bfloat16, seed=T + H), "cuda", f"T={T} H={H}")


@pytest.mark.gpu
def test_attention_forward_is_unchanged_on_gpu(monkeypatch):
    """A Qwen3 attention layer's output with the fused kernel equals its output through the
    RMSNorm and RoPE kernels, bit for bit (no gradient: the engine's path)."""
    from fp4rl.model.attention import Attention, CausalAttention
    from fp4rl.model.presets import qwen3_30b_a3b

    config = qwen3_30b_a3b(num_hidden_layers=1)
    torch.manual_seed(0)
    layer = Attention(config, 0).to(torch.bfloat16).cuda()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(48, config.hidden_size, device="cuda").to(torch.bfloat16)
    backend = CausalAttention([20, 28], device="cuda")
    tables = RopeTables(backend.positions, config.head_dim, config.rope_theta, torch.bfloat16)
    calls = []
    fused = ops.norm_rope

    def counted(*args):
        calls.append(1)
        return fused(*args)

    monkeypatch.setattr(ops, "norm_rope", counted)
    with torch.no_grad():
        got = layer(x, backend, tables)
    assert len(calls) == 2, "the fused kernel did not run for q and k"
    monkeypatch.setattr(ops, "norm_rope", lambda *args: None)
    with torch.no_grad():
        want = layer(x, backend, tables)
    assert_same_values(got, want.cpu(), "attention output")
