"""freeze() under a real CUDA graph capture: a miss is a clear error, and the capture it stopped leaves no trace."""

import functools

import pytest
import torch

from piecegraph.ops import FrozenCacheMiss, freeze, unfreeze

pytestmark = pytest.mark.gpu


def test_frozen_loader_miss_inside_capture_raises_and_the_next_capture_works():
    built = []

    @functools.lru_cache(maxsize=None)
    def get_module(kind: str):
        built.append(kind)
        return {"double": lambda t: t * 2, "triple": lambda t: t * 3}[kind]

    get_module("double")
    frozen = freeze(get_module)
    try:
        x = torch.randn(64, device="cuda")
        torch.cuda.synchronize()
        with pytest.raises(FrozenCacheMiss, match=r"get_module\('triple'\).*CUDA graph capture"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                frozen("triple")(x)
        assert built == ["double"]  # the real loader never ran inside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = frozen("double")(x)
        x.copy_(torch.arange(64, device="cuda", dtype=torch.float32))
        graph.replay()
        torch.testing.assert_close(out, x * 2)
        assert frozen("triple")(x).equal(x * 3) and built == ["double", "triple"]  # eager: builds and keeps it
    finally:
        unfreeze()
