"""A refit that is not applied in full fails closed, one test per way it can go wrong.

Each case feeds the engine a stream with one fault and holds it to the same outcome: the refit
raises `RefitError` naming the tensor (or record) at fault; the receiver reads the stream to its
end (`Stream.taken`), so a sender is never left waiting; the policy version does not move;
`generate` refuses to run on the stale or half-written weights and says why; and a later good
refit brings the engine back, bitwise, in the same storage. Sender death across processes is in
`test_refit_distributed.py`.
"""

import re

import pytest
import torch
from refit_checks import (
    ENGINE,
    GREEDY,
    PRECISION,
    PROMPTS,
    assert_engine_holds,
    assert_generates_like,
    engine,
    storage,
    trainer,
)
from tiny_models import packed_twin, qat_model

from fp4rl.refit import Abort, EndOfStream, NamedTensor, RefitError, RefitReceiver, refit_records
from fp4rl.rollout import Engine


class Stream:
    """A sender's records (``fail`` raised after them, if given) that count what was read."""

    def __init__(self, records, fail: Exception | None = None):
        self.records, self.fail, self.taken = list(records), fail, 0

    def __iter__(self):
        for record in self.records:
            self.taken += 1
            yield record
        if self.fail is not None:
            raise self.fail


@pytest.fixture(scope="module")
def recovered():
    """The engine a recovery refit must match: built fresh from ``trainer(seed=2)``."""
    return engine(seed=2)


def records(names="fused", version=1):
    return list(refit_records(trainer(seed=1), version, names=names))


def index(stream, name):
    return next(i for i, r in enumerate(stream) if isinstance(r, NamedTensor) and r.name == name)


def replaced(stream, name, fn):
    """``stream`` with the tensor ``name`` replaced by ``fn(a clone of it)``."""
    i = index(stream, name)
    return [*stream[:i], NamedTensor(name, fn(stream[i].tensor.clone())), *stream[i + 1 :]]


def assert_fails_closed(stream: Stream, message: str, recovered):
    rollout = engine(seed=0)
    receiver, before = RefitReceiver(rollout), storage(rollout.model)
    with pytest.raises(RefitError, match=re.escape(message)):
        receiver.receive(stream)
    assert stream.taken == len(stream.records), "the rest of the stream was not drained"
    assert rollout.policy_version == 0
    with pytest.raises(RuntimeError, match=re.escape(message)):
        rollout.generate(PROMPTS, GREEDY)
    new = trainer(seed=2)
    assert receiver.receive(refit_records(new, 1)) == 1
    assert rollout.invalid is None and storage(rollout.model) == before
    assert_engine_holds(rollout, new)
    assert_generates_like(rollout, recovered)


def test_sender_exception_mid_stream(recovered):
    good = records()
    stream = Stream(good[:6], fail=RuntimeError("trainer lost its optimizer state"))
    message = (
        f"the sender failed after 6 tensors (last: {good[5].name}): "
        "RuntimeError: trainer lost its optimizer state"
    )
    assert_fails_closed(stream, message, recovered)


def test_sender_abort_record(recovered):
    good = records()
    stream = Stream([*good[:3], Abort("CUDA error: out of memory"), *good[3:]])
    message = f"the sender aborted after 3 tensors (last: {good[2].name}): CUDA error"
    assert_fails_closed(stream, message, recovered)


@pytest.mark.parametrize(
    "name", ["layers.1.mlp.experts.w4", "model.layers.1.mlp.experts.8.up_proj.weight"]
)
def test_unknown_name(recovered, name):
    good = records()
    stream = [*good[:5], NamedTensor(name, torch.zeros(8, 64, 32)), *good[5:]]
    assert_fails_closed(Stream(stream), f"{name}: unknown name", recovered)


def test_duplicate_name(recovered):
    good = records()
    i = index(good, "layers.2.self_attn.k_proj.weight")
    stream = [*good[: i + 2], good[i], *good[i + 2 :]]
    message = "layers.2.self_attn.k_proj.weight: duplicate: already received in this refit"
    assert_fails_closed(Stream(stream), message, recovered)


def test_duplicate_under_the_other_naming(recovered):
    # The fused w13 arrives, then one hub piece of it: two names, one weight.
    good, hub = records(), records("hf")
    piece = hub[index(hub, "model.layers.1.mlp.experts.5.up_proj.weight")]
    i = index(good, "layers.1.mlp.experts.w2")
    message = (
        "model.layers.1.mlp.experts.5.up_proj.weight: duplicate: layers.1.mlp.experts.w13 "
        "already received"
    )
    assert_fails_closed(Stream([*good[:i], piece, *good[i:]]), message, recovered)


@pytest.mark.parametrize(
    "names, name, fn, message",
    [
        ("fused", "layers.2.mlp.experts.w2", lambda t: t.transpose(1, 2),
         "layers.2.mlp.experts.w2: shape (8, 32, 64), model has (8, 64, 32)"),
        ("hf", "model.layers.1.mlp.experts.3.gate_proj.weight", lambda t: t[:16],
         "model.layers.1.mlp.experts.3.gate_proj.weight: shape (16, 64), model has (32, 64)"),
        ("fused", "layers.2.self_attn.o_proj.weight", lambda t: t.to(torch.int32),
         "layers.2.self_attn.o_proj.weight: dtype torch.int32 is not floating point"),
    ],
)  # fmt: skip
def test_wrong_shape_or_dtype(recovered, names, name, fn, message):
    assert_fails_closed(Stream(replaced(records(names), name, fn)), message, recovered)


def poison(index, value=float("nan")):
    def fn(t):
        t[index] = value
        return t

    return fn


@pytest.mark.parametrize(
    "names, name, fn, message",
    [
        ("fused", "layers.2.mlp.experts.w13", poison((3, 7, 1)),
         "layers.2.mlp.experts.w13: non-finite values in experts [3]"),
        ("fused", "norm.weight", poison(5, float("inf")),
         "norm.weight: 1 non-finite values of 64"),
        ("hf", "model.layers.1.mlp.experts.6.up_proj.weight", poison((0, 9)),
         "layers.1.mlp.experts.w13: non-finite values in experts [6]"),
        ("hf", "model.layers.3.mlp.experts.5.down_proj.weight", poison((1, 2), -float("inf")),
         "layers.3.mlp.experts.w2: non-finite values in experts [5]"),
    ],
)  # fmt: skip
def test_non_finite_values(recovered, names, name, fn, message):
    assert_fails_closed(Stream(replaced(records(names), name, fn)), message, recovered)


def dropped(stream, name, *, keep_in_inventory=False):
    end = stream[-1]
    inventory = end.inventory if keep_in_inventory else tuple(n for n in end.inventory if n != name)
    i = index(stream, name)
    return [*stream[:i], *stream[i + 1 : -1], EndOfStream(end.policy_version, inventory)]


@pytest.mark.parametrize(
    "stream, message",
    [
        (lambda: dropped(records(), "layers.2.self_attn.q_proj.weight"),
         "missing at the end of the stream: ['layers.2.self_attn.q_proj.weight']"),
        (lambda: dropped(records("hf"), "model.layers.2.mlp.experts.4.down_proj.weight"),
         "missing at the end of the stream: ['layers.2.mlp.experts.w2 (7 of 8 pieces)']"),
        (lambda: dropped(records(), "lm_head.weight", keep_in_inventory=True),
         "the sender's inventory lists tensors that never arrived: ['lm_head.weight']"),
        (lambda: records()[:-1],
         "the stream ended without an end-of-stream record after"),
    ],
    ids=["fused", "hub-piece", "lost-in-transit", "no-end-record"],
)  # fmt: skip
def test_missing_tensor_at_end_of_stream(recovered, stream, message):
    assert_fails_closed(Stream(stream()), message, recovered)


@pytest.mark.parametrize("version", [0, -1])
def test_version_that_does_not_advance(recovered, version):
    message = f"policy version {version} of the end-of-stream record does not advance past"
    assert_fails_closed(Stream(records(version=version)), message, recovered)


def test_no_generation_while_a_refit_is_under_way():
    rollout, refused = engine(seed=0), []

    def generate_midway(records):
        for i, record in enumerate(records):
            if i == len(records) // 2:
                with pytest.raises(RuntimeError, match="a refit from policy version 0 is in"):
                    rollout.generate(PROMPTS, GREEDY)
                refused.append(i)
            yield record

    RefitReceiver(rollout).receive(generate_midway(records()))
    assert refused and rollout.policy_version == 1
    rollout.generate(PROMPTS, GREEDY)


def test_values_that_overflow_the_engines_dtype():
    # 3.4e38 is finite in the FP32 trainer and rounds to inf in a BF16 engine: checked where
    # the values land, in the engine's dtype. Every non-finite weight is named at once.
    rollout = Engine(packed_twin(qat_model(PRECISION, dtype=torch.bfloat16), PRECISION), ENGINE)
    stream = replaced(records(), "layers.1.mlp.experts.w13", poison((6, 0, 0), 3.4e38))
    stream = replaced(stream, "norm.weight", poison(0, -3.4e38))
    with pytest.raises(RefitError) as err:
        RefitReceiver(rollout).receive(stream)
    assert str(err.value) == (
        "non-finite weights: layers.1.mlp.experts.w13: non-finite values in experts [6]; "
        "norm.weight: 1 non-finite values of 64"
    )
    assert rollout.policy_version == 0 and "norm.weight" in rollout.invalid
