"""Tensors that are not token-aligned: a cross-attention memory, a table. Never duck-sized
into the token dimension, never padded: found by size, or named in ``Config(static_inputs=...)``; a collision
that one call cannot resolve ends in an error naming the argument and the fix, never a wrong answer."""

from __future__ import annotations

import warnings

import pytest
import torch

import piecegraph

SIZES = (4, 8, 16)


class CrossAttention(torch.nn.Module):
    """Tokens attend to a fixed memory, in the graph (no split op): softmax over the memory's rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.out = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x, memory):
        scores = self.q(x) @ memory.T
        return self.out(torch.softmax(scores, -1) @ memory)


def _check(graphed, model, memory, counts):
    for n in counts:
        x = torch.randn(n, 16)
        kept = memory.clone()
        with torch.no_grad():
            torch.testing.assert_close(graphed(x, memory), model(x, memory), rtol=1e-5, atol=1e-5)
        assert torch.equal(memory, kept)


@pytest.mark.parametrize("mode", ["piecewise", "full", "none", "breakable"])
def test_a_memory_of_another_size_is_static(mode):
    model = CrossAttention().eval()
    memory = torch.randn(7, 16)
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    _check(graphed, model, memory, (3, 5, 8, 1, 12, 20))
    if mode in ("piecewise", "full"):
        assert graphed.stats()["token_mixing"] == []  # the memory's rows are not tokens: nothing to refuse
        assert graphed.stats()["replays"] > 0


@pytest.mark.parametrize("mode", ["piecewise", "full", "breakable"])
def test_a_memory_named_static_is_never_padded_even_when_sizes_collide(mode):
    model = CrossAttention().eval()
    memory = torch.randn(5, 16)  # the first call has 5 tokens too
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=SIZES, emulate_graphs=True,
                                 static_inputs=("memory",))
    _check(graphed, model, memory, (5, 3, 8, 11, 5))
    if mode != "breakable":
        assert graphed.stats()["token_mixing"] == []


@pytest.mark.parametrize("mode", ["piecewise", "full", "none", "breakable"])
def test_an_unnamed_collision_is_found_at_the_first_call_that_tells(mode):
    """The first call cannot tell a 5-row memory from 5 tokens; the first call with other token counts can: the
    memory kept its size, so it is static, and piecegraph traces again. Right answers throughout."""
    model = CrossAttention().eval()
    memory = torch.randn(5, 16)
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the memory's rows, taken for tokens, are mixed: exact sizes only
        _check(graphed, model, memory, (5,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _check(graphed, model, memory, (3, 8, 11))
    assert graphed.config.static_inputs == ("memory",)


def test_a_real_token_count_mismatch_is_still_an_error():
    model = CrossAttention().eval()
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphed(torch.randn(5, 16), torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"static_inputs=\('memory',\)"):
        graphed(torch.randn(3, 16), torch.randn(4, 16))  # both changed: nothing explains it


def test_static_inputs_must_name_arguments():
    with pytest.raises(ValueError, match="static_inputs"):
        piecegraph.Config(static_inputs=(3,))
    graphed = piecegraph.compile(CrossAttention(), mode="none", compiler="eager", static_inputs=("memroy",))
    with pytest.raises(TypeError, match="memroy"):
        graphed(torch.randn(3, 16), torch.randn(7, 16))


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, scale):
        return self.lin(x) * scale


@pytest.mark.parametrize("mode", ["piecewise", "full", "none"])
def test_a_scale_whose_size_equals_the_first_token_count_is_found_by_the_trace(mode):
    """A (8,) scale beside 8 tokens: taken for a token input, the trace shows it is not (it broadcasts over the
    features); piecegraph names it static and traces again, at that same first call."""
    model = Scaled().eval()
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    for n in (8, 5, 8, 16, 3):
        x, scale = torch.randn(n, 8), torch.randn(8)
        with torch.no_grad():
            torch.testing.assert_close(graphed(x, scale), model(x, scale), rtol=1e-5, atol=1e-5)
    assert graphed.config.static_inputs == ("scale",)
