import pytest
import torch


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """The tiny models here issue thousands of small ops; on a shared CPU, several OpenMP
    threads spin against other processes and run 5-30x slower than one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
