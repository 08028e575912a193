"""The MoE dispatch's sort (`fp4rl.model.experts.sort_by_expert`): the stable argsort of the
top-k ids, bit for bit, by one sort of unique int32 keys where they fit (no stability asked
for), by a stable sort of the ids where they would overflow; on CUDA without a device sync and
inside a CUDA graph."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp4rl.model import experts


def assert_same_order(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    assert torch.equal(got, want)


class Sorts(TorchDispatchMode):
    """The sorts run: ``(overload, key dtype)``."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == "aten::sort":
            self.seen.append((func._overloadname, args[0].dtype))
        return func(*args, **(kwargs or {}))


def routing_cases(g):
    """``(ids [T, k], E)``: T from 0 up to a few thousand, k 1..8, E up to 256; uniform ids,
    a few experts taking all (many ties), one expert for all, and ids in sorted and reverse
    order."""
    shapes = [(0, 8, 128), (1, 1, 1), (1, 8, 128), (1, 8, 8), (2, 2, 256), (3, 8, 2)]
    shapes += [(64, 8, 128), (64, 4, 60), (512, 8, 256), (4096, 8, 128), (3000, 1, 7)]
    shapes += [
        (int(torch.randint(0, 700, (), generator=g)), k, E)
        for k in range(1, 9)
        for E in (k, 16, 256)
    ]
    for T, k, E in shapes:
        yield torch.randint(0, E, (T, k), generator=g), E
        few = torch.randint(0, E, (3,), generator=g)
        yield few[torch.randint(0, 3, (T, k), generator=g)], E
        yield torch.full((T, k), E - 1), E
        yield torch.sort(torch.randint(0, E, (T * k,), generator=g)).values.view(T, k), E
        yield torch.arange(T * k).flip(0).remainder(E).view(T, k), E


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_sort_by_expert_is_the_stable_argsort(id_dtype):
    g = torch.Generator().manual_seed(5)
    for ids, E in routing_cases(g):
        ids = ids.to(id_dtype)
        with Sorts() as sorts:
            order = experts.sort_by_expert(ids, E)
        assert_same_order(order, torch.argsort(ids.flatten(), stable=True))
        # One sort of unique int32 keys, no stability asked for.
        assert sorts.seen == [("default", torch.int32)]


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_sort_by_expert_sorts_the_ids_stably_when_int32_keys_would_overflow(id_dtype):
    g = torch.Generator().manual_seed(6)
    for T, k, E, path in [
        (1, 8, 2**28 - 1, ("default", torch.int32)),  # E * A = 2**31 - 8: keys up to 2**31 - 1
        (1, 8, 2**28, ("stable", id_dtype)),  # E * A = 2**31
        (1, 8, 2**28 + 1, ("stable", id_dtype)),  # keys past 2**31 - 1
        (3000, 8, 2**17, ("stable", id_dtype)),
    ]:
        ids = torch.randint(E - 2, E, (T, k), generator=g)
        ids.view(-1)[torch.randperm(T * k, generator=g)[: T * k // 2]] = 0
        ids = ids.to(id_dtype)
        with Sorts() as sorts:
            order = experts.sort_by_expert(ids, E)
        assert_same_order(order, torch.argsort(ids.flatten(), stable=True))
        assert sorts.seen == [path]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sort_by_expert_on_cuda_is_the_stable_argsort_without_a_sync():
    g = torch.Generator().manual_seed(7)
    cases = [
        (ids.to(dtype), E) for ids, E in routing_cases(g) for dtype in (torch.int64, torch.int32)
    ]
    cases += [(torch.randint(0, 128, (16384, 8), generator=g), 128)]  # past the in-block sort
    on_cuda = [(ids.cuda(), E) for ids, E in cases]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # nothing below may read a value back
    try:
        orders = [experts.sort_by_expert(ids, E) for ids, E in on_cuda]
        stable = [torch.argsort(ids.flatten(), stable=True) for ids, _ in on_cuda]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for (ids, _), order, cuda_stable in zip(cases, orders, stable, strict=True):
        assert_same_order(order, cuda_stable)
        assert_same_order(order.cpu(), torch.argsort(ids.flatten(), stable=True))
    # Captured in a CUDA graph and replayed on other ids.
    static = torch.randint(0, 128, (64, 8), generator=g).cuda()
    experts.sort_by_expert(static, 128)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        order = experts.sort_by_expert(static, 128)
    for _ in range(3):
        static.copy_(torch.randint(0, 128, (64, 8), generator=g))
        graph.replay()
        assert_same_order(order, torch.argsort(static.flatten(), stable=True))
