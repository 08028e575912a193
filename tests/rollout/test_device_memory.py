"""Device memory at reserved addresses (`fp4rl.rollout.device_memory`): mapped, given back and
mapped again at the same addresses, with a CUDA graph captured over it still valid."""

import pytest
import torch

from fp4rl.rollout.device_memory import ReservedMemory, unsupported
from fp4rl.rollout.kv_cache import KVCache, KVCacheSpec

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SPEC = KVCacheSpec(("nvfp4", "bf16"), num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)


def test_a_cpu_cannot_reserve_device_addresses():
    assert unsupported(torch.device("cpu")) == "cpu is not a CUDA device"
    with pytest.raises(ValueError, match="reserved device memory: cpu is not a CUDA device"):
        KVCache(SPEC, 4, 16, "cpu", reserved=True)


@GPU
@pytest.mark.gpu
def test_memory_goes_back_and_returns_at_the_same_addresses_zeroed():
    assert unsupported(torch.device("cuda")) is None  # an H200 supports it
    memory = ReservedMemory(64 << 20, "cuda")
    assert memory.nbytes >= 64 << 20 and memory.mapped
    buffer = memory.view(0, memory.nbytes)
    assert buffer.data_ptr() == memory.base and not buffer.ne(0).any()
    buffer.fill_(7)
    free = torch.cuda.mem_get_info()[0]
    memory.unmap()
    assert not memory.mapped and torch.cuda.mem_get_info()[0] - free >= memory.nbytes
    with pytest.raises(RuntimeError, match="viewed while unmapped"):
        memory.view(0, 1)
    memory.map()
    again = memory.view(0, memory.nbytes)
    assert again.data_ptr() == buffer.data_ptr() and not again.ne(0).any()
    with pytest.raises(ValueError, match=rf"bytes 1\.\.{memory.nbytes + 1} outside"):
        memory.view(1, memory.nbytes)
    memory.close()
    assert memory.base is None


@GPU
@pytest.mark.gpu
def test_a_graph_over_reserved_memory_replays_after_it_is_mapped_again():
    memory = ReservedMemory(1 << 20, "cuda")
    x = memory.view(0, 4096).view(torch.float32)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x.add_(1)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    memory.unmap()
    memory.map()  # zeroed
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(
        memory.view(0, 4096).view(torch.float32), torch.full((1024,), 2.0, device="cuda")
    )


@GPU
@pytest.mark.gpu
def test_kv_pages_in_reserved_memory_are_the_plain_pages_shapes_and_zeros():
    plain = KVCache(SPEC, 4, 16, "cuda")
    reserved = KVCache(SPEC, 4, 16, "cuda", reserved=True)
    assert plain.memory is None and reserved.memory is not None
    for a, b in zip(plain.layers, reserved.layers, strict=True):
        for t, u in zip(a.tensors(), b.tensors(), strict=True):
            assert (t.shape, t.dtype, t.stride()) == (u.shape, u.dtype, u.stride())
            assert u.data_ptr() % 256 == 0 and not u.view(torch.uint8).ne(0).any()
            assert (
                reserved.memory.base <= u.data_ptr() < reserved.memory.base + reserved.memory.nbytes
            )
