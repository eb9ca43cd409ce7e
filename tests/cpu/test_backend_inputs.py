"""``torch.compile(model, backend="piecegraph")``: which graph inputs are token inputs is decided by what Dynamo
knows of each (a parameter, a buffer, a module attribute, the caller's argument), never by a variable's name.

Static traces (``dynamic=False``, and the first call under the default ``dynamic=None``) are where a name-based
rule went wrong: parameters were taken for token inputs and the call failed with "disagree on the token count".
Every case is checked against eager on several token counts, in emulated-graph mode (graph semantics on CPU)."""

from __future__ import annotations

import functools

import pytest
import torch

OPTIONS = {"compiler": "eager", "capture_sizes": (8, 16, 32, 64), "emulate_graphs": True}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).eval()


def _fresh_dynamo():
    torch._dynamo.reset()


def _check(compiled, model, calls):
    for args in calls:
        before = [a.clone() for a in args]
        with torch.no_grad():
            want = model(*args)
            got = compiled(*args)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(args, before):
            assert torch.equal(a, b), "the caller's tensor was written"


@pytest.mark.parametrize("dynamic", [None, False])
def test_sequential_static_and_default_traces(dynamic):
    _fresh_dynamo()
    model = _mlp()
    compiled = torch.compile(model, backend="piecegraph", dynamic=dynamic, options=OPTIONS)
    _check(compiled, model, [(torch.randn(n, 32),) for n in (40, 40, 24, 7, 40)])


@pytest.mark.parametrize("build", ["linear", "layernorm"])
def test_single_layers(build):
    _fresh_dynamo()
    torch.manual_seed(1)
    model = (torch.nn.Linear(32, 32) if build == "linear" else torch.nn.LayerNorm(32)).eval()
    compiled = torch.compile(model, backend="piecegraph", options=OPTIONS)
    _check(compiled, model, [(torch.randn(n, 32),) for n in (40, 12, 40)])


class _OddSelf(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.register_buffer("shift", torch.randn(32))

    def forward(s, x):  # noqa: N805  (the name of self is the point)
        return s.proj(x) + s.shift


def _decorated(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):  # how Hugging Face decorates every forward
        return fn(self, *args, **kwargs)

    return wrapper


class _Decorated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    @_decorated
    def forward(self, x):
        return torch.relu(self.proj(x))


@pytest.mark.parametrize("cls", [_OddSelf, _Decorated])
def test_self_by_another_name_and_decorated_forward(cls):
    _fresh_dynamo()
    torch.manual_seed(2)
    model = cls().eval()
    compiled = torch.compile(model, backend="piecegraph", options=OPTIONS)
    _check(compiled, model, [(torch.randn(n, 32),) for n in (40, 40, 20)])


def test_closure_over_a_model():
    _fresh_dynamo()
    model = _mlp()

    def run(x):
        return model(x) * 2

    compiled = torch.compile(run, backend="piecegraph", options=OPTIONS)
    for n in (40, 9, 40):
        x = torch.randn(n, 32)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x) * 2, rtol=1e-5, atol=1e-5)


class _WithSideInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x, scale, row, table, ids):
        return self.proj(x) * scale + row + table[ids]


@pytest.mark.parametrize("dynamic", [None, False])
def test_non_token_tensor_arguments_are_read_fresh_each_call(dynamic):
    """A (32,) scale, a (1, 32) row and a (100, 32) table are the caller's static inputs: fresh values each call
    are read (never the first call's), and the caller's tensors are never written."""
    _fresh_dynamo()
    torch.manual_seed(3)
    model = _WithSideInputs().eval()
    compiled = torch.compile(model, backend="piecegraph", dynamic=dynamic, options=OPTIONS)
    calls = []
    for n in (40, 40, 40, 17, 40):
        calls.append((torch.randn(n, 32), torch.randn(32), torch.randn(1, 32), torch.randn(100, 32),
                      torch.randint(0, 100, (n,))))
    _check(compiled, model, calls)


def test_a_side_input_whose_size_equals_the_token_count():
    """A (40, 32) table beside 40 tokens in a static trace: staged as the caller's own, exact either way."""
    _fresh_dynamo()
    torch.manual_seed(4)
    model = _WithSideInputs().eval()
    compiled = torch.compile(model, backend="piecegraph", dynamic=False, options=OPTIONS)
    calls = [(torch.randn(40, 32), torch.randn(32), torch.randn(1, 32), torch.randn(40, 32),
              torch.randint(0, 40, (40,))) for _ in range(3)]
    _check(compiled, model, calls)


def test_an_input_without_a_recorded_fake_value_does_not_specialise_the_token_count():
    """A graph input that comes without a recorded fake value must not make piecegraph rebuild every fake from
    the real inputs: those have constant sizes, and running the symbolic graph on them pins or loses the token
    count. The missing one is taken from Dynamo's own fake of that input (its grapharg)."""
    from piecegraph.dynamo_backend import piecegraph_backend

    _fresh_dynamo()
    model = _mlp()

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:  # a parameter's and the token input's
            if node.op == "placeholder" and ("weight" in node.name or "args_0" in node.name):
                node.meta.pop("example_value", None)
                node.meta.pop("val", None)
        return piecegraph_backend(gm, example_inputs, options=OPTIONS)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for n in (23, 5, 40):
        x = torch.randn(n, 32)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
