"""One side of the two-process refit (`test_refit_distributed.py`): rank 0 holds the engine, rank 1
the trainer, joined by a process group of BACKEND.

    python refit_dist_worker.py BACKEND RANK STORE_FILE RESULT_FILE

gloo: both sides on the CPU, the tiny models in FP32. nccl: rank r on cuda:r
(``torch.cuda.set_device``), the tiny models in BF16 there, so the engine quantizes at load with
the Triton kernels; every transfer lives on the rank's own GPU.

Both sides run the same scenarios in order and each writes what it saw to RESULT_FILE (JSON),
or the traceback of what went wrong. Over gloo the trainer side writes before its last scenario,
in which it dies (``os._exit(DIED)``) part way through a stream. That scenario is gloo's only:
gloo reports the closed connection at once, NCCL gives no notice of a dead peer (the engine's
wait would end at the transport's timeout, after which PyTorch aborts the communicator and may
take the engine's process down with it).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # refit_checks; tiny_models and assertions

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from refit_checks import (  # noqa: E402
    GREEDY,
    PROMPTS,
    assert_engine_holds,
    assert_generates_like,
    engine,
    trainer,
)

from fp4rl.refit import (  # noqa: E402
    DistributedTransport,
    NamedTensor,
    RefitError,
    RefitReceiver,
    refit_records,
)

# Every transfer; the test's own deadline is longer. Over NCCL the trainer also waits while the
# engine compiles its Triton kernels on first use (a cold cache takes tens of seconds).
TIMEOUT = {"gloo": timedelta(seconds=20), "nccl": timedelta(seconds=180)}
DIED = 17  # the trainer's exit status when it dies on purpose
CRASH_AFTER = DIE_AFTER = 7  # records sent before the trainer fails
# Greedy logprobs after a refit vs an engine built fresh: bitwise on the CPU; on the GPU within
# what a GEMM whose reduction order is not fixed allows (as in test_refit_gpu.py).
LOGPROB_ATOL = {"gloo": 0.0, "nccl": 1e-3}


def placement(backend: str, rank: int) -> dict:
    """Where and in what dtype rank ``rank``'s tiny models live (`refit_checks` ``where``)."""
    if backend == "nccl":
        return dict(dtype=torch.bfloat16, device=torch.device("cuda", rank))
    return {}


def arriving_on(device: torch.device, records):
    """``records``, each tensor checked to have arrived on ``device`` (the engine's GPU under
    NCCL: the transport allocates there, never on the trainer's)."""
    for record in records:
        if isinstance(record, NamedTensor):
            assert record.tensor.device == device, f"{record.name} on {record.tensor.device}"
        yield record


def failed_refit(receiver: RefitReceiver, transport) -> dict:
    """Receive one stream that must fail: what the refit and then `generate` said."""
    try:
        receiver.receive(transport.receive())
        return {"refit": "applied"}
    except RefitError as err:
        seen = {"refit": str(err)}
    try:
        receiver.engine.generate(PROMPTS, GREEDY)
        seen["generate"] = "generated"
    except RuntimeError as err:
        seen["generate"] = str(err)
    seen["version"] = receiver.engine.policy_version
    return seen


def engine_side(transport, backend: str) -> dict:
    where, atol = placement(backend, 0), LOGPROB_ATOL[backend]
    rollout, results = engine(seed=0, **where), {}
    receiver, device = RefitReceiver(rollout), where.get("device", torch.device("cpu"))
    for version in (1, 2):  # fp4rl names, then hub names, of trainer(seed=version)
        receiver.receive(arriving_on(device, transport.receive()))
        assert_engine_holds(rollout, trainer(seed=version, **where))
    assert_generates_like(rollout, engine(seed=2, **where), atol=atol)
    results["good"] = rollout.policy_version
    results["crash"] = failed_refit(receiver, transport)
    results["bad_shape"] = failed_refit(receiver, transport)
    if backend == "gloo":
        results["death"] = failed_refit(receiver, transport)
    # The engine comes back with a good refit from a trainer in this process.
    receiver.receive(refit_records(trainer(seed=3, **where), 3))
    assert_generates_like(rollout, engine(seed=3, **where), atol=atol)
    results["recovered"] = rollout.policy_version
    return results


def stop_after(records, count: int, stop):
    for i, record in enumerate(records):
        if i == count:
            stop()
        yield record


def trainer_side(transport, backend: str, result_file: Path) -> None:
    where, results = placement(backend, 1), {}
    for version, names in ((1, "fused"), (2, "hf")):
        transport.send(refit_records(trainer(seed=version, **where), version, names=names))

    def crash():
        raise RuntimeError("trainer lost its optimizer state")

    try:
        transport.send(stop_after(refit_records(trainer(seed=9, **where), 3), CRASH_AFTER, crash))
        results["crash"] = "returned"
    except RuntimeError as err:
        results["crash"] = f"raised: {err}"
    # A tensor of the wrong shape early on: the engine refuses it and must read the rest.
    bad = list(refit_records(trainer(seed=9, **where), 3))
    bad[0] = NamedTensor(bad[0].name, bad[0].tensor[:3])
    transport.send(bad)
    results["bad_shape"] = "returned"
    result_file.write_text(json.dumps(results))
    if backend != "gloo":
        return
    dying = stop_after(
        refit_records(trainer(seed=9, **where), 3), DIE_AFTER, lambda: os._exit(DIED)
    )
    transport.send(dying)
    raise AssertionError("the trainer outlived its death")


def main(backend: str, rank: int, store: str, result_file: Path) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # before the transport takes the current device as its own
    elif backend != "gloo":
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    timeout = TIMEOUT[backend]
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=2, timeout=timeout
    )
    transport = DistributedTransport(1 - rank, timeout=timeout)
    try:
        if rank == 0:
            result_file.write_text(json.dumps(engine_side(transport, backend)))
        else:
            trainer_side(transport, backend, result_file)
    except BaseException:
        result_file.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
