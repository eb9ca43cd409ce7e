"""The contract as a property: small random models composed of token-wise ops, token-mixing ops,
non-token tensor arguments and split ops, in every mode, on random token counts, give eager's answer or raise;
never a silent difference, and never a changed caller tensor.

CI runs 8 examples; ``PIECEGRAPH_PROPERTY_EXAMPLES=1000`` runs the long search whose counts a closing note reports
(``PIECEGRAPH_PROPERTY_LOG=file`` appends one JSON line per example: ops, token counts, mode, outcome)."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from toy import ToyModel  # noqa: F401  (registers the pg_toy split ops)

import piecegraph

D = 8
SIZES = (4, 8, 16)
TOKEN_WISE = ["linear", "gelu", "layernorm", "softmax_last", "scale", "row", "split_rownorm", "split_mix"]
MIXING = ["mean_tokens", "cumsum_tokens", "softmax_tokens", "attention_in_graph", "conv_tokens", "sum_scalar"]
MODES = ["none", "piecewise", "full", "breakable", "auto", "backend"]

_lib = torch.library.Library("pg_prop", "DEF")
_lib.define("rownorm(Tensor x, Tensor(a!) out) -> ()")


def _rownorm(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x / (x.norm(dim=-1, keepdim=True) + 1))


_lib.impl("rownorm", _rownorm, "CompositeExplicitAutograd")
_lib._register_fake("rownorm", lambda x, out: None)
piecegraph.split_op("pg_prop::rownorm")


class Composed(torch.nn.Module):
    """``forward(x [T, D], scale [D], row [1, D])``: a Linear (pad rows then hold its bias), then ``ops``."""

    def __init__(self, ops: list[str], seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.ops = ops
        self.first = torch.nn.Linear(D, D)
        self.lins = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in ops)
        self.norm = torch.nn.LayerNorm(D)
        self.conv = torch.nn.Conv1d(D, D, 3, padding=1)

    def forward(self, x, scale, row):
        h = self.first(x)
        for op, lin in zip(self.ops, self.lins):
            h = self._apply(op, h, lin, scale, row)
        return h

    def _apply(self, op, h, lin, scale, row):
        if op == "linear":
            return lin(h)
        if op == "gelu":
            return F.gelu(h)
        if op == "layernorm":
            return self.norm(h)
        if op == "softmax_last":
            return torch.softmax(h, -1)
        if op == "scale":
            return h * scale
        if op == "row":
            return h + row
        if op in ("split_rownorm", "split_mix"):
            out = torch.empty_like(h)
            (torch.ops.pg_prop.rownorm if op == "split_rownorm" else torch.ops.pg_toy.mix)(h, out)
            return out
        if op == "mean_tokens":
            return h - h.mean(0, keepdim=True)
        if op == "cumsum_tokens":
            return h.cumsum(0) / 4
        if op == "softmax_tokens":
            return torch.softmax(h, 0) * 4
        if op == "attention_in_graph":
            return torch.softmax(h @ h.T / D**0.5, -1) @ h
        if op == "conv_tokens":
            return self.conv(h.T[None])[0].T
        if op == "sum_scalar":
            return h * torch.tanh(h.sum())
        raise AssertionError(op)


def _compile(model: torch.nn.Module, mode: str):
    options = {"compiler": "eager", "capture_sizes": SIZES, "emulate_graphs": True}
    if mode == "backend":
        torch._dynamo.reset()
        return torch.compile(model, backend="piecegraph", dynamic=True, options=options)
    return piecegraph.compile(model, mode=mode, **options)


def _check_mode(model, mode, calls) -> str:
    """"ok", or "error: ..." when piecegraph refused; a silent difference fails the test."""
    graphed = _compile(model, mode)
    for n, x, scale, row in calls:
        kept = [t.clone() for t in (x, scale, row)]
        with torch.no_grad(), piecegraph.forward_context({"n": n}):
            want = model(x, scale, row)
        try:
            with warnings.catch_warnings(), piecegraph.forward_context({"n": n}):
                warnings.simplefilter("ignore")
                got = graphed(x, scale, row)
        except Exception as err:  # noqa: BLE001  (a refusal is allowed; it must name something)
            message = str(err).strip()
            assert message, f"{mode}: {type(err).__name__} with no message"
            return f"error: {type(err).__name__}: {message.splitlines()[0][:120]}"
        for t, k in zip((x, scale, row), kept):
            assert torch.equal(t, k), f"{mode} changed a caller tensor"
        error = (got - want).abs().max().item()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (
            f"silent difference in mode {mode} at {n} tokens: max abs. error {error:.2e}")
    return "ok"


ops_strategy = st.lists(st.sampled_from(TOKEN_WISE + MIXING), min_size=1, max_size=4)
counts_strategy = st.lists(st.integers(1, 20), min_size=2, max_size=4)


@settings(max_examples=int(os.environ.get("PIECEGRAPH_PROPERTY_EXAMPLES", "8")))
@given(ops=ops_strategy, counts=counts_strategy, mode=st.sampled_from(MODES), seed=st.integers(0, 2**16))
# Found by CI: breakable verified size 16 at 11 tokens, where tanh of the sum over tokens was saturated
# and hid the pad rows, then replayed it wrong at 9 (see test_breakable_pads_hidden_by_the_values_are_found)
@example(ops=["sum_scalar"], counts=[11, 9], mode="breakable", seed=0)
def test_every_mode_is_eager_or_an_error(ops, counts, mode, seed):
    model = Composed(ops, seed).eval()
    gen = torch.Generator().manual_seed(seed)
    calls = [(n, torch.randn(n, D, generator=gen), torch.randn(D, generator=gen), torch.randn(1, D, generator=gen))
             for n in counts]
    outcome = _check_mode(model, mode, calls)
    log = os.environ.get("PIECEGRAPH_PROPERTY_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"ops": ops, "counts": counts, "mode": mode, "outcome": outcome}) + "\n")


class SaturatedSum(torch.nn.Module):
    """A Linear (pad rows then hold its bias), then ``h * tanh(alpha * h.sum())``: a sum over every token whose
    effect on the answer the tanh may hide, for some calls (saturated) and not for others. ``centered``: the
    weights sum to zero, so a pad row holding one value in every feature adds nothing but the bias to the sum."""

    def __init__(self, alpha: float, seed: int, centered: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.alpha = alpha
        self.first = torch.nn.Linear(D, D)
        if centered:
            with torch.no_grad():
                self.first.weight -= self.first.weight.mean()

    def forward(self, x, scale, row):
        h = self.first(x)
        return h * torch.tanh(self.alpha * h.sum())


@settings(max_examples=int(os.environ.get("PIECEGRAPH_PROPERTY_EXAMPLES", "8")), deadline=None)
@given(alpha=st.sampled_from([0.05, 0.5, 5.0, 50.0]), counts=counts_strategy, seed=st.integers(0, 2**16),
       centered=st.booleans())
# Found by CI: pads of one large value in every feature moved the sum by little when the weights summed
# to near zero, so size 16 verified at 12 tokens and replayed 1% off at 9; the pads are now random large values
@example(alpha=0.5, counts=[1, 1, 12, 9], seed=28408, centered=False)
def test_breakable_pads_hidden_by_the_values_are_found(alpha, counts, seed, centered):
    """Breakable mode has no trace in which to see an op that mixes rows over tokens: only its verification of a
    size's first padded call can. With zero pads, a saturated tanh of the sum hid them (the call verified, a later
    one at the same size replayed wrong); the pad rows are now also filled with large random values of either
    sign (one value in every feature hid them from weights that sum to zero), run without graphs, and a size
    whose real rows move is dropped. Every call equals eager or raises."""
    model = SaturatedSum(alpha, seed, centered).eval()
    gen = torch.Generator().manual_seed(seed)
    calls = [(n, torch.randn(n, D, generator=gen), torch.randn(D, generator=gen), torch.randn(1, D, generator=gen))
             for n in counts]
    assert _check_mode(model, "breakable", calls) == "ok"  # nothing here to refuse: an error is piecegraph's bug


class RangeChecked(torch.nn.Module):
    """A Linear, after a check on the host that refuses inputs out of range: large pad rows make it raise."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(D, D)

    def forward(self, x, scale, row):
        if bool((x.abs() > 20).any()):
            raise ValueError("an input is out of range")
        return self.first(x) * scale


def test_breakable_drops_a_size_whose_large_pad_run_raises_and_still_answers_as_eager():
    """The pad-dependence run of a breakable size (large pad rows, no graphs) can break a program that checks its
    inputs: that is taken as rows mixing, so the size is dropped with the usual warning; the call still gives
    eager's answer and leaves the caller's tensors as they were."""
    model = RangeChecked().eval()
    graphed = _compile(model, "breakable")
    gen = torch.Generator().manual_seed(0)
    x, scale, row = torch.randn(11, D, generator=gen), torch.randn(D, generator=gen), torch.randn(1, D, generator=gen)
    kept = [t.clone() for t in (x, scale, row)]
    with torch.no_grad(), piecegraph.forward_context({"n": 11}):
        want = model(x, scale, row)
    with pytest.warns(UserWarning, match=r"size 16 replayed on fresh inputs differs .* \(rel. error inf"):
        with piecegraph.forward_context({"n": 11}):
            got = graphed(x, scale, row)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert all(torch.equal(t, k) for t, k in zip((x, scale, row), kept))
    assert graphed.stats()["dropped_sizes"] == {16: float("inf")}
