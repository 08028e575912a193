"""The RoPE kernel against the eager formulation (`fp4rl.model.layers.apply_rope` run on the
CPU), bit for bit: the same roundings in the same places."""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from kernel_checks import DTYPES, assert_same_values  # noqa: E402

from fp4rl.kernels import rope  # noqa: E402
from fp4rl.model.layers import RopeTables, apply_rope  # noqa: E402


def case(T, H, D, dtype, seed, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, D, generator=g) * scale).to(dtype)
    positions = torch.randint(0, 40000, (T,), generator=g)
    tables = RopeTables(positions, D, 1_000_000.0, dtype)
    return x, tables.cos, tables.signed_sin


def eager(x, cos, signed_sin):
    """`apply_rope` on the CPU, where it is always the eager formulation."""
    return apply_rope(x.cpu(), cos.cpu(), signed_sin.cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 3, 16), (1, 1, 2), (3, 9, 64), (2, 32, 128), (0, 4, 8)])
def test_kernel_equals_eager(device, dtype, shape):
    x, cos, sin = case(*shape, dtype, seed=sum(shape))
    got = rope.launch(x.to(device), cos.to(device), sin.to(device))
    assert_same_values(got, eager(x, cos, sin), f"{dtype} {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(device, dtype):
    """Signed zeros, infinities (inf * 0 from a zero table entry is NaN) and NaN as eager."""
    x, cos, sin = case(4, 2, 8, dtype, seed=0)
    x[0, 0] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1, -1, 0])
    x[1, 1] = -0.0
    cos[2] = 0.0
    sin[3, :4] = -0.0
    got = rope.launch(x.to(device), cos.to(device), sin.to(device))
    assert_same_values(got, eager(x, cos, sin), str(dtype))


def test_checks_name_the_values(device):
    x, cos, sin = case(2, 2, 8, torch.float32, seed=1)
    x, cos, sin = x.to(device), cos.to(device), sin.to(device)
    with pytest.raises(
        ValueError, match=r"D a power of two; got torch.float32 of shape \(2, 2, 6\)"
    ):
        rope.launch(x[..., :6].contiguous(), cos[:, :6].contiguous(), sin[:, :6].contiguous())
    with pytest.raises(ValueError, match=r"cos_TD must be torch.float32 of shape \(2, 8\); got"):
        rope.launch(x, cos[:1].contiguous(), sin)
    with pytest.raises(ValueError, match="signed_sin_TD must be torch.float32"):
        rope.launch(x, cos, sin.to(torch.bfloat16))
    with pytest.raises(ValueError, match="x_THD must be contiguous"):
        rope.launch(x.transpose(0, 1), cos, sin)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 32, 128), (64, 4, 128), (256, 32, 128), (4096, 32, 128)])
def test_real_shapes_on_gpu(shape):
    x, cos, sin = case(*shape, torch.bfloat16, seed=shape[0])
    got = rope.launch(x.cuda(), cos.cuda(), sin.cuda())
    assert_same_values(got, eager(x, cos, sin), str(shape))
    # The model's entry point takes the kernel on the GPU and gives the eager bits.
    with torch.no_grad():
        assert_same_values(apply_rope(x.cuda(), cos.cuda(), sin.cuda()), eager(x, cos, sin), "op")
