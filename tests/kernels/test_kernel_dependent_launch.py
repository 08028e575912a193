"""Programmatic dependent launch (`fp4rl.kernels.dependent_launch`): where it applies, and that a
chain of dependently launched kernels replayed from a CUDA graph computes the plain chain's bits,
with the kernels after them started as the kernels exit or as soon as all their programs run.
"""

import pytest
import torch

from fp4rl import ops
from fp4rl.kernels import dependent_launch, rms_norm

PLAIN = dict(PDL=dependent_launch.PLAIN, launch_pdl=False)


def test_plain_launches_off_the_gpu(monkeypatch):
    assert dependent_launch.keywords(torch.device("cpu")) == PLAIN
    with dependent_launch.early_dependents():
        assert dependent_launch.keywords(torch.device("cpu")) == PLAIN
    if torch.cuda.is_available():
        monkeypatch.setattr(dependent_launch, "ENABLED", False)
        assert dependent_launch.keywords(torch.device("cuda")) == PLAIN


def test_early_dependents_is_scoped():
    with dependent_launch.early_dependents():
        assert dependent_launch._early
        with dependent_launch.early_dependents(False):
            assert not dependent_launch._early
        assert dependent_launch._early
        with pytest.raises(KeyError), dependent_launch.early_dependents(False):
            raise KeyError
        assert dependent_launch._early
    assert not dependent_launch._early
    with ops.early_dependents(torch.device("cpu")):  # off CUDA: nothing to change
        assert not dependent_launch._early
    cuda = torch.device("cuda")  # the switch only; nothing is launched
    with ops.early_dependents(cuda):
        assert dependent_launch._early
        with ops.early_dependents(cuda, False):  # off inside an early block: the K/V store's
            assert not dependent_launch._early
        assert dependent_launch._early
    assert not dependent_launch._early


def _chain(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Twelve residual adds with their norms, each launch reading the two tensors the launch
    before it wrote (nothing else runs between them)."""
    for _ in range(12):
        x, h = rms_norm.launch_add(x, h, weight, 1e-6)
    return torch.cat([x, h])


@pytest.mark.gpu
@pytest.mark.parametrize("early", [False, True])
def test_dependent_launches_in_a_graph_compute_the_plain_bits(early, monkeypatch):
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) < dependent_launch.CAPABILITY:
        pytest.skip("dependent launch needs sm_90 or newer")
    monkeypatch.setattr(dependent_launch, "_early", early)
    pdl = dependent_launch.EARLY if early else dependent_launch.DEPENDENT
    assert dependent_launch.keywords(device) == dict(PDL=pdl, launch_pdl=True)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(4, 2048, generator=g, device=device, dtype=torch.bfloat16)
    h = torch.randn(4, 2048, generator=g, device=device, dtype=torch.bfloat16)
    weight = torch.randn(2048, generator=g, device=device, dtype=torch.bfloat16)

    def replayed() -> torch.Tensor:
        _chain(x, h, weight)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(x, h, weight)
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    dependent = replayed()
    monkeypatch.setattr(dependent_launch, "ENABLED", False)
    plain = replayed()
    assert torch.equal(dependent, plain)
    assert torch.equal(dependent, _chain(x, h, weight))
