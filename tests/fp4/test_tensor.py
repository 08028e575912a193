"""NVFP4Tensor's and NVFP4Rows' layout checks (a container that cannot describe a [..., K]
tensor is refused), rows kept with their amax giving back quantize's tensor, and the records
through pickle."""

import copy
import dataclasses
import io
import math
import pickle

import pytest
import torch

from fp4rl import ops
from fp4rl.fp4 import reference
from fp4rl.fp4.tensor import NVFP4Rows, NVFP4Tensor


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


def test_rows_hold_one_amax_per_row_in_a_float_dtype():
    codes, block_scale, _ = parts()
    rows = NVFP4Rows(codes, block_scale, torch.zeros(4, 3, 1, dtype=torch.bfloat16))
    assert rows.shape == (4, 3, 32) and rows.map(lambda m: m[1:]).shape == (3, 3, 32)
    with pytest.raises(ValueError, match=r"amax \(4, 1, 1\) must hold one value per row of codes "
                                         r"\(4, 3, 16\): \(4, 3, 1\)"):  # fmt: skip
        NVFP4Rows(codes, block_scale, torch.zeros(4, 1, 1))
    with pytest.raises(TypeError, match="amax must be one of"):
        NVFP4Rows(codes, block_scale, torch.zeros(4, 3, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not describe"):
        NVFP4Rows(codes, block_scale[..., :1], torch.zeros(4, 3, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rows_give_back_the_tensor_that_quantize_makes(dtype):
    """Rows kept with their amax (`quantize_into`) give back `quantize`'s global scales bit for
    bit, the flushed, the smallest kept, the largest and the poisoned (inf, NaN) ones among
    them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 2, 32, generator=g)
    x[0, 0] *= 2.0**-140  # flushed to a global scale of 0 (subnormal in FP32)
    x[0, 1] = 0.0
    x[1, 0, 5] = 2688 * 2.0**-117  # the smallest global scale kept, if the row is below it
    x[1, 0] *= x[1, 0].abs() <= x[1, 0, 5]
    x[2, 0, 3] = 60000.0
    x[3, 0, 7], x[3, 1, 9] = math.inf, math.nan
    x = x.to(dtype)
    pages = NVFP4Rows(
        torch.zeros(4, 4, 2, 16, dtype=torch.uint8),
        torch.zeros(4, 4, 2, 2, dtype=torch.float8_e4m3fn),
        torch.zeros(4, 4, 2, 1, dtype=dtype),
    )
    slots = torch.randperm(16, generator=g)[:12]
    returned = reference.quantize_into(x, pages, slots)
    got = reference.rows_tensor(pages.map(lambda m: m.flatten(0, 1)[slots]))
    want = reference.quantize(x, scaling="row")
    assert got.equal(want)
    assert returned.equal(want)  # what the pages hold, as the site's record
    assert want.global_scale[0].eq(0).all() and want.global_scale[3].isnan().all()
    if dtype != torch.float16:  # FP16 holds no amax that small
        assert want.global_scale[1, 0].item() == 2.0**-117
    with pytest.raises(ValueError, match=r"x_TKD is torch.float64 but the pages keep"):
        reference.quantize_into(x.double(), pages, slots)


@pytest.mark.gpu
def test_rows_are_read_back_inside_a_cuda_graph():
    """`rows_tensor` moves the pages' sign bits back without index tensors from the host, so a
    CUDA graph captures `KVCache.read`'s gather and dequantize and replays it on new slots."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 2, 64, generator=g).to(torch.bfloat16)
    pages = NVFP4Rows(
        torch.zeros(4, 4, 2, 32, dtype=torch.uint8),
        torch.zeros(4, 4, 2, 4, dtype=torch.float8_e4m3fn),
        torch.zeros(4, 4, 2, 1, dtype=torch.bfloat16),
    ).map(torch.Tensor.cuda)
    reference.quantize_into(x.cuda(), pages, torch.arange(16, device="cuda"))
    slots = torch.arange(8, device="cuda")

    def read():  # as KVCache.read does it
        rows = reference.rows_tensor(pages.map(lambda m: m.flatten(0, 1)[slots]))
        return ops.dequantize(rows, torch.bfloat16)

    read()  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = read()
    for first in (8, 3):
        slots.copy_(torch.arange(first, first + 8, device="cuda"))
        graph.replay()
        want = reference.quantize(x[first : first + 8], scaling="row")
        want = reference.dequantize(want, torch.bfloat16)
        assert torch.equal(out.cpu(), want)


def test_records_with_float8_scales_survive_pickle_and_torch_save():
    """torch's float8 tensors pickle but do not unpickle; the containers send their scales'
    bytes instead and come back bit for bit, as float8, through pickle, torch.save and copy."""
    g = torch.Generator().manual_seed(3)
    t = reference.quantize(torch.randn(4, 3, 64, generator=g), scaling="row")
    rows = NVFP4Rows(t.codes, t.block_scale, torch.rand(4, 3, 1, generator=g))
    for record in (t, ops.compact(t), rows):
        saved = io.BytesIO()
        torch.save({"r": record}, saved)
        saved.seek(0)
        copies = (
            pickle.loads(pickle.dumps(record)),
            torch.load(saved, weights_only=False)["r"],
            copy.deepcopy(record),
        )
        for got in copies:
            assert type(got) is type(record)
            for f in dataclasses.fields(record):
                a, b = getattr(got, f.name), getattr(record, f.name)
                assert a.dtype == b.dtype and a.shape == b.shape, f.name
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f.name
