"""The core engine on CPU: split, buckets, padding, static buffers and replay semantics (graphs emulated)."""

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import GateModel, ToyModel

import piecegraph
from piecegraph.ops.split import split_op_names
from piecegraph.trace.split import split_graph

SIZES = (2, 4, 8)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _call(model, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g, dtype=dtype)
    pos = torch.arange(n)
    with piecegraph.forward_context({"n": n}), torch.no_grad():
        return model(x, pos), (x, pos)


@pytest.fixture(scope="module")
def toy():
    return ToyModel(layers=2).eval()


def test_split_one_piece_per_layer_boundary(toy):
    gm = torch.fx.symbolic_trace(toy)
    split_gm, infos = split_graph(gm, split_op_names())
    kinds = [info.is_split for info in infos]
    assert kinds == [False, True, False, True, False]  # layers + 1 pieces around the 2 split ops
    x, pos = torch.randn(5, 16), torch.arange(5)
    with piecegraph.forward_context({"n": 5}), torch.no_grad():
        torch.testing.assert_close(split_gm(x, pos), toy(x, pos))


def test_split_without_split_ops_is_one_piece(toy):
    _, infos = split_graph(torch.fx.symbolic_trace(toy), frozenset())
    assert len(infos) == 1 and not infos[0].is_split


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_none_mode_equals_eager_inside_between_and_above_buckets(toy, compiler):
    graphed = piecegraph.compile(toy, mode="none", compiler=compiler, capture_sizes=SIZES)
    for n in (4, 3, 1, 8, 13):
        out, (x, pos) = _call(graphed, n, seed=n)
        ref, _ = _call(toy, n, seed=n)
        assert out.shape == ref.shape
        assert _rel(out, ref) < 1e-5
    stats = graphed.stats()
    assert stats["pieces"] == 3 and stats["split_ops"] == 2 and stats["sizes"] == []


def test_piecewise_replay_equals_eager_and_counts(toy):
    graphed = piecegraph.compile(toy, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    for n in (3, 1, 8, 4, 3, 2, 11, 7):
        out, _ = _call(graphed, n, seed=10 + n)
        ref, _ = _call(toy, n, seed=10 + n)
        assert _rel(out, ref) < 1e-5, n
    stats = graphed.stats()
    assert stats["sizes"] == [2, 4, 8]
    assert set(stats["capture_s"]) == {2, 4, 8}
    assert stats["replays"] == 4 and stats["fallbacks"] == 1  # 11 > 8 ran without a graph


def test_pad_rows_poisoned_with_nan_do_not_reach_real_rows(toy):
    graphed = piecegraph.compile(toy, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    _call(graphed, 8)  # capture 8
    for buf in graphed.runner.buffers:
        if buf.is_floating_point():
            buf.fill_(float("nan"))
    out, _ = _call(graphed, 5, seed=3)  # replays size 8 with 3 pad rows
    ref, _ = _call(toy, 5, seed=3)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5


def test_full_mode_pads_context_tensors_and_rejects_changed_host_fields():
    model = GateModel().eval()
    graphed = piecegraph.compile(model, mode="full", compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    for n in (3, 4, 3, 6):
        x, scale = torch.randn(n, 16), torch.rand(n)
        with piecegraph.forward_context({"scale": scale, "tag": "decode"}), torch.no_grad():
            assert _rel(graphed(x), model(x)) < 1e-5
    assert graphed.stats()["pieces"] == 1 and graphed.stats()["replays"] == 2
    with piecegraph.forward_context({"scale": torch.rand(3), "tag": "prefill"}):
        with pytest.raises(ValueError, match="'tag' changed since size 4"):
            graphed(torch.randn(3, 16))


def test_graph_replay_reads_static_buffers_not_the_callers_tensors(toy):
    graphed = piecegraph.compile(toy, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    first, (x, pos) = _call(graphed, 4, seed=1)
    x.fill_(1e6)  # the caller's tensor is not what the graph reads
    second, _ = _call(graphed, 4, seed=1)
    assert torch.equal(first, second)


def test_views_of_graph_memory_when_copy_outputs_is_false(toy):
    graphed = piecegraph.compile(toy, compiler="eager", capture_sizes=SIZES, emulate_graphs=True, copy_outputs=False)
    _call(graphed, 4, seed=1)
    first, _ = _call(graphed, 4, seed=1)
    kept = first.clone()
    _call(graphed, 4, seed=2)
    assert not torch.equal(first, kept)  # overwritten by the next call, as documented


def test_torch_compile_backend_entry_point(toy):
    compiled = torch.compile(
        toy, backend="piecegraph", dynamic=True,
        options={"compiler": "eager", "capture_sizes": SIZES, "emulate_graphs": True},
    )
    for n in (3, 5, 8, 20):
        out, _ = _call(compiled, n, seed=n)
        ref, _ = _call(toy, n, seed=n)
        assert _rel(out, ref) < 1e-5


def test_bad_inputs_get_errors_that_name_the_argument(toy):
    graphed = piecegraph.compile(toy, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    _call(graphed, 4)
    with piecegraph.forward_context({"n": 4}):
        with pytest.raises(ValueError, match="input x is torch.float64"):
            graphed(torch.randn(4, 16, dtype=torch.float64), torch.arange(4))
        with pytest.raises(ValueError, match="input x has rank 3"):
            graphed(torch.randn(4, 16, 1), torch.arange(4))
        with pytest.raises(ValueError, match="input x has shape"):
            graphed(torch.randn(4, 17), torch.arange(4))
        with pytest.raises(ValueError, match="disagree on the token count"):
            graphed(torch.randn(4, 16), torch.arange(3))
        with pytest.raises(TypeError, match="pos"):
            graphed(torch.randn(4, 16))


def test_replaced_parameter_is_detected_and_recaptured(toy):
    model = ToyModel(layers=2, seed=5).eval()
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    _call(graphed, 4, seed=1)
    model.blocks[1].weight = torch.nn.Parameter(torch.randn(16, 16))  # a new object
    out, _ = _call(graphed, 4, seed=1)
    ref, _ = _call(model, 4, seed=1)
    assert _rel(out, ref) < 1e-5
    model.blocks[2].weight.data = torch.randn(16, 16)  # same object, new memory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = _call(graphed, 4, seed=1)
    ref, _ = _call(model, 4, seed=1)
    assert _rel(out, ref) < 1e-5
    assert any("moved since size 4 was captured" in str(w.message) for w in caught)


def test_cpu_inputs_without_emulation_fall_back_to_no_graphs(toy):
    graphed = piecegraph.compile(toy, compiler="eager", capture_sizes=SIZES)
    with pytest.warns(UserWarning, match="without graphs"):
        out, _ = _call(graphed, 3)
    ref, _ = _call(toy, 3)
    assert _rel(out, ref) < 1e-5
    assert graphed.stats()["mode"] == "none"


@settings(max_examples=25, deadline=None)
@given(n=st.integers(min_value=1, max_value=12), seed=st.integers(0, 2**16))
def test_any_token_count_matches_eager(toy_graphed, n, seed):
    out, _ = _call(toy_graphed, n, seed=seed)
    ref, _ = _call(toy_graphed.model, n, seed=seed)
    assert _rel(out, ref) < 1e-5


@pytest.fixture(scope="module")
def toy_graphed(toy):
    return piecegraph.compile(toy, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="mode='fast'"):
        piecegraph.Config(mode="fast")
    with pytest.raises(ValueError, match="capture_sizes"):
        piecegraph.Config(capture_sizes=(0, 4))
    with pytest.raises(ValueError, match="max_tokens"):
        piecegraph.Config(max_tokens=0)
    with pytest.raises(TypeError, match=r"pool=\(0, 1\) must be a piecegraph.GraphPool"):
        piecegraph.Config(pool=(0, 1))  # a raw pool handle: the models would share no memory
    assert "unused" in repr(piecegraph.Config(pool=piecegraph.GraphPool()).pool)  # nothing made before capture
    assert piecegraph.default_capture_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert piecegraph.Config(max_tokens=40).sizes == (1, 2, 4, 8, 16, 32, 40)


def test_token_inputs_with_unrelated_symbols_share_one_bucket():
    from toy import TwoTokenInputs

    model = TwoTokenInputs().eval()
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    for n in (3, 4, 1, 9):
        x, w = torch.randn(n, 16), torch.rand(n)
        with torch.no_grad():
            assert _rel(graphed(x, w), model(x, w)) < 1e-5
    with pytest.raises(ValueError, match="disagree on the token count"):
        graphed(torch.randn(3, 16), torch.rand(4))


def test_capture_all_sizes_largest_first_then_recapture(toy):
    graphed = piecegraph.compile(toy, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)

    def make_inputs(n):
        return (torch.randn(n, 16), torch.arange(n)), {"n": n}

    seconds = graphed.capture(make_inputs)
    assert list(graphed.runner.capture_s) == [8, 4, 2] and set(seconds) == {2, 4, 8}
    out, _ = _call(graphed, 3, seed=4)
    assert graphed.stats()["replays"] == 1
    graphed.recapture()
    assert graphed.stats()["sizes"] == []
    again, _ = _call(graphed, 3, seed=4)
    assert torch.equal(out, again) and graphed.stats()["sizes"] == [4]


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("PIECEGRAPH_MODE", "none")
    monkeypatch.setenv("PIECEGRAPH_COMPILER", "eager")
    config = piecegraph.Config.from_env(max_tokens=32)
    assert (config.mode, config.compiler, config.max_tokens) == ("none", "eager", 32)
    monkeypatch.setenv("PIECEGRAPH_MODE", "fastest")
    with pytest.raises(ValueError, match="mode='fastest'"):
        piecegraph.Config.from_env()
