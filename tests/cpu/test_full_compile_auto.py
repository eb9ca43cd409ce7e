"""``Config(full_compile="auto")``, the default: a full graph compiles by pieces (a fast cold start) only where a
background worker will package the whole graph for the module to swap in; without a cache, or after this cache's
worker failed for the entry, it compiles whole, so its steps are never left on the slower program for good.
Graphs emulated on CPU; the worker is a stand-in (test_aot_background.py runs real ones)."""

from __future__ import annotations

import hashlib

import pytest
import torch

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.cache.packaging import WORKER_REVISION, read_state, worker_refusal, write_state
from piecegraph.models import TINY, Decoder, dummy_inputs, generate

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]]


def _start(root, **options):
    model = Decoder.random(TINY, seed=0).eval()
    cache = KVCache.for_sequences(TINY, 3, 48)
    graphed = piecegraph.compile(model, mode="full", capture_sizes=(1, 2, 4), emulate_graphs=True, **options)
    graphed.capture(lambda n: dummy_inputs(model, cache, n))
    assert generate(model, PROMPTS, 4, cache=cache, decode_fn=graphed) == generate(model, PROMPTS, 4)
    return graphed


@pytest.fixture
def failing_worker(monkeypatch):
    """Workers that start, and fail as a worker whose export raised would (their state written at once)."""
    started = []

    def start(root, key, trace, plan):
        sha = hashlib.sha256(trace).hexdigest()
        refusal = worker_refusal(root, key, torch.__version__, sha)  # as start_worker does
        if refusal is not None:
            return f"not packaged: {refusal}", False
        started.append(key)
        write_state(root, key, state="failed", why="RuntimeError: the unit could not be exported", units=1,
                    torch=torch.__version__, worker=WORKER_REVISION, trace_sha=sha)
        return "packaging 1 units in the background (pid 0)", True

    monkeypatch.setattr("piecegraph.trace.aot_worker.start_worker", start)
    return started


def test_auto_compiles_by_pieces_where_a_worker_packages_the_whole_graph_and_whole_after_it_failed(
        tmp_path, failing_worker):
    assert piecegraph.Config().full_compile == "auto"
    cold = _start(tmp_path, cache_dir=tmp_path, aot_package=True)
    assert cold.runner.program.by_pieces and cold._upgrade is not None  # waiting for the whole graph's package
    assert len(failing_worker) == 1
    # The worker failed: the next start of the entry compiles whole, and waits for nothing
    again = _start(tmp_path, cache_dir=tmp_path, aot_package=True)
    assert again.stats()["startup"]["cache"] == "warm"
    assert not again.runner.program.by_pieces and again._upgrade is None
    assert again.stats()["startup"]["aot"].startswith("not packaged: the background packaging of this entry failed")
    assert len(failing_worker) == 1
    # "pieces" asked for is kept whatever the worker did
    pieces = _start(tmp_path, cache_dir=tmp_path, aot_package=True, full_compile="pieces")
    assert pieces.runner.program.by_pieces


@pytest.mark.parametrize("options", [{"cache_dir": False}, {"aot_package": False}], ids=["no-cache", "no-packages"])
def test_auto_compiles_whole_where_no_package_would_be_swapped_in(tmp_path, failing_worker, options):
    graphed = _start(tmp_path, **{"cache_dir": tmp_path, "aot_package": True, **options})
    assert not graphed.runner.program.by_pieces and graphed._upgrade is None
    assert failing_worker == []


def test_auto_by_pieces_needs_a_background_worker_expected_and_inductor():
    from piecegraph.trace.aot_package import PackageRecorder
    from piecegraph.trace.backend import _compiles_by_pieces

    def recorder(background=True, expected=True, refused=False):
        made = PackageRecorder("unused", background=background)
        made.worker_expected = expected
        if refused:
            made.refuse("the program writes its inputs")
        return made

    auto = piecegraph.Config(mode="full")
    assert _compiles_by_pieces(auto, recorder(), ())
    for packages in (None, recorder(background=False), recorder(expected=False), recorder(refused=True)):
        assert not _compiles_by_pieces(auto, packages, ())
    assert not _compiles_by_pieces(auto, recorder(), (4,))  # static compiles use the whole graph
    assert not _compiles_by_pieces(auto.replace(compiler="eager"), recorder(), ())
    assert _compiles_by_pieces(auto.replace(full_compile="pieces"), None, ())
    assert not _compiles_by_pieces(auto.replace(full_compile="whole"), recorder(), ())


def test_worker_refusal_names_a_failure_of_this_torch_and_revision_but_retries_after_running_out_of_memory(
        tmp_path):
    key, version = "k" * 32, torch.__version__
    assert worker_refusal(tmp_path, key, version) is None
    write_state(tmp_path, key, state="failed", why="RuntimeError: no", torch=version, worker=WORKER_REVISION,
                trace_sha="a")
    assert "failed (RuntimeError: no" in worker_refusal(tmp_path, key, version)
    assert "failed" in worker_refusal(tmp_path, key, version, "a")
    assert worker_refusal(tmp_path, key, version, "b") is None  # another trace: tried again
    assert worker_refusal(tmp_path, key, "0.0") is None  # another torch
    state = {k: v for k, v in read_state(tmp_path, key).items() if k not in ("key", "updated")}
    write_state(tmp_path, key, **{**state, "worker": WORKER_REVISION - 1})
    assert worker_refusal(tmp_path, key, version) is None  # an older worker's failure
    write_state(tmp_path, key, **{**state, "why": "OutOfMemoryError: CUDA out of memory"})
    assert worker_refusal(tmp_path, key, version) is None  # the machine's memory at the time: tried again
    write_state(tmp_path, "o" * 32, state="failed", why="the worker ended by SIGSEGV before its last word",
                signal="SIGSEGV", torch=version, worker=WORKER_REVISION)
    assert "crashed in native code" in worker_refusal(tmp_path, key, version)  # any entry's crash suspends all


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class _WithOpaque(torch.nn.Module):
    """The decoder, its hidden states through an op registered at run time (no worker could import its module)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.doubled = piecegraph.opaque(_doubled, fake="like:x", name="test_full_compile_auto_doubled")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.doubled(self.inner(input_ids, positions))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(hidden / 2)


def test_auto_compiles_whole_a_graph_no_worker_could_package(tmp_path, failing_worker):
    """An op whose module a worker cannot import: the whole graph would never be packaged, so no swap would come;
    "auto" compiles it whole at once instead of leaving it by pieces for good."""
    model = _WithOpaque(Decoder.random(TINY, seed=0).eval())
    cache = KVCache.for_sequences(TINY, 3, 48)
    graphed = piecegraph.compile(model, mode="full", capture_sizes=(1, 2, 4), emulate_graphs=True,
                                 cache_dir=tmp_path, aot_package=True)
    graphed.capture(lambda n: dummy_inputs(TINY, cache, n))
    assert not graphed.runner.program.by_pieces and graphed._upgrade is None and failing_worker == []
    assert "not defined at the top level of an importable module" in graphed.stats()["startup"]["aot"]
    assert generate(model, PROMPTS, 4, cache=cache, decode_fn=graphed) == generate(model.inner, PROMPTS, 4)
