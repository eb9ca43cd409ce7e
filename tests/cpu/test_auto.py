"""mode='auto': piecewise when Dynamo traces; the known fixes when it does not; else a fallback and one warning."""

import warnings

import pytest
import torch
from toy import ToyModel

import piecegraph

jitlib = pytest.importorskip("jitlib")
if jitlib.compiler() is None:
    pytest.skip("no C compiler for the JIT fixture", allow_module_level=True)


class JitModel(torch.nn.Module):
    """A warm cached loader (fixable: freeze) and the JIT library's kernel itself (a ctypes call: not fixable
    without a fake the user should see, so auto falls back)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        version = jitlib.compiler_version()
        return jitlib.rmsnorm(self.a(x).contiguous(), self.w) * (2.0 + 0.0 * len(version))


class LoaderModel(torch.nn.Module):
    """Only reads a warm cached loader (subprocess behind functools.cache), then does torch math."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        version = jitlib.compiler_version()
        return torch.relu(self.a(x)) * (1.0 + 0.0 * len(version))


@pytest.fixture(autouse=True)
def _unfreeze():
    yield
    piecegraph.unfreeze()


def _fallback_warnings(caught):
    return [w for w in caught if "does not trace with Dynamo" in str(w.message)]


def test_untraceable_model_falls_back_with_one_warning_and_same_results():
    model = JitModel().eval()  # automatic opaque off: the kernel's ctypes call then has no fix auto may apply
    graphed = piecegraph.compile(model, mode="auto", compiler="eager", capture_sizes=(4, 8), auto_opaque=False)
    x = torch.randn(5, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = graphed(x)
        again = graphed(torch.randn(3, 8))
    (warning,) = _fallback_warnings(caught)
    text = str(warning.message)
    assert "after trying piecegraph.freeze(" in text and "compiler_version" in text  # the fix it tried first
    assert "piecegraph.opaque(jitlib.rmsnorm" in text  # the blocker left, with the fix to paste
    assert "Inductor's fusion" in text and "eager" in text and "piecegraph doctor" in text
    assert "jitlib" in text or "kernels.py" in text  # names the blocker
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    assert again.shape == (3, 8)
    assert graphed.stats()["mode"] == "none"


def test_warm_loader_blocker_is_fixed_by_freezing_then_piecewise():
    model = LoaderModel().eval()
    graphed = piecegraph.compile(model, mode="auto", compiler="eager", capture_sizes=(4, 8), emulate_graphs=True)
    x = torch.randn(6, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = graphed(x)
    assert not _fallback_warnings(caught)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    stats = graphed.stats()
    assert stats["mode"] == "piecewise" and stats["sizes"] == [8] and stats["dropped_sizes"] == {}
    assert graphed.runner.verify_left == 0  # the first capture was verified


def test_traceable_model_stays_piecewise_without_fixes():
    model = ToyModel().eval()
    graphed = piecegraph.compile(model, mode="auto", compiler="eager", capture_sizes=(4, 8), emulate_graphs=True)
    x, pos = torch.randn(3, 16), torch.arange(3)
    with warnings.catch_warnings(record=True) as caught, piecegraph.forward_context({"n": 3}):
        warnings.simplefilter("always")
        out = graphed(x, pos)
        with torch.no_grad():
            ref = model(x, pos)
    assert not _fallback_warnings(caught)
    torch.testing.assert_close(out, ref)
    assert graphed.stats()["pieces"] == 3 and graphed.stats()["sizes"] == [4]


def test_breakable_mode_on_cpu_emulated_matches_eager_across_buckets():
    model = ToyModel().eval()
    graphed = piecegraph.compile(model, mode="breakable", capture_sizes=(2, 4, 8), emulate_graphs=True)
    for n in (3, 1, 4, 3, 11):
        x, pos = torch.randn(n, 16), torch.arange(n)
        with piecegraph.forward_context({"n": n}):
            out = graphed(x, pos)
            with torch.no_grad():
                ref = model(x, pos)
        torch.testing.assert_close(out, ref)
    stats = graphed.stats()
    assert stats["sizes"] == [2, 4] and stats["replays"] == 2 and stats["fallbacks"] == 1


def _model_defined_in_a_function():
    class Inner(torch.nn.Module):  # in no module's namespace; LoaderModel.forward above is another "forward"
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)

        def forward(self, x):
            import os

            os.stat(".")  # a filesystem call Dynamo cannot trace, and no fix piecegraph knows
            return self.a(x)

    return Inner()


def test_the_warning_names_a_class_defined_inside_a_function():
    model = _model_defined_in_a_function()
    graphed = piecegraph.compile(model, mode="auto", compiler="eager")
    with pytest.warns(UserWarning, match="piecegraph auto") as record:
        graphed(torch.randn(3, 8))
    message = next(str(w.message) for w in record if "piecegraph auto" in str(w.message))
    assert "_model_defined_in_a_function.<locals>.Inner.forward" in message, message
    assert "LoaderModel" not in message and "JitModel" not in message
