"""The refit on the GPU in BF16: quantization at load runs the Triton kernels.

Same claims as `test_refit.py` (codes and scales bitwise equal to `fp4rl.ops.quantize` of the
trainer's weights and to what its QAT forward uses, storage addresses unchanged), and a poisoned
expert caught through the NaN global scale the kernel gives it. Generation after the refit
matches an engine built fresh token for token; its logprobs run the same kernels on the same
shapes, so they are expected bitwise, and LOGPROB_ATOL only allows for a GEMM whose reduction
order is not fixed.
"""

import pytest
import torch
from refit_checks import GREEDY, PROMPTS, assert_engine_holds, engine, storage, trainer

from fp4rl.refit import NamedTensor, RefitError, RefitReceiver, refit_records

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ON_GPU = dict(dtype=torch.bfloat16, device="cuda")
LOGPROB_ATOL = 1e-3


@pytest.mark.parametrize("names", ["fused", "hf"])
def test_refit_on_gpu_holds_the_trainers_weights_in_the_same_storage(names):
    rollout, new = engine(seed=0, **ON_GPU), trainer(seed=1, **ON_GPU)
    before = storage(rollout.model)
    assert RefitReceiver(rollout).receive(refit_records(new, 1, names=names)) == 1
    assert_engine_holds(rollout, new)
    assert storage(rollout.model) == before
    got, want = (e.generate(PROMPTS, GREEDY) for e in (rollout, engine(seed=1, **ON_GPU)))
    for a, b in zip(got, want, strict=True):
        assert a.completion_ids == b.completion_ids and a.policy_version == 1
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_refit_on_gpu_refuses_a_poisoned_expert():
    rollout, records = engine(seed=0, **ON_GPU), list(refit_records(trainer(seed=1, **ON_GPU), 1))
    i = next(i for i, r in enumerate(records) if r.name == "layers.2.mlp.experts.w2")
    poisoned = records[i].tensor.clone()
    poisoned[4, 0, 0] = float("nan")
    records[i] = NamedTensor(records[i].name, poisoned)
    with pytest.raises(RefitError, match=r"layers\.2\.mlp\.experts\.w2: .* in experts \[4\]"):
        RefitReceiver(rollout).receive(records)
    with pytest.raises(RuntimeError, match="experts"):
        rollout.generate(PROMPTS, GREEDY)
