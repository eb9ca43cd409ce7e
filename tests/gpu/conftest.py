import pytest
import torch


@pytest.fixture
def restore_jit_state():
    """After the test, what a JIT test may have changed is undone: the FlashInfer adapter uninstalled, frozen
    caches unfrozen, Dynamo's compiled code dropped."""
    yield
    import piecegraph
    from piecegraph.adapters import flashinfer as adapter

    adapter.uninstall()
    piecegraph.unfreeze()
    torch._dynamo.reset()
