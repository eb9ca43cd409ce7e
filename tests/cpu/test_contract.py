"""Parts of the correctness contract (never silently wrong): concurrent calls, full graphs and the forward
context, configuration errors that name the argument, a misspelt split op, Inductor modes on the backend."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import piecegraph
from piecegraph import Config
from piecegraph.attention import KVCache
from piecegraph.models import TINY, Decoder, dummy_inputs


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).eval()


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_concurrent_calls_are_serialized_and_right(mode):
    model = _mlp()
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=(4, 8, 16), emulate_graphs=True)
    graphed(torch.randn(3, 16))  # trace once before the threads start
    wrong, errors = [], []

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(60):
            x = torch.randn(int(torch.randint(1, 17, (1,), generator=gen)), 16, generator=gen)
            try:
                got = graphed(x)
            except Exception as exc:  # noqa: BLE001  (a shape error from a race is a failure too)
                errors.append(repr(exc))
                continue
            with torch.no_grad():
                want = model(x)
            if not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
                wrong.append(x.shape[0])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and not errors, (wrong, errors[:3])


def test_copy_of_a_graphed_module_gets_its_own_lock():
    import copy

    graphed = piecegraph.compile(_mlp(), mode="none", compiler="eager")
    clone = copy.deepcopy(graphed)
    assert clone._call_lock is not graphed._call_lock
    x = torch.randn(5, 16)
    torch.testing.assert_close(clone(x), graphed(x))


def test_full_graph_captured_with_a_context_refuses_a_call_without_one():
    model = Decoder.random(TINY, seed=0)
    graphed = piecegraph.compile(model, mode="full", compiler="eager", capture_sizes=(4,), emulate_graphs=True)
    cache = KVCache.for_sequences(TINY, 4, 32)
    graphed.capture(lambda n: dummy_inputs(model, cache, n))
    (ids, pos), _ = dummy_inputs(model, cache, 4)
    with pytest.raises(ValueError, match="captured with a forward context and is now called without one"):
        graphed(ids, pos)


def test_full_graph_captured_without_a_context_ignores_one_it_never_read():
    model = _mlp()
    graphed = piecegraph.compile(model, mode="full", compiler="eager", capture_sizes=(8,), emulate_graphs=True)
    x = torch.randn(8, 16)
    graphed(x)
    graphed(x)  # captured
    with piecegraph.forward_context({"unused": torch.zeros(8)}):
        got = graphed(x)  # was KeyError: 8
    with torch.no_grad():
        torch.testing.assert_close(got, model(x))


@pytest.mark.parametrize("field,value", [
    ("max_tokens", True), ("max_tokens", 0), ("capture_sizes", [3.7]), ("capture_sizes", ["abc"]),
    ("capture_sizes", 8), ("capture_sizes", []), ("warmup_runs", "2"), ("verify_tol", math.nan),
    ("verify_tol", -1.0), ("token_dim", 1.5), ("split_ops", ["attention"]), ("copy_outputs", 1), ("verify", 0),
    ("token_mixing", "padded"), ("static_inputs", ("memory", 3)), ("static_inputs", ("",)),
])
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        Config(**{field: value})


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=1, max_size=8))
def test_capture_sizes_are_kept_sorted_and_unique(sizes):
    assert Config(capture_sizes=sizes).sizes == tuple(sorted(set(sizes)))


def test_from_env_names_the_variable(monkeypatch):
    monkeypatch.setenv("PIECEGRAPH_MODE", "fastest")
    with pytest.raises(ValueError, match="PIECEGRAPH_MODE='fastest'"):
        Config.from_env()
    assert Config.from_env(mode="none").mode == "none"  # an explicit override wins over the variable


def test_a_misspelt_split_op_is_an_error_not_a_silent_no_split():
    graphed = piecegraph.compile(_mlp(), mode="none", compiler="eager", split_ops=("piecegraph_models::atention",))
    with pytest.raises(ValueError, match="piecegraph_models::atention.*no registered torch op"):
        graphed(torch.randn(4, 16))


def test_an_inductor_mode_on_the_piecegraph_backend_is_refused():
    compiled = torch.compile(_mlp(), backend="piecegraph", mode="max-autotune")
    with pytest.raises(Exception, match="that mode is Inductor's"):
        compiled(torch.randn(4, 16))


@pytest.mark.parametrize("mode,n", [("none", 6), ("piecewise", 40)])  # no graphs; above the largest size
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_every_path_checks_inputs_against_the_trace(mode, n, dtype):
    model = _mlp()
    graphed = piecegraph.compile(model, mode=mode, compiler="inductor", capture_sizes=(4, 8), emulate_graphs=True)
    graphed(torch.randn(5, 16))
    with pytest.raises(ValueError, match=f"input input is {dtype}"):
        graphed(torch.randn(n, 16).to(dtype))
    with pytest.raises(ValueError, match="input input has rank 3"):
        graphed(torch.randn(n, 16, 1))
    with pytest.raises(ValueError, match=r"input input has shape \(\d+, 17\)"):
        graphed(torch.randn(n, 17))


@settings(max_examples=20, deadline=None)
@given(n=st.integers(2, 24), mode=st.sampled_from(["none", "piecewise", "full"]))
def test_a_strided_input_gives_the_models_answer(n, mode):
    model = _mlp()
    graphed = piecegraph.compile(model, mode=mode, compiler="inductor", capture_sizes=(4, 8), emulate_graphs=True)
    graphed(torch.randn(5, 16))
    x = torch.randn(16, n).t()  # transposed: same values, other strides
    before = x.clone()
    with torch.no_grad():
        torch.testing.assert_close(graphed(x), model(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(x, before) and not x.is_contiguous()  # the caller's tensor is untouched


class _FailsOnce(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _mlp()
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("transient failure")
        return self.inner(x)


def test_a_failed_first_call_leaves_the_module_as_if_never_called():
    model = _FailsOnce()
    graphed = piecegraph.compile(model, mode="piecewise", compiler="eager", capture_sizes=(8,),
                                 emulate_graphs=True, prewarm=False)
    x = torch.randn(6, 16)
    with pytest.raises(Exception, match="transient failure"):  # noqa: B017  (Dynamo wraps what the model raised)
        graphed(x)
    model.fail = False
    got = graphed(x)  # traces again, from scratch
    graphed(x)
    with torch.no_grad():
        torch.testing.assert_close(got, model.inner(x))
    stats = graphed.stats()
    assert stats["sizes"] == [8] and stats["replays"] == 1 and stats["recompiles"] == 0


class _KwargsModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _mlp()

    def forward(self, x: torch.Tensor, **options):
        out = self.inner(x) * options.get("scale", 1.0)
        return out if options.get("return_dict", True) else (out,)


@pytest.mark.parametrize("mode", ["none", "piecewise"])
def test_kwargs_of_forward_are_arguments_of_their_own(mode):
    model = _KwargsModel()
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=(8,), emulate_graphs=True)
    x = torch.randn(5, 16)
    got = graphed(x, scale=2.0, return_dict=False)
    with torch.no_grad():
        want = model(x, scale=2.0, return_dict=False)
    assert isinstance(got, tuple) and len(got) == 1
    torch.testing.assert_close(got[0], want[0])
    with pytest.raises(ValueError, match="scale"):  # a non-tensor argument keeps its traced value, checked
        graphed(x, scale=3.0, return_dict=False)


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _mlp()

    def forward(self, x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        return self.inner(x) / temperature


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_fresh_scalar_tensor_per_call_is_read_and_never_written(mode):
    model = _Scaled()
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=(8,), emulate_graphs=True)
    x = torch.randn(5, 16)
    temps = [torch.tensor(t) for t in (0.5, 2.0, 4.0, 0.25)]
    for t in temps:
        with torch.no_grad():
            torch.testing.assert_close(graphed(x, t), model(x, t))
    assert [t.item() for t in temps] == [0.5, 2.0, 4.0, 0.25]  # the caller's tensors hold their own values
    assert graphed.stats()["replays"] >= 2


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5))

    def forward(self, x: torch.Tensor, options: dict) -> torch.Tensor:
        return self.b(self.a(x)) * options["scale"]


def _graphed_two_layers(mode):
    model = _TwoLayers().eval()
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=(8,), emulate_graphs=True)
    return model, graphed


def _check(model, graphed, x, options):
    got = graphed(x, options)
    with torch.no_grad():
        want = model(x, options)
    if model.training:  # dropout: compare the statistics, not the draws
        assert (got == 0).float().mean() > 0.2
    else:
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["none", "piecewise", "full"])
def test_model_changes_after_the_trace_are_seen(mode):
    model, graphed = _graphed_two_layers(mode)
    x, options = torch.randn(6, 16), {"scale": 2.0}
    for _ in range(2):
        _check(model, graphed, x, options)
    model.a = torch.nn.Linear(16, 16)  # a replaced submodule, same shapes: new weights are read
    _check(model, graphed, x, options)
    model.b[0] = torch.nn.Linear(16, 16, bias=False)  # a parameter gone: traced again
    _check(model, graphed, x, options)
    model.a.bias = None
    _check(model, graphed, x, options)
    model.train()  # dropout on: traced again in training mode
    _check(model, graphed, x, options)
    model.eval()
    _check(model, graphed, x, options)
    options["scale"] = 3.0  # a non-tensor argument mutated in place
    with pytest.raises(ValueError, match="options"):
        graphed(x, options)


def test_pickling_a_graphed_module_that_ran_says_what_to_do():
    import pickle

    graphed = piecegraph.compile(_mlp(), mode="none", compiler="eager")
    assert isinstance(pickle.loads(pickle.dumps(graphed)), piecegraph.GraphedModule)  # not run yet: fine
    graphed(torch.randn(3, 16))
    with pytest.raises(TypeError, match=r"pickle its \.model"):
        pickle.dumps(graphed)
