"""Breakable capture, auto's fallback and verify on a GPU."""

import warnings

import pytest
import torch

import piecegraph
from piecegraph.graphs.breakable import BreakableCaptureError
from piecegraph.models import QWEN2_5_0_5B, AttentionMetadata, Decoder, KVCache

pytestmark = pytest.mark.gpu

_lib = torch.library.Library("pg_gpu_test", "DEF")
_lib.define("host_scale(Tensor x, Tensor w) -> Tensor")
_lib.define("fresh_split(Tensor x) -> Tensor")
# Reads a CPU tensor on the host: no CUDA sync, so capture succeeds, and the value is baked into the graph.
_lib.impl("host_scale", lambda x, w: x * float(w[0]), "CUDA")
_lib._register_fake("host_scale", lambda x, w: torch.empty_like(x))
_lib.impl("fresh_split", lambda x: x * 2, "CUDA")
_lib._register_fake("fresh_split", lambda x: torch.empty_like(x))
piecegraph.split_op("pg_gpu_test::fresh_split")


class Untraceable(torch.nn.Module):
    """A graph break in the forward: Dynamo (fullgraph) refuses it, stream capture does not mind."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


class HostRead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)

    def forward(self, x, w_cpu):
        return self.a(torch.ops.pg_gpu_test.host_scale(x, w_cpu))


class FreshSplit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.a(torch.ops.pg_gpu_test.fresh_split(self.a(x)))


def test_auto_falls_back_to_breakable_graphs_for_an_untraceable_model():
    model = Untraceable().cuda().eval()
    graphed = piecegraph.compile(model, mode="auto", capture_sizes=(4, 8, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (3, 8, 5, 12):
            x = torch.randn(n, 64, device="cuda")
            with torch.no_grad():
                torch.testing.assert_close(graphed(x), model(x))
    assert any("breakable CUDA graphs" in str(w.message) for w in caught), [str(w.message) for w in caught]
    stats = graphed.stats()
    assert stats["mode"] == "breakable" and stats["sizes"] == [4, 8, 16] and stats["replays"] == 1


def test_breakable_decoder_equals_eager_across_buckets():
    model = Decoder.random(QWEN2_5_0_5B.replace(num_layers=4), seed=0, dtype=torch.bfloat16, device="cuda").eval()
    graphed = piecegraph.compile(model, mode="breakable", capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    cache = KVCache(model.config, num_slots=128, max_len=64, dtype=torch.bfloat16, device="cuda")
    for n in (1, 3, 16, 40, 64, 100, 3):
        slots = torch.arange(1, n + 1, device="cuda")
        positions = torch.full((n,), 20, device="cuda")
        meta = AttentionMetadata.for_decode(cache, slots, positions)
        ids = torch.randint(0, model.config.vocab_size, (n,), device="cuda")
        with piecegraph.forward_context(meta), torch.no_grad():
            expected = model(ids, positions)
            got = graphed(ids, positions)
        rel = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
        assert rel < 1e-2, (n, rel)
    stats = graphed.stats()
    assert stats["sizes"] == [1, 4, 16, 64] and stats["fallbacks"] == 1 and stats["replays"] == 2


def test_verify_drops_a_size_whose_graph_baked_a_host_value():
    model = HostRead().cuda().eval()
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=(4, 8), verify=True)
    x, w = torch.randn(3, 16, device="cuda"), torch.tensor([1.0, 2.0, 3.0])
    with pytest.warns(UserWarning, match="size 4 replayed on fresh inputs differs"):
        out = graphed(x, w)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x, w))
    assert 4 in graphed.stats()["dropped_sizes"]
    w2 = torch.tensor([5.0, 1.0, 1.0])
    with torch.no_grad():
        torch.testing.assert_close(graphed(x, w2), model(x, w2))  # runs without the dropped graph


def test_breakable_split_op_returning_a_fresh_tensor_is_a_clear_error():
    model = FreshSplit().cuda().eval()
    graphed = piecegraph.compile(model, mode="breakable", capture_sizes=(4,))
    with pytest.raises(BreakableCaptureError, match="returned a new tensor"):
        graphed(torch.randn(3, 16, device="cuda"))
