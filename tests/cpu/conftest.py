"""Fixtures the CPU tests share."""

import importlib.util
import sys
from pathlib import Path

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


FAKE_FLASHINFER = Path(__file__).parent / "fakes" / "fake_flashinfer.py"


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """``fakes/fake_flashinfer.py`` imported as ``flashinfer`` for one test (FlashInfer's kernels need a GPU);
    a module uses it for each of its tests with ``pytestmark = pytest.mark.usefixtures("fake_flashinfer")``."""
    spec = importlib.util.spec_from_file_location("flashinfer", FAKE_FLASHINFER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module
