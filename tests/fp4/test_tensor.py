"""NVFP4Tensor's layout checks: a container that cannot describe a [..., K] tensor is refused."""

import pytest
import torch

from fp4rl.fp4.tensor import NVFP4Tensor


def parts(lead=(4, 3), k=32, scale_shape=None):
    codes = torch.zeros(*lead, k // 2, dtype=torch.uint8)
    block_scale = torch.zeros(*lead, k // 16, dtype=torch.float8_e4m3fn)
    global_scale = torch.ones(scale_shape if scale_shape is not None else (*lead[:-1], 1, 1))
    return codes, block_scale, global_scale


@pytest.mark.parametrize("scale_shape", [(1, 1, 1), (4, 1, 1), (4, 3, 1), (1, 3, 1)])
def test_every_broadcastable_global_scale_is_accepted(scale_shape):
    t = NVFP4Tensor(*parts(scale_shape=scale_shape))
    assert t.shape == (4, 3, 32)


@pytest.mark.parametrize("scale_shape", [(2, 1, 1), (4, 3, 2), (1, 5, 1)])
def test_a_global_scale_that_does_not_broadcast_is_refused(scale_shape):
    with pytest.raises(ValueError, match=r"global_scale \(.*\) does not broadcast to \(4, 3, 1\)"):
        NVFP4Tensor(*parts(scale_shape=scale_shape))


def test_wrong_rank_dtype_and_block_count_are_refused():
    codes, block_scale, global_scale = parts()
    with pytest.raises(ValueError, match="one entry per dim"):
        NVFP4Tensor(codes, block_scale, global_scale.view(4, 1))
    with pytest.raises(TypeError, match="global_scale must be float32"):
        NVFP4Tensor(codes, block_scale, global_scale.double())
    with pytest.raises(ValueError, match="do not describe"):
        NVFP4Tensor(codes, block_scale[..., :1], global_scale)
