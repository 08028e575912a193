"""Shared by every test folder. pytest puts this directory on ``sys.path`` (it holds this
conftest and no ``__init__.py``), so tests import `assertions` (one way to compare NVFP4 tensors
and site records) and `tiny_models` (the one tiny-model fixture) from here."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """The tiny models of the suite issue thousands of small ops; on a shared CPU, several
    OpenMP threads spin against other processes and run 5-30x slower than one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
