"""The refit across processes: an engine process and a trainer process, over gloo on the CPU
and, where the machine has two CUDA GPUs, over NCCL (engine on cuda:0, trainer on cuda:1, the
tiny models in BF16, quantized at load by the Triton kernels).

Claims, over both backends: the engine receives over `DistributedTransport` exactly what an
in-process refit gives (codes and scales bitwise equal to the `fp4rl.fp4` reference of the
trainer's weights, fp4rl and hub names); a trainer that raises mid-stream sends an `Abort` and
gets its exception back; a tensor the engine refuses does not leave the trainer blocked (the
engine reads the rest of the stream). Over gloo only: a trainer that dies mid-stream is detected
at once (gloo reports the closed connection). NCCL gives no such notice, so that scenario is not
run there: the engine's wait would end at the transport's timeout, PyTorch would then abort the
communicator and, by its default NCCL error handling, may end the engine's process. In each
failure `generate` refuses to run and a later good refit recovers the engine.

The two processes run the scenarios of `refit_dist_worker.py` once per backend: over gloo in
about 10 s, under a 90 s deadline; over NCCL under a longer one (CUDA, NCCL and Triton start
cold). On a 2-GPU machine: ``python -m pytest -q tests/refit/test_refit_distributed.py``
(``-m gpu`` for the NCCL run alone).
"""

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from refit_dist_worker import CRASH_AFTER, DIE_AFTER, DIED

WORKER = Path(__file__).with_name("refit_dist_worker.py")
DEADLINE_S = {"gloo": 90, "nccl": 480}
EXIT_CODES = {"gloo": [0, DIED], "nccl": [0, 0]}  # the trainer dies on purpose over gloo only
BACKENDS = [
    "gloo",
    pytest.param(
        "nccl",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
        ],
    ),
]


def run_sides(backend: str, tmp: Path) -> list[dict]:
    """``[engine's results, trainer's results]`` after both processes have ended."""
    with contextlib.ExitStack() as logs:
        procs = []
        for rank in (0, 1):
            log = logs.enter_context(open(tmp / f"rank{rank}.log", "w"))
            args = (backend, rank, tmp / "store", tmp / f"{rank}.json")
            command = [sys.executable, str(WORKER), *map(str, args)]
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        end = time.monotonic() + DEADLINE_S[backend]
        try:
            codes = [p.wait(timeout=max(end - time.monotonic(), 1)) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            codes = None
        for p in procs:
            p.wait()
    output = "\n".join(f"--- rank {r}:\n" + (tmp / f"rank{r}.log").read_text() for r in (0, 1))
    assert codes == EXIT_CODES[backend], f"exit codes {codes} (None: past the deadline)\n{output}"
    results = [json.loads((tmp / f"{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        assert "error" not in r, r.get("error", "") + output
    return results


@pytest.fixture(scope="module")
def gloo_sides(tmp_path_factory):
    return run_sides("gloo", tmp_path_factory.mktemp("refit-gloo"))


@pytest.fixture(scope="module")
def nccl_sides(tmp_path_factory):
    return run_sides("nccl", tmp_path_factory.mktemp("refit-nccl"))


@pytest.fixture(params=BACKENDS)
def sides(request):
    return request.getfixturevalue(f"{request.param}_sides")


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


def test_sender_death_mid_stream_is_detected(gloo_sides):
    engine, _ = gloo_sides
    seen = engine["death"]
    assert seen["refit"].startswith(f"the sender failed after {DIE_AFTER} tensors (last: ")
    assert "the sender failed" in seen["generate"] and seen["version"] == 2
