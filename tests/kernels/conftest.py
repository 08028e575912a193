"""Run the kernel tests on the GPU when there is one, else in Triton's CPU interpreter.

Triton decides interpreted-or-compiled when a function is decorated with `@triton.jit`, i.e.
when `fp4rl.kernels` is first imported, so TRITON_INTERPRET must be set before that: this file
runs before the test modules here are imported. Without CUDA the tests use small sizes (the
interpreter runs each program in numpy) and `@pytest.mark.gpu` tests are skipped.
"""

import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    if "fp4rl.kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "fp4rl.kernels was imported before tests/kernels/conftest.py could set "
            "TRITON_INTERPRET=1; run with TRITON_INTERPRET=1 in the environment"
        )
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> str:
    return "cuda" if ON_GPU else "cpu"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    # The interpreter evaluates masked-off and dead-block lanes too, where NaN scales make NaN.
    quiet = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
    for item in items:
        if ON_GPU or not str(item.fspath).startswith(here):
            continue
        item.add_marker(quiet)
        if "gpu" in item.keywords:
            item.add_marker(skip)
