"""A restored graph's pieces are compiled for the fakes its one propagation kept (trace/live_fakes.py), not for a
second run of the split graph on fakes: the same fakes (metadata, views, aliasing between a piece's inputs), a
load that runs no split graph on fakes, and nothing kept (so a second run) when a node changes a tensor's
metadata in place. Against eager; compiler "eager" (no Inductor needed), graphs emulated on CPU."""

from __future__ import annotations

import pickle
from unittest import mock

import pytest
import torch
from toy import ToyModel  # noqa: F401  (registers the split op pg_toy::mix)

from piecegraph.attention import KVCache
from piecegraph.build import load_trace, trace_model, trace_snapshot
from piecegraph.config import Config
from piecegraph.context import forward_context
from piecegraph.models import TINY, Decoder, dummy_inputs
from piecegraph.ops.split import split_op_names
from piecegraph.trace import live_fakes
from piecegraph.trace.snapshot import restore_graph
from piecegraph.trace.split import split_graph

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIG = Config(mode="piecewise", compiler="eager", capture_sizes=(8,), emulate_graphs=True)


class Views(torch.nn.Module):
    """The piece after the split op takes views of one tensor (aliased inputs) besides the split op's output."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.a, self.b = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.a(x) + pos[:, None].to(x.dtype)
        halves, head = h.view(-1, 2, h.shape[1] // 2), h[:, :4]
        out = torch.empty_like(h)
        torch.ops.pg_toy.mix(h, out)
        return self.b(out) + halves.flip(1).reshape(h.shape) * 0.5 + head.sum(1, keepdim=True)


def _snapshot(model, values, context):
    """``model`` traced on ``values`` (piecewise, eager compiler) and its trace's snapshot."""
    snapshots: list = []
    with forward_context(context), torch.no_grad():
        _, binding = trace_model(model, values, CONFIG, [], snapshots=snapshots)
    taken = trace_snapshot(snapshots[-1], binding, model, CONFIG)
    assert taken is not None
    return taken


def _decoder():
    model, cache = Decoder.random(TINY, seed=0).eval(), KVCache.for_sequences(TINY, 1, 32)
    (_, pos), meta = dummy_inputs(model, cache, 6)
    return model, {"input_ids": torch.arange(6) % TINY.vocab_size, "positions": pos}, meta


def _views():
    return Views().eval(), {"x": torch.randn(6, 16), "pos": torch.arange(6)}, {"n": 6}


def _hf_qwen2():
    """A transformers Qwen2 through piecegraph.hf (rotary embedding: the matmul whose fakes need the Python
    dispatcher), one sequence of 6 tokens."""
    import piecegraph
    from piecegraph.attention import AttentionMetadata

    pytest.importorskip("transformers")
    from test_hf import tiny

    model = piecegraph.compile(tiny("qwen2"), mode="piecewise", capture_sizes=(8,)).model
    cache = KVCache.for_sequences(model.config, 1, 32, page_size=4, backend="torch")
    meta = AttentionMetadata.for_batch(cache, [(0, 0, 6)])
    return model, {"input_ids": torch.arange(6) + 3, "positions": meta.positions}, meta


def _described(value):
    if not isinstance(value, torch.Tensor):
        return (type(value).__name__, str(value))
    return (value.dtype, str(value.device), tuple(map(str, value.shape)), tuple(map(str, value.stride())),
            str(value.storage_offset()), value.requires_grad, value._is_view(), type(value).__name__)


def _aliasing(values):
    storages: dict[int, int] = {}
    return tuple(storages.setdefault(v.untyped_storage()._cdata, len(storages)) if isinstance(v, torch.Tensor)
                 else -1 for v in values)


@pytest.mark.parametrize("make", [_decoder, _views, _hf_qwen2], ids=["decoder", "views", "hf-qwen2"])
def test_the_kept_piece_inputs_are_what_a_second_run_on_fakes_passes(make):
    """Piece by piece: the same dtypes, symbolic sizes and strides, offsets, requires_grad, views, and the same
    inputs sharing storage, as build_program's former second run of the split graph under the same fake mode
    and Python dispatcher."""
    from torch._dispatch.python import enable_python_dispatcher

    model, values, context = make()
    taken = _snapshot(model, values, context)
    with torch.no_grad():
        gm, fakes = restore_graph(taken.graph, pieces=True)
        split_gm, infos = split_graph(gm, split_op_names())
        wanted = {info.name for info in infos if not info.is_split and info.num_ops > 0}
        kept = live_fakes.piece_inputs(split_gm, wanted)
        seen: dict[str, list] = {}

        class Recorder(torch.fx.Interpreter):
            def call_module(self, target, args, kwargs):
                seen[target] = list(args)
                return super().call_module(target, args, kwargs)

        mode = next(f.fake_mode for f in fakes if hasattr(f, "fake_mode"))
        with mode, enable_python_dispatcher():
            Recorder(split_gm).run(*fakes)
    assert kept is not None and list(kept) == [name for name in seen if name in wanted]
    for name, args in kept.items():
        assert [_described(a) for a in args] == [_described(a) for a in seen[name]], name
        assert _aliasing(args) == _aliasing(seen[name]), name
    if make is _views:  # the case the kept values exist for: aliased views among a piece's inputs
        assert any(len(set(_aliasing(args))) < len(args) for args in kept.values())


@pytest.mark.parametrize("make", [_decoder, _views], ids=["decoder", "views"])
def test_a_loaded_program_runs_no_split_graph_on_fakes_and_equals_eager(make):
    """The load of a cached trace propagates fakes once (the restored graph), never through the split graph (a
    GraphModule calling submodules), and computes what eager does. Before, every load ran the split graph on fakes
    a second time (0.8-0.9 s of a warm start on the 0.5B shape)."""
    model, values, context = make()
    taken = _snapshot(model, values, context)
    runs: list[torch.fx.GraphModule] = []
    plain_run = torch.fx.Interpreter.run

    def counted(self, *args, **kwargs):
        runs.append(self.module)
        return plain_run(self, *args, **kwargs)

    runners: list = []
    with mock.patch.object(torch.fx.Interpreter, "run", counted), torch.no_grad():
        binding = load_trace(model, pickle.loads(pickle.dumps(taken)), CONFIG, runners)
    split_runs = [m for m in runs if any(n.op == "call_module" for n in m.graph.nodes)]
    assert len(runs) == 1 and not split_runs
    with forward_context(context), torch.no_grad():
        got = binding.pack(runners[-1](*binding.flatten(values)))
        want = model(*values.values())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _in_place(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    y.unsqueeze_(0)  # the value of y kept at its node (2-d) is not what a later user sees (3-d)
    return y.sum(-1)


def _plain(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).unsqueeze(0).sum(-1)


@pytest.mark.parametrize(("fn", "kept"), [(_plain, True), (_in_place, False)], ids=["plain", "unsqueeze_"])
def test_an_in_place_metadata_change_keeps_no_values(fn, kept):
    """A node that changes a tensor's metadata in place (``unsqueeze_``) would make a kept value stale: then
    nothing is kept, piece_inputs says None, and the pieces are compiled from a second run as before."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = torch.fx.symbolic_trace(fn)
    mode = FakeTensorMode()
    with mode:
        fake = torch.empty(3, 4)
    assert live_fakes.propagate(gm, mode, [fake], keep=True) is kept
    assert all((live_fakes.LIVE in n.meta) is kept for n in gm.graph.nodes if n.op != "output")
    assert all("val" in n.meta for n in gm.graph.nodes if n.op != "output")  # propagated either way
    assert live_fakes.propagate(torch.fx.symbolic_trace(fn), mode, [fake], keep=False) is False
