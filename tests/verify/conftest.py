import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Bounds of these small nets run fastest on one thread, and two threads on a loaded 2-core machine make
    every op wait for the other (measured: α-CROWN 0.07 s → 3.7 s)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
