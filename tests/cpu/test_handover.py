"""A program's compiled pieces handed to another program cut from the same trace (trace/handover.py): an engine's
full module compiled by pieces takes its piecewise module's compiled pieces instead of compiling them again, and
a cut that differs in anything deciding the pieces' code (a constant, a shape, a dtype, the compiler) takes
nothing. Graph semantics emulated on CPU."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from toy import ToyModel  # noqa: F401  (registers the pg_toy split ops)

import piecegraph.trace.backend as backend
from piecegraph.context import forward_context
from piecegraph.models import TINY, Decoder, generate
from piecegraph.ops.split import split_op_names
from piecegraph.serve import Engine, EngineConfig, SamplingParams
from piecegraph.trace.aot_load import bind_pieces
from piecegraph.trace.handover import cut_fingerprint, offer, take
from piecegraph.trace.split import split_graph


def _blocks(scales: tuple[float, ...]):
    """Blocks around the toy split op, each with its Python constant (baked into the graph); weights are graph
    inputs, as Dynamo lifts parameters."""

    def run(x, *weights):
        for i, scale in enumerate(scales):
            h = torch.tanh((x @ weights[2 * i]) * scale) @ weights[2 * i + 1]
            out = torch.empty_like(h)
            torch.ops.pg_toy.mix(h, out)
            x = x + out
        return x

    return run


def _cut(scales, widths, dtype, n, seed):
    g = torch.Generator().manual_seed(seed)
    weights = [w.to(dtype) for width in widths for w in (torch.randn(16, width, generator=g) / 4,
                                                         torch.randn(width, 16, generator=g) / 4)]
    args = [torch.randn(n, 16, generator=g).to(dtype), *weights]
    fn = _blocks(scales)
    with forward_context({"n": n}):
        gm = make_fx(fn)(*args)
    split_gm, infos = split_graph(gm, split_op_names())
    return fn, args, split_gm, infos


def _pieces(split_gm, infos):
    return {i.name: getattr(split_gm, i.name) for i in infos if i.compiled}


CHANGES = ("none", "scale", "width", "dtype", "layers")


@settings(max_examples=25, deadline=None)
@given(scales=st.lists(st.sampled_from([0.5, 2.0]), min_size=1, max_size=3),
       widths=st.lists(st.sampled_from([8, 24]), min_size=4, max_size=4), f64=st.booleans(),
       change=st.sampled_from(CHANGES), n=st.integers(2, 6))
def test_pieces_are_taken_exactly_when_the_cut_is_the_same_program_and_never_change_an_answer(scales, widths, f64,
                                                                                              change, n):
    """A's compiled pieces (its pieces as the eager compiler keeps them: they compute A's constants) are offered to
    B, which is A or A with one thing changed (its last block's constant or width, the dtype, one more block). B
    takes them exactly when it is the same program, and what B then computes, on its own weights and inputs,
    equals B run eagerly."""
    a = (list(scales), widths[:len(scales)], torch.float64 if f64 else torch.float32)
    b = (list(scales), widths[:len(scales)], a[2])
    if change == "scale":
        b[0][-1] = 2.5 - b[0][-1]
    elif change == "width":
        b[1][-1] = 32 - b[1][-1]
    elif change == "dtype":
        b = (b[0], b[1], torch.float32 if f64 else torch.float64)
    elif change == "layers":
        b = (b[0] + [0.5], widths[:len(scales) + 1], a[2])
    _, args_a, split_a, infos_a = _cut(tuple(a[0]), a[1], a[2], n, seed=0)
    fn_b, args_b, split_b, infos_b = _cut(tuple(b[0]), b[1], b[2], n, seed=1)
    offered = offer(cut_fingerprint(split_a, infos_a, args_a), "eager", _pieces(split_a, infos_a))
    taken = take(offered, split_b, infos_b, args_b, "eager")
    assert (taken is not None) == (change == "none")
    if taken is None:
        return
    assert all(taken[name] is getattr(split_a, name) for name in taken)  # A's code, not B's
    with forward_context({"n": n}):
        got, want = bind_pieces(split_b, infos_b, taken)(*args_b), fn_b(*args_b)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_another_compiler_takes_nothing_and_a_constant_is_the_takers_own():
    _, args, split_gm, infos = _cut((2.0,), [8], torch.float32, 3, seed=0)
    fingerprint = cut_fingerprint(split_gm, infos, args)
    assert fingerprint is not None
    offered = offer(fingerprint, "eager", _pieces(split_gm, infos))
    assert take(offered, split_gm, infos, args, "eager") is not None
    assert take(offered, split_gm, infos, args, "inductor") is None
    assert take(None, split_gm, infos, args, "eager") is None

    class WithConstant(torch.nn.Module):  # symbolic_trace keeps the buffer as a get_attr node
        def __init__(self, value: float):
            super().__init__()
            self.register_buffer("c", torch.full((16,), value))

        def forward(self, x):
            h = x * self.c
            out = torch.empty_like(h)
            torch.ops.pg_toy.mix(h, out)
            return out + self.c

    # The split module reads the constant and passes it to the pieces as an input: a piece taken from a program
    # whose constant differs still computes with this program's own.
    cuts = {value: split_graph(torch.fx.symbolic_trace(WithConstant(value)), split_op_names()) for value in (1., 2.)}
    x = torch.randn(3, 16)
    (split_a, infos_a), (split_b, infos_b) = cuts[1.], cuts[2.]
    taken = take(offer(cut_fingerprint(split_a, infos_a, [x]), "eager", _pieces(split_a, infos_a)), split_b,
                 infos_b, [x], "eager")
    assert taken is not None
    with forward_context({"n": 3}):
        torch.testing.assert_close(bind_pieces(split_b, infos_b, taken)(x), WithConstant(2.)(x), rtol=0, atol=0)


def test_an_engines_full_module_takes_the_piecewise_pieces_and_decodes_as_eager(monkeypatch):
    """``EngineConfig(share_trace=True, full_compile="pieces")``: the pieces are compiled (by Inductor) once for both
    modules (the full module's ``stats()["startup"]["pieces"]`` says ``"shared"``), and greedy tokens equal the
    model's own decoding, full graphs replayed for the decode steps."""
    passes = []
    real = backend._compile_pieces
    monkeypatch.setattr(backend, "_compile_pieces", lambda *a, **k: passes.append(1) or real(*a, **k))
    model = Decoder.random(TINY, seed=3).eval()
    engine = Engine(model, EngineConfig(mode="auto", max_num_seqs=3, max_num_batched_tokens=16, max_seq_len=48,
                                        emulate_graphs=True, decode_sizes=(1, 2, 4), prefill_sizes=(4, 8, 16),
                                        share_trace=True, full_compile="pieces"))
    startup = engine.executor.decode.module.stats()["startup"]
    assert startup["trace"] == "shared" and startup["pieces"] == "shared"
    assert len(passes) == 1  # the piecewise module's pass only
    prompts = [[3, 1, 4, 1], [5, 9], [2, 6, 5, 3, 5]]
    assert engine.generate(prompts, SamplingParams(max_new_tokens=6)) == generate(model, prompts, 6)
    assert {s.kind for s in engine.steps} >= {"full", "piecewise"}
