"""The routed experts' L2 prefetch: every chunk it starts lies within the slice of the expert the
router chose, and together they cover that slice, for packed NVFP4 weights (codes and block
scales) and BF16 ones, at Qwen3-30B-A3B's per-expert sizes and at tiny ones (the chunks it
would fetch, recorded, under the interpreter and on the GPU); tensors it cannot fetch are left
out or refused by name; and on the GPU the fetch itself runs inside a CUDA graph and changes no
bit of an MoE layer's output."""

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton (pip install 'fp4rl[kernels]')")

from fp4rl import ops  # noqa: E402
from fp4rl.kernels import expert_prefetch  # noqa: E402


def chunks_of(where: torch.Tensor, a: int, t: int) -> list[tuple[int, int]]:
    """The (address, bytes) the launch recorded for assignment a's weight t, in order."""
    rows = where[a, t].cpu().tolist()
    return [(addr, size) for addr, size in rows if size]


def assert_covers(where, ids, weights, what):
    """Weight t's chunks for assignment a tile exactly expert ``ids[a]``'s slice of it."""
    for a, expert in enumerate(ids.flatten().tolist()):
        for t, w in enumerate(weights):
            per_expert = w[0].numel() * w.element_size()
            start = w.data_ptr() + expert * per_expert
            got = chunks_of(where, a, t)
            assert got, f"{what}: nothing fetched for assignment {a}, weight {t}"
            assert all(size % 16 == 0 and addr % 16 == 0 for addr, size in got), what
            assert got[0][0] == start, f"{what}: assignment {a} weight {t} starts elsewhere"
            for (addr, size), (nxt, _) in zip(got, got[1:], strict=False):
                assert addr + size == nxt, f"{what}: a gap or overlap at {addr:#x}"
            assert got[-1][0] + got[-1][1] == start + per_expert, f"{what}: ends elsewhere"
        for t in range(len(weights), expert_prefetch.MAX_TENSORS):
            assert not chunks_of(where, a, t), f"{what}: a chunk for absent weight {t}"


@pytest.mark.parametrize("shape", [(16, 32, 64), (4, 1536, 2048), (4, 2048, 768)])
def test_each_chunk_lies_in_the_chosen_experts_slice(shape, device):
    """Tiny experts and Qwen3-30B-A3B's (w13, w2), four of them: only the per-expert sizes
    matter to the addresses, so the tensors are left uninitialized."""
    E, N, K = shape
    weights = [
        torch.empty(E, N, K // 2, dtype=torch.uint8, device=device),  # NVFP4 codes
        torch.empty(E, N, K // 16, dtype=torch.float8_e4m3fn, device=device),  # block scales
        torch.empty(E, N, K, dtype=torch.bfloat16, device=device),  # a BF16 weight
    ]
    ids = torch.randint(0, E, (1, 8), generator=torch.Generator().manual_seed(N)).to(device)
    where = expert_prefetch.launch(ids, weights, record=True)
    assert_covers(where, ids, weights, f"{shape}")


def test_one_id_tensor_of_int32_and_several_tokens(device):
    w = torch.zeros(8, 16, 64, dtype=torch.bfloat16, device=device)
    ids = torch.tensor([[7, 0], [3, 3]], dtype=torch.int32, device=device)
    where = expert_prefetch.launch(ids, [w], record=True)
    assert_covers(where, ids, [w], "int32 ids")


def test_what_cannot_be_fetched_is_left_out_or_refused(device):
    good = torch.zeros(4, 16, 16, dtype=torch.bfloat16, device=device)
    odd = torch.zeros(4, 3, 3, dtype=torch.uint8, device=device)  # 9 bytes an expert
    strided = torch.zeros(4, 16, 32, dtype=torch.bfloat16, device=device)[:, :, :16]
    assert expert_prefetch.prefetchable([good, odd, strided]) == [good]
    ids = torch.zeros(1, 2, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"multiple of 16 bytes.*\(4, 3, 3\)"):
        expert_prefetch.launch(ids, [good, odd])
    with pytest.raises(ValueError, match="between 1 and 4 weights; got 5"):
        expert_prefetch.launch(ids, [good] * 5)


def test_off_the_gpu_the_op_does_nothing():
    ids = torch.zeros(1, 8, dtype=torch.int64)
    with ops.prefetching_experts(ids, (torch.zeros(4, 16, 16),)):
        pass


@pytest.mark.gpu
def test_fetched_inside_a_cuda_graph_and_no_output_bit_moves(monkeypatch):
    from fp4rl.model.experts import PackedExperts

    torch.manual_seed(0)
    experts = PackedExperts(16, 256, 128, layer=0)
    w13 = torch.randn(16, 256, 256, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(16, 256, 128, device="cuda", dtype=torch.bfloat16) * 0.05
    experts.install(*experts.quantized(w13, w2), torch.bfloat16)
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.tensor([[3, 1, 15, 0, 7, 9, 2, 11]], device="cuda")
    weights = torch.softmax(torch.randn(1, 8, device="cuda"), -1).to(torch.bfloat16)
    with torch.inference_mode():
        monkeypatch.setattr(expert_prefetch, "MAX_ASSIGNMENTS", 0)
        plain = experts(x, ids, weights)
        monkeypatch.setattr(expert_prefetch, "MAX_ASSIGNMENTS", 8)
        fetched = experts(x, ids, weights)  # compiles the prefetch outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = experts(x, ids, weights)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(fetched, plain) and torch.equal(replayed, plain)
