"""The warm start's snapshot in parts, without a cache directory: a binding restored only on the tensors it was
taken from, the pickled snapshot round trip never changing an answer (property test, eager compiler: no Inductor
needed), only a dynamic trace snapshotted, restored fake values equal to what propagating fakes gives, and the
values no spec can state left to that propagation."""

from __future__ import annotations

import pickle

import pytest
import torch
from cache_trace_helpers import Tagged
from hypothesis import given, settings
from hypothesis import strategies as st

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.config import Config
from piecegraph.context import forward_context
from piecegraph.graphed.binding_snapshot import resolve_source, restore_binding, snapshot_binding
from piecegraph.graphed.build import load_trace, trace_model, trace_snapshot
from piecegraph.models import TINY, Decoder, dummy_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_binding_is_restored_only_on_the_tensors_it_was_taken_from():
    model = Decoder.random(TINY, seed=0).eval()
    cache = KVCache.for_sequences(TINY, 2, 32)
    (ids, pos), meta = dummy_inputs(model, cache, 4)
    runners: list = []
    with forward_context(meta), torch.no_grad():
        _, binding = trace_model(model, {"input_ids": ids, "positions": pos}, Config(mode="none"), runners)
    snapshot = snapshot_binding(binding, model)
    source = next(b.name for b in binding.inputs if b.source.value == "module")
    assert resolve_source(source, model) is next(b.value for b in binding.inputs if b.name == source)
    restored = restore_binding(snapshot, Decoder.random(TINY, seed=1).eval())  # same shapes: fine
    assert [b.name for b in restored.inputs] == [b.name for b in binding.inputs]
    other = Decoder.random(TINY.__class__(**{**TINY.__dict__, "hidden_size": 32}), seed=0).eval()
    with pytest.raises(LookupError, match="is not the"):
        restore_binding(snapshot, other)
    with pytest.raises(LookupError):
        resolve_source("G['torch'].ones", model)


@settings(max_examples=12, deadline=None)
@given(scale=st.sampled_from([0.5, 1.0, 3.0]), layers=st.integers(1, 3), shift=st.sampled_from([0.0, 2.0]),
       n=st.integers(1, 9), later=st.integers(1, 9))
def test_the_snapshot_round_trip_never_changes_an_answer(scale, layers, shift, n, later):
    model = Tagged(scale, layers).eval()
    config = Config(mode="piecewise", compiler="eager", capture_sizes=(4, 8), emulate_graphs=True)

    def args(k: int) -> dict:
        g = torch.Generator().manual_seed(k)
        return {"x": torch.randn(k, 16, generator=g), "pos": torch.arange(k), "shift": shift}

    runners: list = []
    snapshots: list = []
    with forward_context({"n": n}), torch.no_grad():
        _, binding = trace_model(model, args(n), config, runners, snapshots=snapshots)
    taken = trace_snapshot(snapshots[-1], binding, model, config)
    assert taken is not None  # this model snapshots: the trace is plain (tensors, ints, floats)
    snapshot = pickle.loads(pickle.dumps(taken))
    loaded_runners: list = []
    loaded = load_trace(model, snapshot, config, loaded_runners)
    for k in (n, later):
        values = args(k)
        with forward_context({"n": k}), torch.no_grad():
            want = model(**values)
            traced = binding.pack(runners[-1](*binding.flatten(values)))
            got = loaded.pack(loaded_runners[-1](*loaded.flatten(values)))
        torch.testing.assert_close(traced, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="differs from the traced shift"):
        loaded.flatten({**args(2), "shift": shift + 1.0})  # the baked constant is checked after loading too


def test_only_a_dynamic_trace_is_snapshotted():
    """A static trace's token count is read off Dynamo's sources, which a snapshot does not keep: not taken."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from piecegraph.trace.snapshot import snapshot_graph

    gm = torch.fx.symbolic_trace(lambda a: a * 2)
    with FakeTensorMode():
        fake = torch.empty(4, 8)
    assert snapshot_graph(gm, [fake], ["L['kwargs']['a']"], [False]) is None
    assert snapshot_graph(gm, [torch.empty(4, 8)], ["L['kwargs']['a']"], [False]) is None  # not a fake at all


def _traced_snapshot(model: torch.nn.Module, n: int):
    from piecegraph.attention import AttentionMetadata

    cache = KVCache.for_sequences(model.config, 2, 48)
    meta = AttentionMetadata.for_batch(cache, [(0, 0, n)])
    values = {"input_ids": torch.arange(n) % model.config.vocab_size, "positions": meta.positions}
    snapshots: list = []
    with forward_context(meta), torch.no_grad():
        trace_model(model, values, Config(mode="piecewise", compiler="eager", capture_sizes=(8,),
                                          emulate_graphs=True), [], snapshots=snapshots)
    return snapshots[-1]


def _described(value):
    """A fake value as text: sizes and strides as their expressions, dtype, requires_grad."""
    if isinstance(value, torch.Tensor):
        return ("tensor", [str(s) for s in value.shape], [str(s) for s in value.stride()], value.dtype,
                value.requires_grad)
    if isinstance(value, (tuple, list)):
        return [_described(v) for v in value]
    return str(value)


@pytest.mark.parametrize("which", ["dense", "moe-fp8", "hf-llama"])
def test_restored_values_equal_the_values_fakes_propagate_to(which):
    """A warm start rebuilds each node's fake value from the snapshot's specs instead of running the graph on
    fakes (FakeTensorProp: ~75% of a restore). The independent reference is that propagation itself: every
    node's shape, strides (as expressions in the same symbols), dtype and requires_grad agree. Specs that cannot
    be rebuilt leave the restore to that propagation."""
    import dataclasses

    from piecegraph.models import TINY_MOE, MoEDecoder, quantize_fp8
    from piecegraph.trace.snapshot import restore_graph

    if which == "dense":
        model = Decoder.random(TINY, seed=0).eval()
    elif which == "moe-fp8":
        model = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=0).eval(), kernel="torch")
    else:
        from test_hf import tiny

        model = piecegraph.hf.HFDecoder(tiny("llama"))
    snapshot = _traced_snapshot(model, 7)
    assert snapshot is not None and snapshot.values  # the fast path is taken for this model
    fast, _ = restore_graph(snapshot)
    slow, _ = restore_graph(dataclasses.replace(snapshot, values=b""))
    specs = pickle.loads(snapshot.values)
    unreadable, _ = restore_graph(dataclasses.replace(snapshot, values=pickle.dumps([("?",)] * len(specs))))
    pairs = [(a, b) for restored in (fast, unreadable) for a, b in zip(restored.graph.nodes, slow.graph.nodes)]
    assert len(pairs) == 2 * len(slow.graph.nodes) > 100
    for a, b in pairs:
        for key in ("example_value", "val"):
            assert (key in a.meta) == (key in b.meta), (a.name, key)
            if key in a.meta:
                assert _described(a.meta[key]) == _described(b.meta[key]), (a.name, a.target)


def test_a_value_no_spec_can_state_leaves_the_restore_to_the_propagation():
    """Specs state tensors whose sizes are polynomials in the trace's symbols, SymInts, constants and sequences;
    a floor division, a foreign symbol or an object makes the whole graph's specs None (the restore then
    propagates fakes, as before)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from piecegraph.trace.values import value_specs

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(8, ConstantSource("n")), hint=8)
    name = str(s.node.expr)
    gm = torch.fx.symbolic_trace(lambda a: a * 2)
    node = [n for n in gm.graph.nodes if n.op == "call_function"][0]
    with FakeTensorMode(shape_env=env):
        cases = {"polynomial": (torch.empty(2 * s + 1, 4), True), "symint": (s * s, True),
                 "sequence": ((torch.empty(s), 3, None), True), "floor division": (torch.empty(s // 3), False),
                 "object": (object(), False)}
    for case, (value, stated) in cases.items():
        node.meta["example_value"] = value
        assert (value_specs(list(gm.graph.nodes), {name}) is not None) == stated, case
    node.meta["example_value"] = torch.empty(4)
    assert value_specs(list(gm.graph.nodes), set()) is not None
    with FakeTensorMode(shape_env=env):
        node.meta["example_value"] = torch.empty(s)
    assert value_specs(list(gm.graph.nodes), set()) is None  # a symbol the trace's inputs do not hold
