"""Automatic opaque on a method: the model holds a library object (FlashInfer's ``SegmentGEMMWrapper`` pattern,
here tests/cpu/jitlib_auto's ``SegmentGemm``) and calls ``self.gemm.run(...)``; the JIT loader inside the method
breaks Dynamo. mode="auto" wraps that object's method (named by its class), traces piecewise with Inductor pieces,
equals eager, prints a line that makes it permanent on that object, and puts the method back on release."""

import gc
import warnings

import jitlib_auto
import pytest
import torch

import piecegraph
from piecegraph.ops.opaque import is_opaque

ENTRY = "jitlib_auto.SegmentGemm.run"


class GroupedExperts(torch.nn.Module):
    """Top-2 routing in torch, rows sorted by expert, two grouped GEMMs through the library object (column-major
    ``[E, out, in]`` weights), SiLU between, rows scattered back with their routing weights; a residual."""

    def __init__(self, gemm, d: int = 8, f: int = 12, experts: int = 4, k: int = 2):
        super().__init__()
        self.gemm, self.k, self.experts = gemm, k, experts
        self.router = torch.nn.Parameter(torch.randn(d, experts))
        self.up = torch.nn.Parameter(torch.randn(experts, f, d) * 0.3)
        self.down = torch.nn.Parameter(torch.randn(experts, d, f) * 0.3)

    def forward(self, x):
        weight, expert = torch.softmax(x @ self.router, -1).topk(self.k, -1)
        flat = expert.reshape(-1)
        order = flat.argsort(stable=True)
        counts = (flat.unsqueeze(1) == torch.arange(self.experts)).sum(0)
        indptr = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        rows = x.index_select(0, order // self.k)
        h = torch.nn.functional.silu(self.gemm.run(rows, self.up, self.experts, True, seg_indptr=indptr))
        y = self.gemm.run(h, self.down, self.experts, True, seg_indptr=indptr)
        y = y * weight.reshape(-1).index_select(0, order).unsqueeze(1)
        return torch.zeros_like(x).index_add(0, order // self.k, y) + x


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gemm = jitlib_auto.SegmentGemm(torch.empty(16))  # one object shared by the layers, as a workspace is
        self.layers = torch.nn.ModuleList(GroupedExperts(gemm) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(autouse=True)
def _unroute():
    from jitlib_auto.segment import DEVICE_FAULTS

    DEVICE_FAULTS.clear()
    yield
    piecegraph.unfreeze()
    torch._dynamo.reset()
    assert DEVICE_FAULTS == [], f"the grouped GEMM ran on offsets a GPU faults on: {DEVICE_FAULTS[:3]}"


def test_a_library_objects_method_is_wrapped_and_the_model_traces_piecewise_with_inductor():
    torch.manual_seed(0)
    model = TwoLayers().eval()
    gemm = model.layers[0].gemm
    graphed = piecegraph.compile(model, mode="auto", compiler="inductor", capture_sizes=(4, 8), emulate_graphs=True,
                                 token_mixing="pad")
    inductor = sum(torch._dynamo.utils.counters["inductor"].values())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(5, 8)
        out = graphed(x)
    assert not [w for w in caught if "does not trace with Dynamo" in str(w.message)]
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=0, atol=1e-5)
        for n in (3, 8, 11):
            xn = torch.randn(n, 8)
            torch.testing.assert_close(graphed(xn), model(xn), rtol=0, atol=1e-5)
    stats = graphed.stats()
    assert stats["mode"] == "piecewise" and sum(torch._dynamo.utils.counters["inductor"].values()) > inductor
    line = stats["auto_opaque"][ENTRY]
    target = 'model.get_submodule("layers.0").gemm.run'
    assert line.startswith(f"{target} = piecegraph.opaque({target}, fake=") and "weights.shape[1]" in line
    assert is_opaque(gemm.run) and "run" in vars(gemm)  # routed on that one object, not on the class
    assert not is_opaque(jitlib_auto.SegmentGemm(torch.empty(1)).run)
    # the blockers' search and the probes are timed on their own: not in trace or compile, within the setup
    startup = stats["startup"]
    assert startup["diagnose_s"] > 0
    assert startup["diagnose_s"] + startup["trace_s"] + startup["compile_s"] <= startup["setup_s"]
    del graphed
    gc.collect()
    assert "run" not in vars(gemm) and not is_opaque(gemm.run)  # released: the method is the class's again


def test_the_printed_line_makes_it_permanent_and_the_model_traces_with_no_breaks():
    torch.manual_seed(1)
    model = TwoLayers().eval()
    graphed = piecegraph.compile(model, mode="auto", capture_sizes=(4,), emulate_graphs=True, token_mixing="pad")
    graphed(torch.randn(4, 8))
    line = graphed.stats()["auto_opaque"][ENTRY]
    del graphed
    gc.collect()
    torch._dynamo.reset()
    exec(line, {"piecegraph": piecegraph, "model": model, "torch": torch})  # what a user pastes
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(6, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=1e-6)


def test_the_doctor_names_the_method_by_its_class_and_fix_traces_with_zero_breaks():
    torch.manual_seed(2)
    model, x = TwoLayers().eval(), torch.randn(6, 8)
    gemm = model.layers[0].gemm
    with torch.no_grad():
        expected = model(x)
    report = piecegraph.doctor(model, x)
    assert {f.entry for f in report.findings if f.package == "jitlib_auto"} == {ENTRY}
    lines = [line for f in report.findings for line in f.fix.splitlines() if "piecegraph.opaque(" in line]
    target = 'model.get_submodule("layers.0").gemm.run'
    assert lines and all(line.startswith(f"{target} = piecegraph.opaque({target}, fake=") for line in lines)
    assert not is_opaque(gemm.run)  # reporting wraps nothing
    fixed = piecegraph.doctor(model, x, fix=True)
    try:
        assert fixed.ok and fixed.graph_breaks == 0 and is_opaque(gemm.run)
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), expected, rtol=0, atol=1e-6)
    finally:
        fixed.applied.undo()
    assert "run" not in vars(gemm)


class HeldKernel(torch.nn.Module):
    """Looks its kernel up once, at construction, and keeps it as an attribute (as FP8Linear keeps bmm_fp8): the
    route is an instance spot in this module's namespace, beside parameters whose shapes differ per instance."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.kernel = jitlib_auto.bmm
        self.w = torch.nn.Parameter(torch.randn(1, d_in, d_out) * 0.3)

    def forward(self, x):
        return self.kernel(x.unsqueeze(0), self.w, torch.float32)[0]


def test_release_puts_back_every_held_kernel_even_beside_tensors_of_other_shapes():
    # Undo once compared spots with ==, which compared the namespaces' tensors: it raised inside the release
    # finalizer (swallowed) and left the rest routed, silently.
    original = jitlib_auto.bmm
    model = torch.nn.Sequential(HeldKernel(8, 12), torch.nn.ReLU(), HeldKernel(12, 8)).eval()
    graphed = piecegraph.compile(model, mode="auto", capture_sizes=(4,), emulate_graphs=True)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), model(x), rtol=0, atol=1e-6)
    assert all(is_opaque(model[i].kernel) for i in (0, 2))
    del graphed
    gc.collect()
    assert all(model[i].kernel is original for i in (0, 2)) and jitlib_auto.bmm is original


def test_auto_ends_its_fix_rounds_when_the_module_traces_after_a_fix(monkeypatch):
    """One diagnosis trace (it sees every break) then the module's own trace, which succeeds: no second diagnosis
    trace only to confirm nothing blocks any more. The module's traces inside the advisor count as trace_s, not
    diagnose_s."""
    import piecegraph.diagnose.core as core

    diagnosis_traces = []
    real = core.trace
    monkeypatch.setattr(core, "trace", lambda *a, **k: diagnosis_traces.append(1) or real(*a, **k))
    torch.manual_seed(2)
    model = TwoLayers().eval()
    graphed = piecegraph.compile(model, mode="auto", capture_sizes=(4,), emulate_graphs=True, token_mixing="pad")
    x = torch.randn(4, 8)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(graphed(x), model(x), rtol=0, atol=1e-5)
    stats = graphed.stats()
    assert stats["mode"] == "piecewise" and ENTRY in stats["auto_opaque"]
    assert len(diagnosis_traces) == 1
    startup = stats["startup"]
    assert startup["diagnose_s"] > 0 and startup["trace_s"] > 0
    assert startup["diagnose_s"] + startup["trace_s"] + startup["compile_s"] <= startup["setup_s"]


class _WithABranch(TwoLayers):
    """The grouped experts (automatic opaque wraps their kernel) and a branch on a tensor's value in the model's
    own code, which no fix removes: auto falls back."""

    def forward(self, x):
        x = super().forward(x)
        if x.sum() > 0:  # data-dependent control flow: Dynamo cannot trace it as one graph
            return x * 2
        return x


def test_auto_falls_back_without_tracing_again_what_its_last_retrace_already_refused(monkeypatch):
    """The module's traces: the first attempt and one after the fix round; the advisor's last retrace error is the
    module's as it stands, so the fallback (eager on CPU) does not trace a third time, and equals eager."""
    from piecegraph.graphed.module import GraphedModule

    tries = []
    real = GraphedModule._try_trace
    monkeypatch.setattr(GraphedModule, "_try_trace", lambda self, *a: tries.append(1) or real(self, *a))
    torch.manual_seed(3)
    model = _WithABranch().eval()
    graphed = piecegraph.compile(model, mode="auto", capture_sizes=(4,), emulate_graphs=True, token_mixing="pad")
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(graphed(x), model(x), rtol=0, atol=1e-5)
    assert graphed.stats()["mode"] == "none"  # auto's fallback on CPU: eager (breakable graphs on CUDA)
    assert any("eager" in str(w.message) for w in caught)  # the fallback warning names it
    assert len(tries) == 2, len(tries)
