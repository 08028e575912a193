"""The counting-sort kernel of the MoE dispatch against the stable argsort it replaces on the
GPU: the same permutation, bit for bit, and its inverse (``inverse[order] == arange``, the
dispatch's ``row_order``), for int32 and int64 ids, at every A the kernel takes (chunk
boundaries, ties spread over chunks, experts left empty), with nothing read back to the host
and replayed in a CUDA graph on new ids."""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from fp4rl import ops  # noqa: E402
from fp4rl.kernels import expert_sort  # noqa: E402

ID_DTYPES = (torch.int32, torch.int64)


def id_patterns(A: int, E: int, seed: int):
    """(name, ids [A]) in [0, E): uniform, a few experts only (many ties), one expert, sorted,
    descending, and alternating between the first and the last expert."""
    g = torch.Generator().manual_seed(seed)
    yield "uniform", torch.randint(0, E, (A,), generator=g)
    few = torch.randint(0, E, (3,), generator=g)
    yield "few", few[torch.randint(0, 3, (A,), generator=g)]
    yield "one", torch.full((A,), E - 1)
    yield "sorted", torch.sort(torch.randint(0, E, (A,), generator=g)).values
    yield "descending", torch.arange(A).flip(0).remainder(E)
    yield "ends", torch.where(torch.arange(A) % 2 == 0, 0, E - 1)


def assert_same_order(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal int64 permutations (the argsort the dispatch's ``scatter_`` takes)."""
    got = got.cpu()
    assert got.dtype == torch.int64 and got.shape == want.shape, f"{what}: {got.dtype} {got.shape}"
    bad = (got != want).nonzero()
    assert not len(bad), (
        f"{what}: slot {int(bad[0])} holds {int(got[bad[0]])}, want {int(want[bad[0]])}"
    )


def assert_inverts(inverse: torch.Tensor, order: torch.Tensor, what: str) -> None:
    """``inverse`` is the inverse permutation of ``order`` (int64 ``[A]``, as the dispatch's
    ``scatter_`` of ``arange`` makes it)."""
    inverse = inverse.cpu()
    assert inverse.dtype == torch.int64 and inverse.shape == order.shape, f"{what}: inverse"
    assert torch.equal(inverse[order], torch.arange(order.numel())), f"{what}: inverse"


def assert_counts(counts: torch.Tensor, ids: torch.Tensor, E: int, what: str) -> None:
    """``counts`` are the assignments per expert (int64 ``[E]``, as `expert_counts` makes them)."""
    counts = counts.cpu()
    assert counts.dtype == torch.int64 and counts.shape == (E,), f"{what}: counts"
    want = torch.bincount(ids.cpu().flatten().long(), minlength=E)
    assert torch.equal(counts, want), f"{what}: counts {counts.tolist()}, want {want.tolist()}"


def assert_sorts(ids, E, device, what, tile=expert_sort.DEFAULT_TILE) -> None:
    order, inverse, counts = expert_sort.launch(ids.to(device), E, tile)
    assert order.dtype == torch.int64 and order.device.type == device, what
    assert inverse.device.type == device and counts.device.type == device, what
    want = torch.argsort(ids.flatten(), stable=True)
    assert_same_order(order, want, what)
    assert_inverts(inverse, want, what)
    assert_counts(counts, ids, E, what)


@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=str)
@pytest.mark.parametrize(
    "A, E", [(0, 8), (1, 1), (1, 128), (7, 3), (7, 256), (64, 1), (64, 128), (512, 128),
             (512, 256), (512, 2)],
)  # fmt: skip
def test_the_stable_argsort(device, id_dtype, A, E):
    for name, ids in id_patterns(A, E, seed=A * 1000 + E):
        assert_sorts(ids.to(id_dtype), E, device, f"{name} A={A} E={E}")


@pytest.mark.parametrize("A", [63, 65, 129, 1023, 1025, 2100])
def test_across_chunk_boundaries(device, A):
    """Ties run over the programs' chunks (64) and the counting steps (1024); A not a multiple."""
    for name, ids in id_patterns(A, 5, seed=A):
        assert_sorts(ids.to(torch.int32), 5, device, f"{name} A={A}")


@pytest.mark.parametrize("tile", [(16, 1), (32, 2), (128, 8)])
def test_other_tiles(device, tile):
    tile = expert_sort.SortTile(*tile)
    for A in (15, 200):
        for name, ids in id_patterns(A, 9, seed=A):
            assert_sorts(ids, 9, device, f"{name} A={A} {tile}", tile)


@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=str)
def test_any_ids(device, id_dtype):
    """Hypothesis draws A, E and ids in [0, E), skewed toward few distinct experts."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=40, deadline=None)
    @hypothesis.given(st.integers(1, 256).flatmap(lambda E: st.tuples(
        st.just(E), st.lists(st.integers(0, E - 1) | st.sampled_from([0, E - 1]), max_size=300)
    )))  # fmt: skip
    def check(case):
        E, ids = case
        assert_sorts(torch.tensor(ids, dtype=id_dtype), E, device, f"E={E} ids={ids}")

    check()


def test_token_by_expert_ids(device):
    """``[T, k]`` top-k ids are sorted in flat order, with experts of no assignment."""
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(60, generator=g)[:8] for _ in range(64)])
    for id_dtype in ID_DTYPES:
        assert_sorts(ids.to(id_dtype), 60, device, str(id_dtype))


def test_checks_name_the_values(device):
    ids = torch.zeros(8, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="ids must be one of"):
        expert_sort.launch(ids.float(), 4)
    with pytest.raises(ValueError, match=r"ids must be contiguous; got shape \(4, 2\)"):
        expert_sort.launch(ids.view(2, 4).t(), 4)
    for bad in (0, 257, 4.0, True):
        with pytest.raises(ValueError, match=f"num_experts.*{bad!r}"):
            expert_sort.launch(ids, bad)
    too_many = torch.zeros(expert_sort.MAX_ASSIGNMENTS + 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="got 8193 assignments"):
        expert_sort.launch(too_many, 4)


def test_tiles_are_checked():
    for chunk in (8, 48):
        with pytest.raises(ValueError, match=f"chunk must be a power of two >= 16; got {chunk}"):
            expert_sort.SortTile(chunk, 4)
    with pytest.raises(ValueError, match="num_warps must be 1, 2, 4, 8 or 16; got 3"):
        expert_sort.SortTile(64, 3)


def test_supported_is_decided_by_shapes():
    assert expert_sort.supported(0, 1) and expert_sort.supported(8192, 256)
    assert not expert_sort.supported(8193, 128)
    assert not expert_sort.supported(64, 257) and not expert_sort.supported(64, 0)


def test_ops_leaves_cpu_tensors_to_torch():
    assert ops.sort_by_expert(torch.zeros(8, 2, dtype=torch.int64), 4) is None


@pytest.mark.gpu
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=str)
@pytest.mark.parametrize("A, E", [(8, 128), (512, 128), (2048, 128), (8191, 3), (8192, 128),
                                  (8192, 256), (8192, 1)])  # fmt: skip
def test_up_to_the_bound_on_gpu(id_dtype, A, E):
    for name, ids in id_patterns(A, E, seed=A + E):
        ids = ids.to(id_dtype).cuda()
        result = ops.sort_by_expert(ids, E)
        assert result is not None, f"{name} A={A} E={E}: the kernel did not run"
        want = torch.argsort(ids.cpu(), stable=True)
        assert_same_order(result[0], want, f"{name} A={A} E={E}")
        assert_inverts(result[1], want, f"{name} A={A} E={E}")
        assert_counts(result[2], ids, E, f"{name} A={A} E={E}")


@pytest.mark.gpu
def test_ops_leaves_large_sorts_to_torch_on_gpu():
    ids = torch.zeros(expert_sort.MAX_ASSIGNMENTS + 1, dtype=torch.int64, device="cuda")
    assert ops.sort_by_expert(ids, 128) is None
    assert ops.sort_by_expert(ids[:64], expert_sort.MAX_EXPERTS + 1) is None


@pytest.mark.gpu
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=str)
def test_captured_in_a_cuda_graph_without_a_sync(id_dtype):
    g = torch.Generator().manual_seed(1)
    static = torch.randint(0, 128, (64, 8), generator=g).to(id_dtype).cuda()
    expert_sort.launch(static, 128)  # compile outside the capture
    # New ids already on the device: a copy from pageable host memory would itself wait.
    fresh = [torch.randint(0, few, (64, 8), generator=g).to(id_dtype).cuda() for few in (128, 3, 1)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # nothing below may read a value back
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            order, inverse, counts = expert_sort.launch(static, 128)
        replays = []
        for ids in fresh:
            static.copy_(ids)
            graph.replay()
            replays.append((static.clone(), order.clone(), inverse.clone(), counts.clone()))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for i, (ids, got, got_inverse, got_counts) in enumerate(replays):
        want = torch.argsort(ids.cpu().flatten(), stable=True)
        assert_same_order(got, want, f"replay {i}")
        assert_inverts(got_inverse, want, f"replay {i}")
        assert_counts(got_counts, ids, 128, f"replay {i}")
