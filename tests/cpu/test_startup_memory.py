"""Graph memory before capture (graphs/memory.py): the estimator's live bytes equal a second computation (the
traced graph run for real, its tensors tracked as they are allocated and freed), the allocator's rounding by
hand, and Config(graph_memory_limit=...) trimming sizes or refusing, naming the sizes and bytes."""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import piecegraph
from piecegraph.graphs.memory import GraphMemoryError, MiB, block_kind, estimate_graph_memory, pool_for, simulate
from piecegraph.graphs.progress import summary
from piecegraph.ops.split import split_op_names

sys.path.insert(0, str(Path(__file__).parent))
from toy import ToyModel  # noqa: E402  (registers the pg_toy split ops)

pytestmark = pytest.mark.usefixtures("one_thread")


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensors ops allocate that are alive, and the peak: each new storage counted once, freed
    when the last tensor on it dies. Split ops run untracked (outside the graphs: not the pool's)."""

    def __init__(self, split: frozenset[str], inputs: list[torch.Tensor]):
        super().__init__()
        self.split = split
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        self.holders: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in self.split:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.inputs:
            return  # an input's memory (or a view of it)
        if ptr not in self.holders:  # a new storage (perhaps at a freed one's address)
            self.holders[ptr], self.sizes[ptr] = 0, t.untyped_storage().nbytes()
            self.live += self.sizes[ptr]
            self.peak = max(self.peak, self.live)
        self.holders[ptr] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        self.holders[ptr] -= 1
        if self.holders[ptr] == 0:
            del self.holders[ptr]
            self.live -= self.sizes[ptr]


def _trace(model: torch.nn.Module, *args: torch.Tensor):
    """The Dynamo graph piecegraph would get (token dim dynamic), and its example inputs."""
    got = []

    def backend(gm, example_inputs):
        got.append((gm, example_inputs))
        return gm

    for a in args:
        torch._dynamo.mark_dynamic(a, 0)
    with piecegraph.forward_context({"n": args[0].shape[0]}):
        torch.compile(model, backend=backend, fullgraph=True)(*args)
    return got[0]


def _symbols(gm):
    fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    return {f.node.expr for f in fakes if isinstance(f, torch.SymInt)}


def _measured_peak(gm, example_inputs, size: int, split: frozenset[str]) -> int:
    """Run the traced graph at ``size`` tokens (FX frees each value after its last use) and track its tensors."""
    inputs = [size if isinstance(a, torch.SymInt) else
              (torch.randn(size, *a.shape[1:]).to(a.dtype) if _is_token(a) else a) for a in example_inputs]
    tracker = LiveBytes(split, [a for a in inputs if isinstance(a, torch.Tensor)])
    with piecegraph.forward_context({"n": size}), torch.no_grad(), tracker:
        torch.fx.Interpreter(gm).run(*inputs)
    return tracker.peak


def _is_token(a) -> bool:
    return isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) and a.dim() >= 1


def test_estimated_live_bytes_equal_the_graph_run_and_tracked_at_every_size():
    model = ToyModel(dim=48, layers=3).eval()
    gm, example = _trace(model, torch.randn(6, 48), torch.arange(6))
    split = split_op_names()
    sizes = (1, 8, 64, 300)
    memory = estimate_graph_memory(gm, _symbols(gm), sizes, split, compiler="eager", mode="piecewise")
    names = frozenset(n.split("::")[-1] for n in split) | split
    for size in sizes:
        assert memory.live[size] == _measured_peak(gm, example, size, names), size
    assert memory.live[300] > memory.live[64] > memory.live[1] > 0
    inductor = estimate_graph_memory(gm, _symbols(gm), sizes, split, compiler="inductor", mode="piecewise")
    assert 0 < inductor.live[300] <= memory.live[300]  # fused pointwise chains materialize less


def test_allocator_rounding_by_hand():
    assert block_kind(1) == ("small", 512) and block_kind(513) == ("small", 1024)
    assert block_kind(MiB) == ("small", MiB) and block_kind(MiB + 1) == ("mid", MiB + 512)
    assert block_kind(11 * MiB + 5) == ("large", 12 * MiB)
    assert pool_for({"small": 3 * MiB, "mid": 0, "large": 0}) == 4 * MiB
    assert pool_for({"small": 1, "mid": 21 * MiB, "large": 12 * MiB}) == 2 * MiB + 40 * MiB + 12 * MiB
    # a, then b while a lives, a freed after b, c alone: the peak is a + b
    order = ["a", "b", "c"]
    assert simulate(order, {"a": 4096, "b": 2 * MiB, "c": 100}, {"a": 1, "b": 1, "c": 2}) == (
        4096 + 2 * MiB, 2 * MiB + 20 * MiB)
    # a resident cuBLAS workspace (32 MiB: its own segment) is in the pool, not among the live tensors
    assert simulate(order, {"a": 4096}, {"a": 0}, resident=32 * MiB) == (4096, 2 * MiB + 32 * MiB)


def test_cublas_workspace_follows_its_environment_variable(monkeypatch):
    from piecegraph.graphs.memory import cublas_workspace_bytes

    assert cublas_workspace_bytes() == 0 or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert cublas_workspace_bytes() == 32 * MiB
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_bytes() == 8 * MiB + 128 * 1024


DIM = 256  # 1024 tokens of it take more than the 2 MiB segment that 64 tokens fit in


def _inputs(n: int):
    return (torch.randn(n, DIM), torch.arange(n)), {"n": n}


def test_memory_limit_trims_the_sizes_over_it_naming_them_and_they_run_without_graphs():
    model = ToyModel(dim=DIM, layers=3).eval()
    probe = piecegraph.compile(model, compiler="eager", capture_sizes=(8, 64, 1024), emulate_graphs=True)
    probe.capture(_inputs, [8])
    estimate = probe.stats()["graph_memory"]["estimate_bytes"]
    assert estimate[8] <= estimate[64] < estimate[1024]
    limit = (estimate[64] + estimate[1024]) // 2
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=(8, 64, 1024), emulate_graphs=True,
                                 graph_memory_limit=limit)
    with pytest.warns(UserWarning, match=r"capture sizes \[1024\] need an estimated graph pool over the limit"):
        graphed.capture(_inputs, [8, 64])
    x, pos = torch.randn(300, DIM), torch.arange(300)
    with piecegraph.forward_context({"n": 300}):
        torch.testing.assert_close(graphed(x, pos), model(x, pos))  # above the kept sizes: no graph, still right
    stats = graphed.stats()
    assert stats["graph_memory"]["left_out"] == [1024] and stats["fallbacks"] == 1
    assert stats["graph_memory"]["pool_estimate_bytes"] == estimate[64]


def test_memory_limit_below_every_size_refuses_naming_sizes_and_bytes():
    model = ToyModel(dim=DIM, layers=3).eval()
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=(8, 64), emulate_graphs=True,
                                 graph_memory_limit=1000)
    with pytest.raises(GraphMemoryError, match=r"no capture size fits.*8: \d.*MiB, 64: "):
        graphed.capture(_inputs, [8])


def test_pool_measured_before_capture_refuses_sizes_over_the_limit_and_they_run_without_graphs(monkeypatch):
    """The measurement before the first capture (graphs/memory.py: measured_pool_bytes, CUDA only; here a stand-in
    that runs the size and reports 1 GiB per token): a size measured over graph_memory_limit is refused with a
    warning naming it and its bytes, its calls run without graphs (equal to eager), and the next size is measured;
    the first size under the limit is the one reported, and no later size is measured again."""
    import piecegraph.runner.replay

    measured = []

    def stand_in(run):
        out = run()
        rows = (out[0] if isinstance(out, (tuple, list)) else out).shape[0]
        measured.append(rows)
        return rows << 30

    monkeypatch.setattr(piecegraph.runner.replay, "measured_pool_bytes", stand_in)
    model = ToyModel(dim=DIM, layers=3).eval()
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=(8, 64, 1024), emulate_graphs=True,
                                 graph_memory_limit=100 << 30)  # above every estimate: only the measurement trims
    with pytest.warns(UserWarning, match=r"capture size 1024 needs 1048576.0 MiB of graph pool, measured before"):
        graphed.capture(_inputs)
    assert measured == [1024, 64]
    for n in (300, 40, 5):
        x, pos = torch.randn(n, DIM), torch.arange(n)
        with piecegraph.forward_context({"n": n}):
            torch.testing.assert_close(graphed(x, pos), model(x, pos))
    stats = graphed.stats()
    memory = stats["graph_memory"]
    assert memory["over_limit"] == {1024: 1024 << 30} and memory["measured_size"] == 64
    assert memory["pool_measured_bytes"] == (64 << 30) + memory["workspace_bytes"]
    assert sorted(stats["capture_s"]) == [8, 64] and stats["fallbacks"] == 1 and measured == [1024, 64]
    assert "measured before capture 65536.0 MiB" in summary(graphed.startup_report())


def test_a_pool_the_allocator_refuses_leaves_the_capture_unmeasured_and_logged(monkeypatch, caplog):
    """Another allocator backend may refuse a MemPool: measured_pool_bytes says so in the log and returns None
    (the capture goes on as without a measurement) instead of failing the capture."""
    import logging

    from piecegraph.graphs.memory import measured_pool_bytes

    def refuse():
        raise RuntimeError("MemPool is not supported by this allocator")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "MemPool", refuse, raising=False)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda pool: None, raising=False)
    ran = []
    with caplog.at_level(logging.INFO, logger="piecegraph"):
        assert measured_pool_bytes(lambda: ran.append(1)) is None
    assert not ran and "graph memory not measured before capture (RuntimeError: MemPool is not" in caplog.text
