"""The graph snapshot keeps every write (trace/snapshot.py): in-place methods and operators, ``out=``, and torch
ops that write an argument or return nothing, whether called as packet or overload, although nothing reads their
results and whatever the installed torch's FX dead-code pass calls pure (torch 2.11's called an op packet's node
pure, and a cached start on the H200 lost every attention op); a restored graph that calls the writing ops fewer
times than Dynamo's is refused. Against eager; graphs emulated on CPU."""

from __future__ import annotations

import contextlib
import logging
import pickle
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.config import Config
from piecegraph.context import forward_context
from piecegraph.graphed.build import load_trace, trace_model, trace_snapshot
from piecegraph.models import TINY, Decoder, dummy_inputs
from piecegraph.trace import snapshot as snapshot_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pgwrites")


_LIB = torch.library.Library("pgtest_writes", "DEF")  # ops that write one argument and return nothing
_LIB.define("bump(Tensor(a!) y) -> ()")
_LIB.define("scaled_into(Tensor x, Tensor(a!) out) -> ()")


def _bump(y: torch.Tensor) -> None:
    y.add_(0.75)


def _scaled_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2.0)


_LIB.impl("bump", _bump, "CPU")
_LIB.impl("scaled_into", _scaled_into, "CPU")
torch.library.register_fake("pgtest_writes::bump", lambda y: None, lib=_LIB)
torch.library.register_fake("pgtest_writes::scaled_into", lambda x, out: None, lib=_LIB)

# In-place writes whose result nothing reads: Dynamo records them as nodes without users (``y.add_(1)`` as a
# call_method), which FX's dead-code pass calls pure. Each entry: name -> f(y, pos), writing y in place. (A
# model writing ``y[i] = v`` is not snapshotted at all: FX cannot re-trace a Proxy's item assignment, so such a
# model traces on every start.)
INPLACE = {
    "op packet": lambda y, pos: torch.ops.pgtest_writes.bump(y),  # Dynamo records the packet
    "op overload": lambda y, pos: torch.ops.pgtest_writes.scaled_into.default(y * 0.5, y),
    "add_": lambda y, pos: y.add_(1.5),
    "mul_": lambda y, pos: y.mul_(-2.0),
    "clamp_": lambda y, pos: y.clamp_(-0.5, 0.5),
    "copy_": lambda y, pos: y.copy_(y.flip(-1)),
    "index_copy_": lambda y, pos: y.index_copy_(0, pos, y * 0.5),  # (an index FX would fold to a constant refuses)
    "masked_fill_": lambda y, pos: y.masked_fill_(y > 0.3, 7.0),
    "slice mul_": lambda y, pos: y[:, :4].mul_(5.0),
    "torch.Tensor.sub_": lambda y, pos: torch.Tensor.sub_(y, 0.25),
    "zero_ slice": lambda y, pos: y[:, -2:].zero_(),
}


class Writes(torch.nn.Module):
    """Linear, then a sequence of in-place writes to the activation (results unused), then linear again."""

    def __init__(self, ops: list[str]) -> None:
        super().__init__()
        self.a, self.b, self.ops = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), ops
        torch.manual_seed(0)
        for lin in (self.a, self.b):
            torch.nn.init.normal_(lin.weight, std=0.3)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        for op in self.ops:
            INPLACE[op](y, pos)
        z = self.b(y)
        z += 1.0  # an in-place operator: Dynamo records operator.iadd
        return z


@contextlib.contextmanager
def _fx_purity(known: bool):
    """FX's own purity verdicts as they are (``known``), or none at all (every node pure but placeholders and
    outputs) while the snapshot drops dead nodes: what survives then is what piecegraph itself recognises as a
    write. torch 2.11's FX called a node of an op packet pure, torch 2.13's does not: the snapshot must not
    depend on which torch it runs on."""
    if known:
        yield
        return
    original = snapshot_module._live_copy

    def live_copy(graph):
        with mock.patch.object(torch.fx.Node, "is_impure", lambda node, *a, **k: node.op in ("placeholder", "output")):
            return original(graph)

    with mock.patch.object(snapshot_module, "_live_copy", live_copy):
        yield


@settings(max_examples=10, deadline=None)  # a Dynamo trace each (~5 s on CI's CPU)
@given(ops=st.lists(st.sampled_from(sorted(INPLACE)), min_size=2, max_size=5, unique=True), n=st.integers(2, 9),
       fx_knows=st.booleans())
def test_in_place_writes_survive_the_snapshot_and_the_program_equals_eager(ops, n, fx_knows):
    """Property: whatever in-place writes a model makes (results unused: in-place methods, operators, custom ops
    that write an argument, called as packet or overload), the program built from the snapshot (what a cold start
    with the cache runs) and the one loaded from it (a warm start) equal eager, whether or not FX itself calls
    the writes impure."""
    model = Writes(ops).eval()
    config = Config(mode="piecewise", compiler="eager", capture_sizes=(4, 8), emulate_graphs=True)
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
    runners: list = []
    snapshots: list = []
    with forward_context({"n": n}), torch.no_grad(), _fx_purity(fx_knows):
        _, binding = trace_model(model, {"x": x, "pos": torch.arange(n)}, config, runners, snapshots=snapshots)
    taken = trace_snapshot(snapshots[-1], binding, model, config)
    assert taken is not None
    loaded_runners: list = []
    with _fx_purity(fx_knows):
        loaded = load_trace(model, pickle.loads(pickle.dumps(taken)), config, loaded_runners)
    with forward_context({"n": n}), torch.no_grad():
        want = model(x, torch.arange(n))
        values = {"x": x, "pos": torch.arange(n)}
        traced = binding.pack(runners[-1](*binding.flatten(values)))
        got = loaded.pack(loaded_runners[-1](*loaded.flatten(values)))
    torch.testing.assert_close(traced, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_in_place_writes_through_inductor_and_the_cache_equal_eager(root):
    """The same end to end: piecegraph.compile with the artifact cache, Inductor, a cold then a warm start."""
    model, x = Writes(["add_", "slice mul_", "index_copy_"]).eval(), torch.randn(5, 16)
    traces = []
    for _ in range(2):
        graphed = piecegraph.compile(model, mode="piecewise", capture_sizes=(4, 8), emulate_graphs=True,
                                     cache_dir=root / "writes")
        with forward_context({"n": 5}), torch.no_grad():
            torch.testing.assert_close(graphed(x, torch.arange(5)), model(x, torch.arange(5)), rtol=1e-5, atol=1e-5)
        traces.append(graphed.stats()["startup"]["trace"])
    assert traces == ["traced", "loaded"]


def _decoder_step():
    """The tiny decoder, one step's metadata and arguments (6 tokens), and an empty snapshot list."""
    model, cache = Decoder.random(TINY, seed=0).eval(), KVCache.for_sequences(TINY, 1, 32)
    (_, pos), meta = dummy_inputs(model, cache, 6)
    return model, meta, {"input_ids": torch.arange(6) % TINY.vocab_size, "positions": pos}, []


def _traced_and_eager(model, values, snapshots):
    """The program traced (piecewise, eager compiler, snapshotting into ``snapshots``) and eager, on ``values``."""
    config = Config(mode="piecewise", compiler="eager", capture_sizes=(8,), emulate_graphs=True)
    call, _ = trace_model(model, values, config, [], snapshots=snapshots)
    return call(**values), model(values["input_ids"], values["positions"])


def test_the_decoders_attention_ops_survive_the_snapshot_whatever_fx_calls_pure():
    """The H200's torch 2.11 called Dynamo's ``torch.ops.piecegraph_models.attention(...)`` node (an op packet
    whose result nobody uses) pure: the snapshot dropped every attention op with the projections feeding it, and
    a cached start served wrong tokens from the first one. With FX's verdicts off, every layer's op stays and the
    restored program equals eager."""
    from piecegraph.trace.snapshot import restore_graph

    model, meta, values, snapshots = _decoder_step()
    with forward_context(meta), torch.no_grad(), _fx_purity(False):
        got, want = _traced_and_eager(model, values, snapshots)
        gm, _ = restore_graph(snapshots[-1])
    attention = [n for n in gm.graph.nodes if "piecegraph_models.attention" in str(n.target)]
    assert len(attention) == TINY.num_layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_snapshot_that_lost_a_writing_op_is_refused_and_the_start_traces(caplog):
    """The guard behind the snapshot's dead-code rule: were a write lost anyway (a torch whose FX calls yet
    another writing node pure), the restored graph calls the writing ops fewer times than Dynamo's, so the start
    keeps Dynamo's graph, snapshots nothing (warm starts trace) and still equals eager."""
    model, meta, values, snapshots = _decoder_step()
    blind = mock.patch.object(snapshot_module, "_writes", lambda node: node.op in ("placeholder", "output"))
    with forward_context(meta), torch.no_grad(), blind, caplog.at_level(logging.WARNING, logger="piecegraph"):
        got, want = _traced_and_eager(model, values, snapshots)
    assert snapshots == [None]
    assert any("piecegraph_models.attention" in r.getMessage() and "warm starts will trace" in r.getMessage()
               for r in caplog.records)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
