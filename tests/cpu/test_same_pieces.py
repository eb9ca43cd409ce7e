"""Pieces that are the same program are compiled once and share the compiled code (trace/same_pieces.py): a
decoder's middle layers compile once, and sharing never changes an answer (pieces that differ in a constant,
a shape or a dtype are compiled on their own). Graph semantics emulated on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import ToyModel  # noqa: F401  (registers the pg_toy split ops)

import piecegraph
import piecegraph.trace.backend as backend
from piecegraph.attention import KVCache
from piecegraph.models import TINY, Decoder, dummy_inputs, generate
from piecegraph.trace.same_pieces import piece_key


def _counting(monkeypatch) -> list[str]:
    compiled: list[str] = []
    real = backend._compile_piece

    def count(sub, fake_args, compiler, *packaging, **how):
        compiled.append(sub.__class__.__name__)
        return real(sub, fake_args, compiler, *packaging, **how)

    monkeypatch.setattr(backend, "_compile_piece", count)
    return compiled


def test_a_decoders_middle_layers_compile_once_and_generate_as_eager(monkeypatch):
    compiled = _counting(monkeypatch)
    model = Decoder.random(dataclasses.replace(TINY, num_layers=5), seed=0).eval()
    cache = KVCache.for_sequences(model.config, 3, 48)
    graphed = piecegraph.compile(model, mode="piecewise", capture_sizes=(4, 16), emulate_graphs=True)
    graphed.capture(lambda n: dummy_inputs(model, cache, n))
    pieces = graphed.runner.program.pieces
    assert len(pieces) == 6 and len(compiled) == 3  # first, the four middle ones (one compile), last
    assert len({id(p.fn) for p in pieces}) == 3 and graphed.stats()["compiled_pieces"] == 3
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]]
    assert generate(model, prompts, 5, cache=cache, prefill_fn=graphed) == generate(model, prompts, 5)


class Scaled(torch.nn.Module):
    """Blocks around the toy split op, each with its own Python constant (baked into the trace) and shape."""

    def __init__(self, scales: list[float], widths: list[int]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.scales = scales
        self.ins = torch.nn.ParameterList(torch.randn(16, w, generator=g) / 4 for w in widths)
        self.outs = torch.nn.ParameterList(torch.randn(w, 16, generator=g) / 4 for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for scale, w_in, w_out in zip(self.scales, self.ins, self.outs):
            h = torch.tanh((x @ w_in) * scale) @ w_out
            out = torch.empty_like(h)
            torch.ops.pg_toy.mix(h, out)
            x = x + out
        return x


@settings(max_examples=15, deadline=None)
@given(scales=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=2, max_size=5),
       widths=st.lists(st.sampled_from([8, 24]), min_size=5, max_size=5), n=st.integers(1, 12))
def test_sharing_never_changes_an_answer(scales, widths, n):
    from piecegraph.context import forward_context

    model = Scaled(scales, widths[:len(scales)]).eval()
    graphed = piecegraph.compile(model, mode="piecewise", compiler="eager", capture_sizes=(4, 16),
                                 emulate_graphs=True)
    x = torch.randn(n, 16)
    with forward_context({"n": n}):
        got, want = graphed(x), model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    pieces = graphed.runner.program.pieces
    # Piece 0 is block 0 up to the split op; piece k joins block k-1's end to block k up to its split op (its
    # scale and width decide its code); the last piece ends block L-1. Equal middle pieces share one compile.
    middles = {(scale, width) for scale, width in zip(scales[1:], widths[1:len(scales)])}
    assert len(pieces) == len(scales) + 1
    assert len({id(p.fn) for p in pieces}) == 2 + len(middles)


@settings(max_examples=10, deadline=None)
@given(scales=st.lists(st.sampled_from([0.5, 1.0]), min_size=2, max_size=5),
       widths=st.lists(st.sampled_from([8, 24]), min_size=5, max_size=5))
def test_a_twins_fake_outputs_stand_for_its_own_run(scales, widths):
    """A piece that is the same program as an earlier one is not run on fakes again: the earlier run's outputs
    are copied (trace/same_pieces.py's fresh_outputs). Every piece then sees inputs of the same metadata (its
    key: dtypes, symbolic sizes and strides) as when each piece runs, and the answer is eager's."""
    from piecegraph.context import forward_context

    model = Scaled(scales, widths[:len(scales)]).eval()
    keys = {}
    real_key = backend.piece_key
    for shortcut in (True, False):
        seen = keys[shortcut] = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(backend, "piece_key", lambda sub, args, seen=seen: seen.append(real_key(sub, args))
                          or seen[-1])
            if not shortcut:
                patch.setattr(backend, "fresh_outputs", lambda outputs, inputs: None)
            graphed = piecegraph.compile(model, mode="piecewise", compiler="eager", capture_sizes=(4,),
                                         emulate_graphs=True)
            x = torch.randn(3, 16)
            with forward_context({"n": 3}):
                torch.testing.assert_close(graphed(x), model(x), rtol=1e-5, atol=1e-5)
    assert keys[True] == keys[False] and len(keys[True]) == len(scales) + 1


def test_fresh_outputs_refuse_aliases_and_data_dependent_sizes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from piecegraph.trace.same_pieces import fresh_outputs

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        x = mode.from_tensor(torch.randn(4, 8))
        y = x * 2
        made = fresh_outputs((y, None, 3), [x])
        assert made[1:] == (None, 3) and made[0] is not y
        assert (made[0].shape, made[0].stride(), made[0].dtype) == (y.shape, y.stride(), y.dtype)
        assert fresh_outputs(x[1:], [x]) is None  # a view of an input
        assert fresh_outputs((y, y.view(-1)), [x]) is None  # two outputs sharing one buffer
        assert fresh_outputs([y, "text"], [x]) is None
        nonzero = torch.nonzero(x)  # an unbacked (data-dependent) size
        assert fresh_outputs(nonzero, [x]) is None


def test_the_key_tells_constants_shapes_and_dtypes_apart():
    def graph(fn, *args):
        gm = torch.fx.symbolic_trace(fn)
        return piece_key(gm, list(args))

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    assert graph(lambda a: a * 2.0, x) == graph(lambda a: a * 2.0, y)
    assert graph(lambda a: a * 2.0, x) != graph(lambda a: a * 3.0, x)
    assert graph(lambda a: a * 2.0, x) != graph(lambda a: a * 2.0, torch.randn(4, 9))
    assert graph(lambda a: a * 2.0, x) != graph(lambda a: a * 2.0, x.double())
    assert graph(lambda a: a * 2.0, x) != graph(lambda a: a * 2.0, x.t())  # strides
    assert graph(lambda a: a + 1, x) != graph(lambda a: a - 1, x)


def test_state_the_key_cannot_compare_makes_a_piece_its_own():
    class WithConstant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("c", torch.ones(8))

        def forward(self, a):
            return a * self.c

    gm = torch.fx.symbolic_trace(WithConstant())  # a get_attr node: the buffer's values are not in the key
    assert piece_key(gm, [torch.randn(4, 8)]) is None
    assert piece_key(torch.fx.symbolic_trace(lambda a: a * 2), [object()]) is None


def test_a_full_graph_compiled_by_pieces_compiles_each_distinct_layer_once_and_equals_eager(monkeypatch):
    """Config(full_compile="pieces"): mode="full" cuts its graph at the split ops, compiles the distinct pieces
    (first, one middle layer, last) instead of the whole graph, and still captures one graph per size whose
    greedy tokens (decode steps of 3 rows replay the size-4 graph, padded) equal eager's and the whole-graph
    compile's."""
    model = Decoder.random(dataclasses.replace(TINY, num_layers=5), seed=0).eval()
    prompts = [[3, 1, 4], [1, 5, 9, 2, 6]]
    outputs = {}
    for how in ("whole", "pieces"):
        compiled = _counting(monkeypatch)
        cache = KVCache.for_sequences(model.config, 4, 48)
        graphed = piecegraph.compile(model, mode="full", capture_sizes=(1, 2, 4), emulate_graphs=True,
                                     full_compile=how)
        graphed.capture(lambda n, cache=cache: dummy_inputs(model, cache, n))
        assert graphed.stats()["pieces"] == 1  # one graph per size either way
        assert len(compiled) == (1 if how == "whole" else 3)
        outputs[how] = generate(model, prompts + [[2, 7]], 6, cache=cache, decode_fn=graphed)  # 3 rows: padded
        monkeypatch.undo()
    assert outputs["pieces"] == outputs["whole"] == generate(model, prompts + [[2, 7]], 6)


def test_full_compile_is_refused_unless_auto_whole_or_pieces():
    with pytest.raises(ValueError, match=r"full_compile='layers' is not one of \('auto', 'whole', 'pieces'\)"):
        piecegraph.Config(full_compile="layers")
