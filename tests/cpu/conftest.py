"""Fixtures the CPU tests share."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Two shared cores: torch's two OpenMP threads spin against other processes and make steps 10x slower. Use
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
