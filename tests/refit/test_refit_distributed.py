"""The refit across processes: an engine process and a trainer process over gloo (CPU).

Claims: the engine receives over `DistributedTransport` exactly what an in-process refit gives
(bitwise, fp4rl and hub names); a trainer that raises mid-stream sends an `Abort` and gets its
exception back; a tensor the engine refuses does not leave the trainer blocked (the engine reads
the rest of the stream); a trainer that dies mid-stream is detected at once (gloo reports the
closed connection; every wait also has a timeout). In each failure `generate` refuses to run and
a later good refit recovers the engine. The two processes run the scenarios of
`refit_dist_worker.py` once, in about 10 s, under a 90 s deadline.
"""

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from refit_dist_worker import CRASH_AFTER, DIE_AFTER, DIED

WORKER = Path(__file__).with_name("refit_dist_worker.py")
DEADLINE_S = 90


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    """``(engine's results, trainer's results)`` after both processes have ended."""
    tmp = tmp_path_factory.mktemp("refit-dist")
    with contextlib.ExitStack() as logs:
        procs = []
        for rank in (0, 1):
            log = logs.enter_context(open(tmp / f"rank{rank}.log", "w"))
            args = (rank, tmp / "store", tmp / f"{rank}.json")
            command = [sys.executable, str(WORKER), *map(str, args)]
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        end = time.monotonic() + DEADLINE_S
        try:
            codes = [p.wait(timeout=max(end - time.monotonic(), 1)) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            codes = None
        for p in procs:
            p.wait()
    output = "\n".join(f"--- rank {r}:\n" + (tmp / f"rank{r}.log").read_text() for r in (0, 1))
    assert codes == [0, DIED], f"exit codes {codes} (None: past the deadline)\n{output}"
    results = [json.loads((tmp / f"{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        assert "error" not in r, r.get("error", "") + output
    return results


def test_refit_across_processes_equals_the_trainers_weights(sides):
    engine, _ = sides
    assert engine["good"] == 2  # worker: bitwise checks after each refit, then generation
    assert engine["recovered"] == 3


def test_sender_exception_mid_stream_is_sent_as_abort(sides):
    engine, trainer = sides
    assert trainer["crash"] == "raised: trainer lost its optimizer state"
    seen = engine["crash"]
    assert seen["refit"].startswith(f"the sender aborted after {CRASH_AFTER} tensors (last: ")
    assert seen["refit"].endswith("RuntimeError: trainer lost its optimizer state")
    assert seen["generate"].startswith("engine weights are not usable: the refit from policy")
    assert "the sender aborted" in seen["generate"] and seen["version"] == 2


def test_refused_tensor_is_drained_so_the_sender_finishes(sides):
    engine, trainer = sides
    assert trainer["bad_shape"] == "returned"
    seen = engine["bad_shape"]
    assert seen["refit"] == "embed_tokens.weight: shape (3, 64), model has (128, 64)"
    assert "embed_tokens.weight: shape" in seen["generate"] and seen["version"] == 2


def test_sender_death_mid_stream_is_detected(sides):
    engine, _ = sides
    seen = engine["death"]
    assert seen["refit"].startswith(f"the sender failed after {DIE_AFTER} tensors (last: ")
    assert "the sender failed" in seen["generate"] and seen["version"] == 2
