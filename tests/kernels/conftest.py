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
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    # If a test collected earlier imported the kernels compiled-style, import them afresh.
    for name in [n for n in sys.modules if n == "fp4rl.kernels" or n.startswith("fp4rl.kernels.")]:
        del sys.modules[name]
    if "fp4rl" in sys.modules:
        vars(sys.modules["fp4rl"]).pop("kernels", None)


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
