"""Packaging in the background (``Config(aot_background=True)``, the default; trace/aot_worker.py): the start is
ready on Inductor's code while a worker process packages its units and adds them to the cache entry; a later
process loads them without the compiler and matches eager; a worker never adds packages to an entry that changed,
and one that failed is not started again for the same trace. Graphs emulated on CPU."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle

import pytest
import torch
from test_aot_package import _process_start
from typer.testing import CliRunner

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.cache import Store
from piecegraph.cache.command import cache_app
from piecegraph.cache.packaging import WORKER_REVISION, read_state, wait_packaging, write_state
from piecegraph.models import TINY, Decoder, dummy_inputs, generate
from piecegraph.trace.aot_job import describe_unit, op_modules
from piecegraph.trace.aot_load import PackagedProgram
from piecegraph.trace.aot_package import PackagedPlan
from piecegraph.trace.aot_worker import PackagingJob, run_job, start_worker

pytestmark = pytest.mark.usefixtures("one_thread")
UNITS = {"piecewise": 3, "full": 1}
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]]


# One mode: a piecewise program's units are described as a full graph's (by _compile_piece), the warm load is
# test_aot_package.py's, and the engine test below packages a piecewise module in the background too.
@pytest.mark.parametrize("mode", ["full-pieces"])
def test_the_start_is_ready_on_inductor_code_and_the_next_one_loads_the_workers_packages(tmp_path, mode):
    # full-pieces: the cold start compiles the full graph by pieces (fast), the worker packages it whole
    mode, *flags = mode.split("-")
    cold, _ = _process_start(tmp_path, mode, "bg", *flags)
    assert (cold["cache"], cold["trace"]) == ("cold", "traced")
    assert cold["aot"].startswith(f"packaging {UNITS[mode]} units in the background (pid "), cold["aot"]
    assert cold["generate_equal"]
    waited = CliRunner().invoke(cache_app, ["wait", "--dir", str(tmp_path), "--timeout", "600"])
    assert waited.exit_code == 0 and " done in " in waited.output, waited.output
    (state,) = wait_packaging(tmp_path, timeout=0).values()
    assert (state["state"], state["why"], state["units"]) == ("done", "", UNITS[mode]), state
    shown = CliRunner().invoke(cache_app, ["info", "--dir", str(tmp_path)])
    assert f"{UNITS[mode]} AOTInductor packages" in shown.output, shown.output
    warm, _ = _process_start(tmp_path, mode, "bg", *flags)
    assert (warm["cache"], warm["trace"], warm["aot"], warm["imported"]) == ("warm", "packaged", None, [])
    assert warm["generate_equal"]  # greedy tokens equal eager's
    # Other code than the cold start ran (AOTInductor's, not Inductor's JIT code): equal within float32 rounding.
    assert torch.allclose(torch.tensor(warm["out"]), torch.tensor(cold["out"]), rtol=1e-4, atol=1e-5)


def _entry(root, trace: bytes) -> str:
    key = "k" * 32
    Store(root).save(key, {"model": "m"}, {"trace.pkl": trace, "mega.bin": b"blob"})
    return key


def boom(x):
    raise RuntimeError("boom: this unit cannot be exported")


torch.fx.wrap("boom")  # a call in the traced code: the worker imports this module to unpickle it, then export fails


def _failing_plan() -> PackagedPlan:
    """One unit whose code raises when export runs it."""
    fake = torch.zeros(4, 3)
    job = describe_unit(torch.fx.symbolic_trace(lambda x: boom(x) * 2), [fake], False, "unit0.pt2")
    record = PackagedProgram(units=[job.spec], pieces={"graph": 0}, skeleton=None, fields={}, memory=None)
    return PackagedPlan(record, jobs=[job])


def test_a_failed_worker_says_why_and_is_not_started_again_for_the_same_trace(tmp_path):
    key = _entry(tmp_path, b"trace")
    said, packaging = start_worker(tmp_path, key, b"trace", _failing_plan())
    assert said.startswith("packaging 1 units in the background (pid ") and packaging, said
    waited = CliRunner().invoke(cache_app, ["wait", "--dir", str(tmp_path), "--timeout", "600"])
    assert waited.exit_code == 1 and f"{key}  failed in " in waited.output, waited.output
    (state,) = wait_packaging(tmp_path, timeout=0).values()
    assert state["state"] == "failed" and "boom" in state["why"], state
    assert "RuntimeError: boom: this unit cannot be exported" in waited.output
    assert sorted(Store(tmp_path).load(key, {"model": "m"}).files) == ["mega.bin", "trace.pkl"]  # untouched
    again, packaging = start_worker(tmp_path, key, b"trace", _failing_plan())
    assert not packaging
    assert again.startswith("not packaged: the background packaging of this entry failed (") and "boom" in again
    shown = CliRunner().invoke(cache_app, ["info", "--dir", str(tmp_path)]).output
    assert "background packaging failed: RuntimeError: boom: this unit cannot be exported (log " in shown, shown
    assert "packaging failed" not in CliRunner().invoke(cache_app, ["info", "--dir", str(tmp_path / "none")]).output
    assert not (tmp_path / "none").exists()  # looking makes no folder
    none = CliRunner().invoke(cache_app, ["wait", "--dir", str(tmp_path / "none")])
    assert none.exit_code == 0 and "no background packaging" in none.output, none.output
    write_state(tmp_path, key, state="running", pid=os.getpid())  # a live worker: this process stands in
    late = CliRunner().invoke(cache_app, ["wait", "--dir", str(tmp_path), "--timeout", "0.3"])
    assert late.exit_code == 2 and f"packaging of {key} still running after 0.3 s" in late.output, late.output
    forget = ["clear", "--dir", str(tmp_path), "--failed-packaging"]
    assert "forgot 0 failed" in CliRunner().invoke(cache_app, forget).output  # a running job is not forgotten
    write_state(tmp_path, key, state="failed", why="RuntimeError: boom", trace_sha=state["trace_sha"],
                torch=state["torch"])
    forgot = CliRunner().invoke(cache_app, forget).output
    assert f"forgot 1 failed packaging job(s)\n  {key}" in forgot, forgot
    assert sorted(Store(tmp_path).load(key, {"model": "m"}).files) == ["mega.bin", "trace.pkl"]  # the entry kept
    retried, packaging = start_worker(tmp_path, key, b"trace", _failing_plan())
    assert packaging and retried.startswith("packaging 1 units in the background"), retried
    assert wait_packaging(tmp_path, timeout=600)[key]["state"] == "failed"  # it tried again (and failed again)


def test_the_worker_writes_cpu_code_for_the_starts_threads_not_its_own_one(tmp_path, monkeypatch):
    """The worker runs its own checks on one thread, but Inductor writes CPU code for the compiling process's
    thread count: its packages were single-threaded (no ``omp parallel`` loops, found by diffing a worker's
    package against a setup's). The start hands its count over; the worker writes code for it."""
    import subprocess

    import torch._inductor.config as inductor_config

    from piecegraph.trace import aot_worker

    seen = []

    def package(unit, folder):
        seen.append((inductor_config.cpp.threads, torch.get_num_threads()))
        (folder / unit.spec.file).write_bytes(b"package")

    class Started:  # the worker's process is not started: this test runs its job in-process
        pid = os.getpid()

        def __init__(self, *args, **kwargs):
            pass

    monkeypatch.setattr(aot_worker, "package_unit", package)
    monkeypatch.setattr(subprocess, "Popen", Started)
    key = _entry(tmp_path, b"trace")
    job = describe_unit(torch.fx.symbolic_trace(lambda x: x.sum(0) * 2), [torch.zeros(4, 3)], False, "unit0.pt2")
    plan = PackagedPlan(PackagedProgram(units=[job.spec], pieces={"graph": 0}, skeleton=None, fields={},
                                        memory=None), jobs=[job])
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        start_worker(tmp_path, key, b"trace", plan)
    finally:
        torch.set_num_threads(before)
    (path,) = (tmp_path / "packaging").glob("*.job")
    assert run_job(path) == "done"
    assert seen == [(3, before)] and inductor_config.cpp.threads == -1
    assert "unit0.pt2" in Store(tmp_path).load(key, {"model": "m"}).files


def test_a_worker_adds_nothing_to_an_entry_whose_trace_changed(tmp_path):
    key = _entry(tmp_path, b"the trace the start kept")
    plan = _failing_plan()
    plan.jobs.clear()  # nothing to package: the worker goes straight to the entry
    job = PackagingJob(str(tmp_path), key, hashlib.sha256(b"an older trace").hexdigest(),
                       pickle.dumps(plan.record), [])
    path = tmp_path / "job"
    header = {"root": str(tmp_path), "key": key, "modules": []}
    path.write_bytes(pickle.dumps((header, pickle.dumps(job))))
    assert run_job(path) == "dropped"
    assert read_state(tmp_path, key)["why"] == "the entry's trace.pkl changed since the job was made"
    assert "packaged.pkl" not in Store(tmp_path).load(key, {"model": "m"}).files
    assert not path.exists()


def test_files_added_to_an_entry_pass_its_checks_and_keep_the_rest(tmp_path):
    key = _entry(tmp_path, b"trace")
    store = Store(tmp_path)
    assert store.add_files(key, {"unit0.pt2": b"package"}, {"trace.pkl": hashlib.sha256(b"trace").hexdigest()}) == ""
    files = store.load(key, {"model": "m"}).files
    assert files == {"trace.pkl": b"trace", "mega.bin": b"blob", "unit0.pt2": b"package"}
    assert store.add_files("absent", {"x": b""}, {}).startswith("the entry is gone")


_LIB = torch.library.Library("piecegraph_test_bg", "DEF")  # a module-level library: the worker imports this module
_LIB.define("twice(Tensor x) -> Tensor")
_LIB.impl("twice", lambda x: x * 2, "CompositeExplicitAutograd")


def test_the_worker_is_told_which_modules_define_the_ops_the_units_call():
    traced = torch.fx.symbolic_trace(lambda x: torch.ops.piecegraph_test_bg.twice(x).relu())
    assert op_modules([traced]) == [__name__]
    local = torch.library.Library("piecegraph_test_local", "DEF")  # held by no module: no worker can have it
    local.define("same(Tensor x) -> Tensor")
    unknown = torch.fx.symbolic_trace(lambda x: torch.ops.piecegraph_test_local.same(x))
    with pytest.raises(ValueError, match="piecegraph_test_local::"):
        op_modules([traced, unknown])
    assert op_modules([torch.fx.symbolic_trace(lambda x: torch.ops.aten.relu(x))]) == []


def _by_pieces(root, sizes=(1, 2, 4)):
    model = Decoder.random(TINY, seed=0).eval()
    cache = KVCache.for_sequences(TINY, 3, 48)
    graphed = piecegraph.compile(model, mode="full", capture_sizes=sizes, emulate_graphs=True, cache_dir=root,
                                 aot_package=True, full_compile="pieces")
    graphed.capture(lambda n: dummy_inputs(model, cache, n))
    return model, cache, graphed


def test_a_full_graph_compiled_by_pieces_swaps_in_the_whole_graphs_package_once_the_worker_is_done(tmp_path,
                                                                                                  caplog):
    model, cache, graphed = _by_pieces(tmp_path)
    assert graphed.stats()["startup"]["aot"].startswith("packaging 1 units in the background (pid ")
    eager = generate(model, PROMPTS, 5)
    by_pieces = graphed.runner
    assert generate(model, PROMPTS, 5, cache=cache, decode_fn=graphed) == eager
    assert graphed.runner is by_pieces  # the worker is still packaging: the program compiled by pieces runs
    looks = []
    (state,) = wait_packaging(tmp_path, timeout=600, progress=looks.append).values()
    assert (state["state"], state["units_done"]) == ("done", 1), state
    busy = [s for look in looks for s in look.values()]
    assert busy and looks[-1] == {}  # seen packaging, then seen done
    assert all(0 <= s.get("units_done", 0) <= s.get("units", 1) == 1 for s in busy), busy  # counts its unit
    pending = graphed._upgrade
    with Store(tmp_path).locked(graphed.stats()["startup"]["cache_key"]):  # another start holds the entry
        assert generate(model, PROMPTS, 5, cache=cache, decode_fn=graphed) == eager
    assert graphed.runner is by_pieces and graphed._upgrade is pending  # not waited for: looked at again later

    # A swap whose captures fail puts the old program back, with its graphs.
    capture_sizes = graphed._capture_sizes

    def failing(make_inputs, sizes, update=None):
        raise RuntimeError("CUDA error: out of memory (during the swap's captures)")

    graphed._capture_sizes, pending.next_check = failing, 0.0
    with caplog.at_level(logging.WARNING, logger="piecegraph"):
        assert generate(model, PROMPTS, 5, cache=cache, decode_fn=graphed) == eager
    assert "could not be swapped in (RuntimeError: CUDA error: out of memory" in caplog.text
    assert graphed.runner is by_pieces and sorted(by_pieces.capture_s) == [1, 2, 4]  # its graphs kept
    assert graphed.stats()["startup"]["aot"].startswith("packaging 1 units in the background")

    graphed._capture_sizes, graphed._upgrade, pending.next_check = capture_sizes, pending, 0.0  # once more
    assert generate(model, PROMPTS, 5, cache=cache, decode_fn=graphed) == eager  # the first call swaps it in
    swapped = graphed.runner
    assert swapped is not by_pieces and len(graphed._runners) == 1
    assert type(swapped.program.pieces[0].fn).__name__ == "PackagedUnit"  # the whole graph, packaged
    assert sorted(swapped.capture_s) == [1, 2, 4]  # the sizes captured before, captured again at the swap
    assert graphed.stats()["startup"]["aot"].startswith("the whole graph's package, swapped in ")
    assert graphed._upgrade is None
    with pytest.raises(ValueError, match="input input_ids is torch.float32"):  # the swapped binding checks too
        graphed(torch.zeros(2), torch.zeros(2, dtype=torch.long))


def test_a_failed_worker_leaves_the_full_graph_compiled_by_pieces(tmp_path, monkeypatch, caplog):
    def failed(root, key, trace, plan):  # no worker: its state, as one that failed would leave it
        write_state(root, key, state="failed", why="RuntimeError: the worker's own failure")
        return "packaging 1 units in the background (pid 0)", True

    monkeypatch.setattr("piecegraph.trace.aot_worker.start_worker", failed)
    model, cache, graphed = _by_pieces(tmp_path, (1, 2))
    by_pieces = graphed.runner
    graphed._upgrade.next_check = 0.0
    with caplog.at_level(logging.INFO, logger="piecegraph"):
        assert generate(model, PROMPTS, 5, cache=cache, decode_fn=graphed) == generate(model, PROMPTS, 5)
    assert graphed.runner is by_pieces and graphed._upgrade is None
    assert "keeping the full graph compiled by pieces: the background packaging failed (RuntimeError" in caplog.text


def test_an_engine_swaps_its_full_modules_package_in_while_it_serves_and_times_its_decode_choice_again(
        tmp_path, monkeypatch):
    """Auto's decode choice, timed (a stand-in timer; CPU has no graphs to time) against the full graph compiled by
    pieces, replays the piecewise module for every decode size: the full module is never called, yet the idle
    engine (as a server's loop calls it between requests) swaps its package in, times the choice again, and
    decodes with it, the tokens equal eager's. (Steps look too: tests/cpu/test_serve_decode_choice.py.)"""
    from piecegraph.serve import Engine, EngineConfig, SamplingParams
    from piecegraph.serve.executor import Executor

    def timer(self, cache):  # piecewise faster than the pieces' full graph; the packaged whole graph fastest
        return lambda slot, n: 1.0 if slot.kind == "piecewise" else (0.5 if slot.module.swaps else 2.0)

    monkeypatch.setattr(Executor, "decode_timer", timer)
    model = Decoder.random(TINY, seed=0).eval()
    config = EngineConfig(mode="auto", max_num_seqs=4, max_num_batched_tokens=32, num_pages=32, page_size=8,
                          max_seq_len=64, emulate_graphs=True, cache_dir=tmp_path, aot_package=True,
                          full_compile="pieces")
    engine = Engine(model, config)
    want = generate(model, PROMPTS, 6)
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=6)) == want
    before = engine.capture_report()
    assert before["modules"]["full"]["startup"]["aot"].startswith("packaging 1 units in the background")
    assert {c["pick"] for c in before["decode_choice"].values()} == {"piecewise"}
    assert "full" not in {s.kind for s in engine.steps}
    states = wait_packaging(tmp_path, timeout=600)
    assert sorted(s["state"] for s in states.values()) == ["done", "done"], states  # both modules' workers
    served = len(engine.steps)
    engine.idle_work()
    swapped = engine.capture_report()
    assert swapped["modules"]["full"]["startup"]["aot"].startswith("the whole graph's package, swapped in ")
    assert len(engine.steps) == served  # swapped without a step
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=6)) == want
    after = engine.capture_report()
    full = after["modules"]["full"]
    assert full["startup"]["aot"].startswith("the whole graph's package, swapped in "), full
    assert full["sizes"] == before["modules"]["full"]["sizes"]  # every size captured again
    assert after["modules"]["piecewise"]["startup"]["aot"] == before["modules"]["piecewise"]["startup"]["aot"]
    assert {(c["pick"], c["when"]) for c in after["decode_choice"].values()} == {("full", "swap")}
    assert {s.kind for s in engine.steps[served:] if s.is_decode} == {"full"}


def test_a_unit_calling_a_collective_is_not_packaged():
    import piecegraph.parallel.ops  # noqa: F401  (registers piecegraph_tp::all_reduce)

    traced = torch.fx.symbolic_trace(lambda x: torch.ops.piecegraph_tp.all_reduce(x * 2, "tp"))
    with pytest.raises(ValueError, match=r"collective ops \(piecegraph_tp::\*\): tensor-parallel programs"):
        describe_unit(traced, [torch.zeros(4, 3)], False, "unit0.pt2")


def test_a_worker_that_dies_by_a_signal_is_named_so_and_no_worker_starts_again_with_that_torch(tmp_path):
    """The start that launched a worker and sees it end before its last word (a crash in native code, the kernel's
    out-of-memory killer) writes how it ended into the job's state: "failed", naming the signal. After a crash in
    native code no start with that torch starts a worker for any entry of the cache until the crash is forgotten."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    trace = b"the entry's trace"
    write_state(tmp_path, "k" * 32, state="running", pid=proc.pid, units=1, torch=torch.__version__,
                trace_sha=hashlib.sha256(trace).hexdigest(), worker=WORKER_REVISION)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: running() reaps it
    from piecegraph.cache.packaging import running

    assert not running(tmp_path, "k" * 32)
    state = read_state(tmp_path, "k" * 32)
    assert (state["state"], state["why"], state["units"]) == (
        "failed", f"the worker ended by {signal.SIGSEGV.name} before its last word", 1), state
    # Neither the next start of this entry nor one of another entry starts a worker that would likely crash the
    # same way (each compiles for a minute first); both say what packages instead
    for key in ("k" * 32, "o" * 32):
        line, busy = start_worker(tmp_path, key, trace, _failing_plan())
        assert not busy and "SIGSEGV" in line and "Config(aot_background=False)" in line, line
    assert read_state(tmp_path, "k" * 32)["pid"] == proc.pid and read_state(tmp_path, "o" * 32) is None
    shown = CliRunner().invoke(cache_app, ["info", "--dir", str(tmp_path)]).output
    assert f"no background packaging with torch {torch.__version__}: a worker crashed" in shown, shown
    # Another torch, an older worker (one a fix since may have mended), or the crash forgotten: workers start again
    def crashed_with(version: str, worker: int = WORKER_REVISION) -> None:
        state = {k: v for k, v in read_state(tmp_path, "k" * 32).items() if k not in ("key", "updated")}
        write_state(tmp_path, "k" * 32, **{**state, "torch": version, "worker": worker})

    for other, version, worker in (("o", "0.0", WORKER_REVISION), ("p", torch.__version__, WORKER_REVISION - 1)):
        crashed_with(version, worker)
        assert start_worker(tmp_path, other * 32, trace, _failing_plan())[1]
        wait_packaging(tmp_path, timeout=300)
    crashed_with(torch.__version__)
    assert "k" * 32 in CliRunner().invoke(cache_app, ["clear", "--failed-packaging", "--dir", str(tmp_path)]).output
    assert start_worker(tmp_path, "k" * 32, trace, _failing_plan())[1]
    wait_packaging(tmp_path, timeout=300)
