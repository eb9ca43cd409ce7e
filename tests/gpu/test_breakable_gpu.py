"""Breakable capture, auto's fallback and verify on a GPU."""

import warnings

import pytest
import torch

import piecegraph
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.graphs.breakable import BreakableCaptureError
from piecegraph.models import QWEN2_5_0_5B, Decoder

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
    cache = KVCache.for_sequences(model.config, 128, 64, dtype=torch.bfloat16, device="cuda")
    cache.reserve((i, 21) for i in range(128))
    for n in (1, 3, 16, 40, 64, 100, 3):
        meta = AttentionMetadata.for_decode(cache, [(i, 20) for i in range(n)])
        positions = meta.positions
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


@piecegraph.no_graph
def scale_by_host_max(x):
    return x * x.abs().max().item()  # a host sync: cannot be captured, must run again at every replay


class HostSync(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.b(scale_by_host_max(torch.tanh(self.a(x))))


def test_no_graph_function_runs_eagerly_between_breakable_segments():
    model = HostSync().cuda().eval()
    graphed = piecegraph.compile(model, mode="breakable", capture_sizes=(4, 8))
    for n in (3, 8, 8, 4, 2):
        x = torch.randn(n, 32, device="cuda") * (n + 1)  # a different host scale every call
        with torch.no_grad():
            torch.testing.assert_close(graphed(x), model(x))
    stats = graphed.stats()
    assert stats["sizes"] == [4, 8] and stats["replays"] >= 3


class Mlp(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))) + x


def test_two_models_share_one_graph_pool_and_replay_in_turn():
    torch.manual_seed(0)
    models = [Mlp(512).cuda().eval(), Mlp(1024).cuda().eval()]
    sizes = (32, 64, 128, 256)

    def captured(pool):
        graphed = [piecegraph.compile(m, mode="full", capture_sizes=sizes, pool=pool) for m in models]
        with torch.no_grad():
            for g, m in zip(graphed, models):
                g.capture(lambda n, m=m: ((torch.randn(n, m.a.in_features, device="cuda"),), None))
        return graphed

    private = sum(g.stats()["pool_bytes"] for g in captured(None))
    shared = captured(piecegraph.GraphPool())
    shared_bytes = shared[0].stats()["pool_bytes"]
    assert shared_bytes == shared[1].stats()["pool_bytes"]  # one pool, reported by both
    assert shared_bytes < private, (shared_bytes, private)  # the second model reused the first's freed blocks
    for n in (5, 256, 17, 64):
        xs = [torch.randn(n, m.a.in_features, device="cuda") for m in models]
        with torch.no_grad():
            outs = [g(x) for g, x in zip(shared, xs)]  # the second replay reuses the first's pool memory
            for out, m, x in zip(outs, models, xs):
                torch.testing.assert_close(out, m(x), rtol=1e-3, atol=1e-3)
