"""One side of the two-process refit (`test_refit_distributed.py`): rank 0 holds the engine, rank 1
the trainer, joined by a gloo process group on the CPU.

    python refit_dist_worker.py RANK STORE_FILE RESULT_FILE

Both sides run the same scenarios in order and each writes what it saw to RESULT_FILE (JSON),
or the traceback of what went wrong. The trainer side writes before its last scenario, in which
it dies (``os._exit(DIED)``) part way through a stream.
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

TIMEOUT = timedelta(seconds=20)  # every transfer; the test's own deadline is longer
DIED = 17  # the trainer's exit status when it dies on purpose
CRASH_AFTER = DIE_AFTER = 7  # records sent before the trainer fails


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


def engine_side(transport) -> dict:
    rollout, results = engine(seed=0), {}
    receiver = RefitReceiver(rollout)
    for version in (1, 2):  # fp4rl names, then hub names, of trainer(seed=version)
        receiver.receive(transport.receive())
        assert_engine_holds(rollout, trainer(seed=version))
    assert_generates_like(rollout, engine(seed=2))
    results["good"] = rollout.policy_version
    results["crash"] = failed_refit(receiver, transport)
    results["bad_shape"] = failed_refit(receiver, transport)
    results["death"] = failed_refit(receiver, transport)
    # The engine comes back with a good refit from a trainer in this process.
    receiver.receive(refit_records(trainer(seed=3), 3))
    assert_generates_like(rollout, engine(seed=3))
    results["recovered"] = rollout.policy_version
    return results


def stop_after(records, count: int, stop):
    for i, record in enumerate(records):
        if i == count:
            stop()
        yield record


def trainer_side(transport, result_file: Path) -> None:
    results = {}
    for version, names in ((1, "fused"), (2, "hf")):
        transport.send(refit_records(trainer(seed=version), version, names=names))

    def crash():
        raise RuntimeError("trainer lost its optimizer state")

    try:
        transport.send(stop_after(refit_records(trainer(seed=9), 3), CRASH_AFTER, crash))
        results["crash"] = "returned"
    except RuntimeError as err:
        results["crash"] = f"raised: {err}"
    # A tensor of the wrong shape early on: the engine refuses it and must read the rest.
    bad = list(refit_records(trainer(seed=9), 3))
    bad[0] = NamedTensor(bad[0].name, bad[0].tensor[:3])
    transport.send(bad)
    results["bad_shape"] = "returned"
    result_file.write_text(json.dumps(results))
    transport.send(stop_after(refit_records(trainer(seed=9), 3), DIE_AFTER, lambda: os._exit(DIED)))
    raise AssertionError("the trainer outlived its death")


def main(rank: int, store: str, result_file: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=TIMEOUT
    )
    transport = DistributedTransport(1 - rank, timeout=TIMEOUT)
    try:
        if rank == 0:
            result_file.write_text(json.dumps(engine_side(transport)))
        else:
            trainer_side(transport, result_file)
    except BaseException:
        result_file.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
