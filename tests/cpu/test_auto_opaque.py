"""Automatic opaque (mode="auto", Config(auto_opaque=...)): a JIT library listed in no adapter (tests/cpu/
jitlib_auto: decorated public functions, functools.cache loaders that stat, run a subprocess, lock and build a
class at call time; Literal, Enum, List[Tensor], out=, an in-place writer, no hints) is wrapped function by
function, its fakes inferred by probing, and the model traces piecewise with Inductor pieces, equal to eager."""

import gc
import warnings

import jitlib_auto
import pytest
import torch
from jitlib_auto import bmm  # `from lib import fn`: routed in this module's globals too

import piecegraph
from piecegraph.graphs.fallback import TraceBreakError
from piecegraph.ops.auto_opaque import AutoOpaqueUnseen, record_calls, route, wrap
from piecegraph.ops.opaque import is_opaque

ENTRIES = {"rms_norm", "quantize", "bmm", "act_and_mul", "concat", "add_residual_", "scale_rows"}


class Block(torch.nn.Module):
    """norm (out=) -> row quantization (Literal, tuple out) -> bmm (dtype, Literal backend) -> act (Enum) -> bmm ->
    concat (List[Tensor]) -> residual written in place -> scale (no hints); float32 throughout."""

    def __init__(self, d: int = 8, f: int = 16):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.up = torch.nn.Parameter(torch.randn(1, d, 2 * f) * 0.3)
        self.down = torch.nn.Parameter(torch.randn(1, f, d) * 0.3)

    def forward(self, x):
        h = jitlib_auto.rms_norm(x, self.w, out=torch.empty_like(x))
        q, scale = jitlib_auto.quantize(h, "row")
        u = bmm((q.float() * scale).unsqueeze(0), self.up, torch.float32)[0]
        a = jitlib_auto.act_and_mul(u, jitlib_auto.Activation.SILU)
        y = jitlib_auto.bmm(a.unsqueeze(0), self.down, torch.float32, backend="tiled")[0]
        y = jitlib_auto.concat([y[:, :4], y[:, 4:]], 0.5)
        res = x.clone()
        jitlib_auto.add_residual_(y, res)
        return jitlib_auto.scale_rows(res)


class GemmOnly(torch.nn.Module):
    def __init__(self, d: int = 8, n: int = 12):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(1, d, n))

    def forward(self, x):
        return torch.relu(jitlib_auto.bmm(x.unsqueeze(0), self.w, torch.float32)[0]) + 1


class DataDependent(torch.nn.Module):
    def forward(self, x):
        return jitlib_auto.positive_rows(x * 2)


@pytest.fixture(autouse=True)
def _unroute():
    yield
    piecegraph.unfreeze()  # puts back every routed function (and frozen loader)
    torch._dynamo.reset()


def _messages(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]


def test_auto_traces_piecewise_with_inductor_pieces_equal_to_eager():
    torch.manual_seed(0)
    model = Block().eval()
    graphed = piecegraph.compile(model, mode="auto", compiler="inductor", capture_sizes=(4, 8), emulate_graphs=True)
    inductor = sum(torch._dynamo.utils.counters["inductor"].values())
    x = torch.randn(5, 8)
    x_before = x.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = graphed(x)
    assert not _messages(caught, "does not trace with Dynamo")  # no breakable fallback
    (warning,) = _messages(caught, "now run as opaque ops")
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=0, atol=1e-6)
        for n in (3, 8, 11):  # padded, exact, above the largest size
            xn = torch.randn(n, 8)
            torch.testing.assert_close(graphed(xn), model(xn), rtol=0, atol=1e-6)
    assert torch.equal(x, x_before)  # the caller's tensor: never written by probing or recording
    stats = graphed.stats()
    assert stats["mode"] == "piecewise" and stats["sizes"] == [4, 8]
    assert sum(torch._dynamo.utils.counters["inductor"].values()) > inductor  # pieces compiled by Inductor
    assert set(stats["auto_opaque"]) == {f"jitlib_auto.{name}" for name in ENTRIES}
    for entry, line in stats["auto_opaque"].items():
        assert line.startswith(f"{entry} = piecegraph.opaque({entry}, fake=") and line in warning
    lines = stats["auto_opaque"]
    assert lines["jitlib_auto.rms_norm"].endswith('fake="like:input", mutates=(\'out\',))')
    assert "mutates=('residual',)" in lines["jitlib_auto.add_residual_"]
    assert '"shape": lambda a, b, **_: (a.shape[0], a.shape[1], b.shape[2]), "dtype": lambda dtype, **_: dtype' \
        in lines["jitlib_auto.bmm"]
    assert "input.shape[1] // 2" in lines["jitlib_auto.act_and_mul"]
    assert "sum(t.shape[1] for t in parts)" in lines["jitlib_auto.concat"]
    assert "utils.wrapper" not in warning


def test_routes_are_undone_when_the_module_is_released_and_by_unfreeze():
    model = GemmOnly().eval()
    graphed = piecegraph.compile(model, mode="auto", compiler="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphed(torch.randn(4, 8))
    assert is_opaque(jitlib_auto.bmm) and is_opaque(jitlib_auto.ops.bmm) and is_opaque(bmm)
    del graphed
    gc.collect()
    assert not is_opaque(jitlib_auto.bmm) and not is_opaque(jitlib_auto.ops.bmm) and not is_opaque(bmm)

    graphed = piecegraph.compile(model, mode="auto", compiler="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = graphed(torch.randn(6, 8))
    assert is_opaque(jitlib_auto.bmm) and out.shape == (6, 12)
    assert "jitlib_auto.bmm" in piecegraph.unfreeze()
    assert not is_opaque(jitlib_auto.bmm)


def _graphed_gemm(n: int):
    graphed = piecegraph.compile(GemmOnly().eval(), mode="auto", compiler="eager")
    x = torch.randn(n, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(graphed(x), graphed.model(x))
    return graphed


def _routed() -> bool:
    return is_opaque(jitlib_auto.bmm) and is_opaque(jitlib_auto.ops.bmm) and is_opaque(bmm)


def test_a_module_traced_through_anothers_routes_keeps_them_after_that_one_is_released():
    """Module b traces through the routes module a made (Dynamo sees the drop-in, so nothing is wrapped for b):
    releasing a must not unroute them under b; the last release does."""
    a = _graphed_gemm(4)
    b = _graphed_gemm(6)
    assert b.stats().get("auto_opaque") is None and _routed()  # b wrapped nothing itself
    del a
    gc.collect()
    assert _routed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = torch.randn(5, 8)
        torch.testing.assert_close(b(x), b.model(x))
    del b
    gc.collect()
    assert not is_opaque(jitlib_auto.bmm) and not is_opaque(bmm)


def test_a_module_released_after_unfreeze_leaves_newer_routes_alone():
    """CI once saw this: an earlier test's module, freed by the garbage collector after unfreeze() and after a
    newer module had routed the same function, put the original back under the newer module."""
    a = _graphed_gemm(4)
    piecegraph.unfreeze()
    b = _graphed_gemm(6)
    assert _routed()
    del a
    gc.collect()
    assert _routed()
    del b
    gc.collect()
    assert not is_opaque(jitlib_auto.bmm)


def test_auto_opaque_false_keeps_the_old_fallback():
    graphed = piecegraph.compile(GemmOnly().eval(), mode="auto", compiler="eager", auto_opaque=False)
    with pytest.warns(UserWarning, match="does not trace with Dynamo"):
        graphed(torch.randn(4, 8))
    assert "auto_opaque" not in graphed.stats() and not is_opaque(jitlib_auto.bmm)


def test_a_function_whose_shapes_depend_on_data_is_refused_with_the_reason():
    model = DataDependent().eval()
    graphed = piecegraph.compile(model, mode="auto", compiler="eager")
    x = torch.randn(6, 8)
    with pytest.warns(UserWarning, match="does not trace with Dynamo") as record:
        out = graphed(x)
    text = next(str(w.message) for w in record if "does not trace" in str(w.message))
    assert "jitlib_auto.positive_rows = piecegraph.opaque(jitlib_auto.positive_rows, fake=...)  # not inferred: its " \
           "output shapes depend on the data, not on the input shapes" in text
    assert torch.equal(out, model(x)) and not is_opaque(jitlib_auto.positive_rows)


def test_piecewise_with_automatic_opaque_says_why_a_function_was_not_wrapped():
    graphed = piecegraph.compile(DataDependent().eval(), mode="piecewise", compiler="eager", auto_opaque=True)
    with pytest.raises(TraceBreakError) as info:
        graphed(torch.randn(6, 8))
    head = str(info.value).split("Dynamo's error")[0]
    assert "Automatic opaque was on and could not wrap:\n  * jitlib_auto.positive_rows: its output shapes depend " \
           "on the data, not on the input shapes" in head
    assert not is_opaque(jitlib_auto.positive_rows)


def test_piecewise_raises_piecegraphs_error_naming_entry_primitive_and_fixes():
    graphed = piecegraph.compile(GemmOnly().eval(), mode="piecewise", compiler="eager")
    with pytest.raises(TraceBreakError) as info:
        graphed(torch.randn(4, 8))
    text = str(info.value)
    assert text.startswith("piecegraph: mode='piecewise' traces the model as one Dynamo graph, and the trace breaks "
                           "inside the library 'jitlib_auto': jitlib_auto.bmm (called at ")
    assert "test_auto_opaque.py:" in text and "reaches posix.getuid (filesystem, " in text
    assert 'mode="auto"' in text and "Config(auto_opaque=True)" in text
    assert ('jitlib_auto.bmm = piecegraph.opaque(jitlib_auto.bmm, fake={"shape": lambda a, b, **_: (a.shape[0], '
            'a.shape[1], b.shape[2]), "dtype": lambda dtype, **_: dtype})') in text
    assert "Dynamo's error (Unsupported):" in text and "posix.getuid" in text.split("Dynamo's error")[1]
    assert isinstance(info.value.__cause__, torch._dynamo.exc.Unsupported)
    assert not is_opaque(jitlib_auto.bmm)  # explaining wraps nothing

    graphed = piecegraph.compile(GemmOnly().eval(), mode="piecewise", compiler="eager", auto_opaque=True)
    with pytest.warns(UserWarning, match="now run as opaque ops"):
        graphed(torch.randn(4, 8))
    assert list(graphed.stats()["auto_opaque"]) == ["jitlib_auto.bmm"]


def test_a_traced_call_unlike_the_probed_ones_is_refused_not_given_a_wrong_shape():
    w = torch.randn(1, 8, 12)

    def run(n):
        return jitlib_auto.bmm(torch.randn(1, n, 8), w, torch.float32)

    op = wrap(jitlib_auto.bmm, "jitlib_auto.bmm", record_calls([jitlib_auto.bmm], run, 5, 7)[id(jitlib_auto.bmm)])
    routes = route(op)
    try:
        same = torch.compile(lambda a: jitlib_auto.bmm(a, w, torch.float32), backend="eager", fullgraph=True)
        assert same(torch.randn(1, 9, 8)).shape == (1, 9, 12)  # another token count: probed
        other = torch.compile(lambda a, b: jitlib_auto.bmm(a, b, torch.float32), backend="eager", fullgraph=True)
        with pytest.raises(Exception, match="is none of them") as info:  # another weight shape: never probed
            other(torch.randn(1, 9, 8), torch.randn(1, 8, 20))
        assert isinstance(info.value, AutoOpaqueUnseen) or "AutoOpaqueUnseen" in repr(info.value)
    finally:
        routes.undo()
    assert not is_opaque(jitlib_auto.bmm)
