"""piecegraph's own runs (prewarm, the trace, warm-up, capture, verification) never show: after
``k`` calls a buffer counter reads ``k`` and BatchNorm's statistics match ``k`` eager calls; a model that writes
its input in place returns eager's answer and writes the caller's tensor exactly once per call."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import piecegraph

SIZES = (4, 8, 16)
MODES = ["piecewise", "full", "none", "breakable", "auto"]


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x) * self.calls


class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lin, self.bn = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.lin(x))


class WritesInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


def _compile(model, mode, **kw):
    return piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=SIZES, emulate_graphs=True, **kw)


def _run_both(model, graphed, counts, seed=0):
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    for n in counts:
        x = torch.randn(n, 8, generator=gen)
        x_ref = x.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = graphed(x)
        with torch.no_grad():
            want = reference(x_ref)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x, x_ref)  # the caller's tensor: written as eager writes it, or not at all
    return reference


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_counter_counts_the_callers_calls(mode, verify):
    model = Counter().eval()
    graphed = _compile(model, mode, verify=verify)
    counts = (3, 4, 4, 9, 20, 3)
    reference = _run_both(model, graphed, counts)
    assert model.calls.item() == len(counts) == reference.calls.item()


@pytest.mark.parametrize("mode", MODES)
def test_batch_norm_statistics_match_eager_calls(mode):
    """Batch statistics mix tokens: traced modes capture exact sizes only; breakable cannot see the op (no
    trace), so it needs ``verify``, which compares with the unpadded run and drops the sizes that differ."""
    model = Norm().train()
    graphed = _compile(model, mode, verify=True if mode == "breakable" else None)
    reference = _run_both(model, graphed, (4, 4, 8, 5))
    assert model.bn.num_batches_tracked.item() == 4
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, reference.bn.running_var)


@pytest.mark.parametrize("mode", MODES)
def test_a_model_that_writes_its_input_matches_eager(mode):
    model = WritesInput().eval()
    graphed = _compile(model, mode)
    _run_both(model, graphed, (3, 3, 4, 8, 20))


def test_prewarm_does_not_write_the_callers_tensors():
    model = WritesInput().eval()
    graphed = piecegraph.compile(model, mode="none", compiler="eager")
    x = torch.ones(3, 8)
    graphed(x)
    torch.testing.assert_close(x, torch.full((3, 8), 2.0))  # once by the call itself, never by the prewarm


class WeightBuffer(torch.nn.Module):
    """A weight kept as a buffer (as FP8 weights are), beside a small counter; ``scribble`` writes the weight."""

    def __init__(self, scribble: bool = False):
        super().__init__()
        torch.manual_seed(3)
        self.register_buffer("weight", torch.randn(8, 8))
        self.register_buffer("calls", torch.zeros(()))
        self.scribble = scribble

    def forward(self, x):
        self.calls.add_(1)
        if self.scribble:
            self.weight.mul_(1.0)
        return x @ self.weight.t()


@pytest.mark.parametrize("mode", ["piecewise", "breakable"])
def test_weight_buffers_are_watched_not_copied(mode, monkeypatch):
    """Over the copy limit a buffer is not cloned (that would double an FP8 model on the device); the small
    counter beside it still counts the caller's calls, and answers match eager."""
    from piecegraph.program import arguments

    monkeypatch.setattr(arguments, "COPY_LIMIT_BYTES", 64)  # the 8x8 weight is over it, the counter under
    model = WeightBuffer().eval()
    clones = []
    real_clone = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: clones.append(t.numel()) or real_clone(t, *a, **k))
    graphed = _compile(model, mode)
    reference = _run_both(model, graphed, (3, 4, 9))
    assert 64 not in clones  # the weight was never copied
    assert model.calls.item() == 3 == reference.calls.item()


def test_a_weight_buffer_written_in_place_is_an_error(monkeypatch):
    """Its value before piecegraph's own runs is gone, so the caller hears it rather than getting a changed model."""
    from piecegraph.program import arguments

    monkeypatch.setattr(arguments, "COPY_LIMIT_BYTES", 64)
    graphed = _compile(WeightBuffer(scribble=True).eval(), "piecewise")
    with pytest.raises(RuntimeError, match="large buffer.*weight.*in place"):
        graphed(torch.randn(3, 8))
