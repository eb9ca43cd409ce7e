"""Static compiles per size (Config.compile_sizes): the listed capture sizes warm up and capture pieces Inductor
compiled for that static token count, every other size (and every call without a graph) the one dynamic compile;
the answers equal eager either way. Graph semantics emulated on CPU (emulate_graphs=True)."""

from __future__ import annotations

import pytest
import torch

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.models import TINY, Decoder, dummy_inputs, generate


class Block(torch.nn.Module):
    """Token-wise work with a reduction over the hidden dim (where static and dynamic code differ most)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.up(x))
        scale = h.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
        return x + self.down(h / scale) * scale


def test_listed_sizes_capture_static_code_and_every_size_equals_eager():
    model = Block().eval()
    graphed = piecegraph.compile(model, capture_sizes=(2, 4, 8), compile_sizes=(4,), emulate_graphs=True,
                                 warmup_runs=1)
    for n in (4, 3, 8, 1, 11):  # 3 pads to 4 (static code), 11 is above every size (no graph)
        x = torch.randn(n, 32)
        torch.testing.assert_close(graphed(x), model(x), rtol=1e-5, atol=1e-5)
    (piece,) = graphed.runner.program.pieces
    assert set(piece.static) == {4}
    assert piece.captured[4].fn is piece.static[4]  # size 4 captured its own compile
    assert piece.captured[8].fn is piece.fn and piece.captured[2].fn is piece.fn
    stats = graphed.stats()
    assert stats["static_sizes"] == {4: {"static": 1, "dynamic": 0, "ms": {}}}
    assert stats["static_compile_s"] > 0


def test_auto_compiles_every_capture_size_for_the_reference_decoder_with_split_ops():
    model = Decoder.random(TINY, seed=0).eval()
    cache = KVCache.for_sequences(model.config, 3, 48)
    prefill = piecegraph.compile(model, mode="piecewise", capture_sizes=(8, 16), compile_sizes="auto",
                                 emulate_graphs=True)
    prefill.capture(lambda n: dummy_inputs(model, cache, n))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]]  # 12 tokens: the 16-token graphs
    assert generate(model, prompts, 4, cache=cache, prefill_fn=prefill) == generate(model, prompts, 4)
    pieces = prefill.runner.program.pieces
    assert pieces and all(set(p.static) == {8, 16} for p in pieces)
    # On CPU nothing is timed: every piece keeps its static code for every size.
    assert prefill.stats()["static_sizes"] == {8: {"static": len(pieces), "dynamic": 0, "ms": {}},
                                               16: {"static": len(pieces), "dynamic": 0, "ms": {}}}


def test_compile_sizes_are_checked_where_they_are_written():
    with pytest.raises(ValueError, match=r"compile_sizes=8 must be a list of capture sizes"):
        piecegraph.Config(compile_sizes=8)
    with pytest.raises(ValueError, match=r"\[3\] not among the capture sizes \(1, 2, 4\)"):
        piecegraph.Config(capture_sizes=(1, 2, 4), compile_sizes=(2, 3))
    assert piecegraph.Config(capture_sizes=(1, 4), compile_sizes="auto").static_compile_sizes == (1, 4)
    assert piecegraph.Config(capture_sizes=(1, 4), compile_sizes=[4, 4]).compile_sizes == (4,)


class TensorScale(torch.nn.Module):
    """Per-tensor scaling: an amax over every token (what Inductor's dynamic code handles worst)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.abs().amax().clamp(min=1e-6)


def _traced(model: torch.nn.Module, n: int = 6):
    from piecegraph.trace.inputs import token_symbols

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.randn(n, 32)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(model, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    gm = graphs[0]
    fakes = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
    return gm, token_symbols(fakes, 0)


@pytest.mark.parametrize("on_cuda", [True, False])
def test_reductions_compiles_static_sizes_only_for_a_program_that_reduces_over_tokens_on_cuda(on_cuda, monkeypatch):
    from piecegraph.trace.backend import _static_sizes
    from piecegraph.trace.mixing import find_token_mixing

    config = piecegraph.Config(capture_sizes=(1, 16, 256), compile_sizes="reductions")
    reducing, token_wise = _traced(TensorScale()), _traced(Block().eval())
    found = {name: bool(find_token_mixing(gm, sym)) for name, (gm, sym) in (("reducing", reducing),
                                                                         ("token_wise", token_wise))}
    assert found == {"reducing": True, "token_wise": False}  # the amax over hidden is row-wise
    monkeypatch.setattr(torch.cuda, "is_available", lambda: on_cuda)
    assert _static_sizes(config, reducing[1], True) == ((1, 16, 256) if on_cuda else ())
    assert _static_sizes(config, token_wise[1], False) == ()
    assert _static_sizes(config.replace(emulate_graphs=True), reducing[1], True) == ()  # nothing measured


def test_auto_mode_defaults_to_static_code_where_the_program_reduces_and_other_modes_to_none():
    assert piecegraph.Config().compile_sizes is None and piecegraph.Config().static_compile_sizes == ()
    seen = []

    def try_trace(values, config, verify_sizes):
        seen.append(config)

    from piecegraph.graphed.auto import setup_auto

    setup_auto(torch.nn.Identity(), {}, piecegraph.Config(mode="auto"), None, try_trace, None)
    setup_auto(torch.nn.Identity(), {}, piecegraph.Config(mode="auto", compile_sizes=()), None, try_trace, None)
    assert [c.compile_sizes for c in seen] == ["reductions", ()] and seen[0].mode == "piecewise"
