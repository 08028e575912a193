"""A refit puts the trainer's weights into the engine exactly, in place.

Claims (FP32, CPU, tiny model with FP4, BF16 and dense layers; `refit_checks`):
- after a refit the packed experts' codes and scales equal `fp4rl.ops.quantize(w, scaling=2)`
  of the trainer's weights bitwise, the weights the GEMMs see equal those of the trainer's QAT
  forward bitwise, and BF16 modules equal the trainer's bitwise; the same whether the stream
  names experts fused per layer or per expert as the hub does;
- no storage address of the engine changes (CUDA graphs captured against them stay valid);
- greedy generation then equals, token for token and logprob for logprob, that of an engine built
  fresh from the same weights, and completions carry the new policy version;
- in one process the receiver reads the trainer's own tensors: nothing is copied to stage them.
"""

import pytest
from refit_checks import (
    assert_engine_holds,
    assert_generates_like,
    engine,
    storage,
    trainer,
)

from fp4rl.refit import InProcessTransport, NamedTensor, RefitReceiver, refit_records


@pytest.mark.parametrize("names", ["fused", "hf"])
def test_refit_holds_the_trainers_weights_in_the_same_storage(names):
    rollout, new = engine(seed=0), trainer(seed=1)
    before = storage(rollout.model)
    transport = InProcessTransport()
    transport.send(refit_records(new, 1, names=names))
    assert RefitReceiver(rollout).receive(transport.receive()) == 1
    assert rollout.policy_version == 1 and rollout.invalid is None
    assert_engine_holds(rollout, new)
    assert storage(rollout.model) == before
    assert_generates_like(rollout, engine(seed=1))


def test_successive_refits_each_advance_the_version():
    rollout = engine(seed=0)
    receiver = RefitReceiver(rollout)
    for version, seed in ((1, 1), (5, 2), (6, 0)):
        assert receiver.receive(refit_records(trainer(seed), version)) == version
        assert_engine_holds(rollout, trainer(seed))
    assert_generates_like(rollout, engine(seed=0))


@pytest.mark.parametrize("names", ["fused", "hf"])
def test_in_process_stream_hands_over_the_trainers_own_tensors(names):
    new = trainer(seed=1)
    storages = {p.untyped_storage().data_ptr() for p in new.parameters()}
    handed = []

    def watched(records):
        for record in records:
            if isinstance(record, NamedTensor):
                handed.append(record.tensor.untyped_storage().data_ptr())
            yield record

    RefitReceiver(engine(seed=0)).receive(watched(refit_records(new, 1, names=names)))
    assert handed and set(handed) <= storages
