"""Packages are made, checked and loaded only in processes that imported the start's torch libraries
(trace/aot_load.py ``torch_libraries``): on the H100 and H200, torch's package loader crashed in every fresh process
that had not imported FlashInfer, and loaded every package once it had. Two installed distributions are
made up here: one that requires torch (a kernel library) and one that needs torch only through an extra. And a
setup that packages in the caller's process loads its first package in a fresh process first."""

from __future__ import annotations

import hashlib
import logging
import sys

import pytest
import torch

from piecegraph.cache import Store
from piecegraph.cache.packaging import read_state, wait_packaging
from piecegraph.trace.aot_job import describe_unit, load_fails_elsewhere
from piecegraph.trace.aot_load import PackagedProgram, import_libraries, torch_libraries
from piecegraph.trace.aot_package import PackagedPlan
from piecegraph.trace.aot_worker import start_worker


def _distribution(root, name: str, requires: list[str]) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    info = root / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("\n".join(["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0",
                                              *(f"Requires-Dist: {r}" for r in requires)]) + "\n")
    (info / "top_level.txt").write_text(f"{name}\n")


@pytest.fixture
def libraries(tmp_path, monkeypatch):
    """``kernels_pg`` (requires torch) and ``plain_pg`` (torch only with an extra) on the path, neither imported;
    both forgotten afterwards, so no later test's worker is told to import them."""
    site = tmp_path / "site"
    site.mkdir()
    _distribution(site, "kernels_pg", ["torch>=2.9", "numpy"])
    _distribution(site, "plain_pg", ['torch ; extra == "gpu"', "torchvision"])
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in ("kernels_pg", "plain_pg"):
        sys.modules.pop(name, None)


def test_the_torch_libraries_are_those_imported_that_require_torch_in_import_order(libraries):
    assert "kernels_pg" not in torch_libraries()
    import kernels_pg  # noqa: F401
    import plain_pg  # noqa: F401

    found = torch_libraries()
    assert "kernels_pg" in found and "plain_pg" not in found  # an optional need of torch does not count
    assert not {"torch", "piecegraph", "sympy", "triton"} & set(found)  # nor torch, nor its compiler stack


def test_a_load_imports_the_starts_libraries_first_and_goes_on_without_one_that_does_not_import(libraries, caplog):
    with caplog.at_level(logging.INFO, logger="piecegraph"):
        import_libraries(("gone_pg", "kernels_pg"))
    assert "kernels_pg" in sys.modules and "gone_pg" not in sys.modules
    assert "gone_pg, imported by the start that made the packages, does not import here" in caplog.text


def where_the_libraries_are(x):
    raise RuntimeError(f"kernels_pg imported: {'kernels_pg' in sys.modules}")


torch.fx.wrap("where_the_libraries_are")  # export runs it in the worker: its error says what the worker had


def test_the_worker_imports_the_starts_torch_libraries_before_it_packages(tmp_path, libraries):
    import kernels_pg  # noqa: F401  (the start has it: the worker, a fresh process, must too)

    root = tmp_path / "cache"
    key = "k" * 32
    Store(root).save(key, {"model": "m"}, {"trace.pkl": b"trace"})
    job = describe_unit(torch.fx.symbolic_trace(lambda x: where_the_libraries_are(x) * 2), [torch.zeros(4, 3)],
                        False, "unit0.pt2")
    record = PackagedProgram(units=[job.spec], pieces={"graph": 0}, skeleton=None, fields={}, memory=None,
                             libraries=torch_libraries())
    said, started = start_worker(root, key, b"trace", PackagedPlan(record, jobs=[job]))
    assert started, said
    state = wait_packaging(root, timeout=300)[key]
    assert state["state"] == "failed" and state["why"] == "RuntimeError: kernels_pg imported: True", state
    assert read_state(root, key)["trace_sha"] == hashlib.sha256(b"trace").hexdigest()


def test_a_load_checked_in_a_fresh_process_names_the_signal_that_ended_it(tmp_path, monkeypatch):
    (tmp_path / "crash_pg.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the child's import path is this process's
    assert load_fails_elsewhere(tmp_path / "unit0.pt2", -1, ["crash_pg"], []) == "ended by SIGSEGV"


def test_a_setup_that_checks_its_first_load_elsewhere_compiles_as_usual_when_it_fails(tmp_path, monkeypatch):
    """On CUDA a setup packaging in its own process (``aot_background=False``) loads its first package in a
    fresh process first: torch's loader crashed processes without FlashInfer there, and this one is the caller's.
    A package that fails there is not loaded here; the unit compiles as usual, the reason kept."""
    from piecegraph.trace import aot_job
    from piecegraph.trace.aot_package import PackageRecorder

    def build(job, folder):  # no AOTInductor build on CI: a file the loader refuses stands in
        folder.mkdir(parents=True, exist_ok=True)
        (folder / job.spec.file).write_bytes(b"not a package")
        return []

    monkeypatch.setattr(aot_job, "build_package", build)
    recorder = PackageRecorder(tmp_path / "aot", probe_loads=True)
    traced = torch.fx.symbolic_trace(lambda x: x.relu() * 2)
    assert recorder.compile(traced, [torch.zeros(4, 3)], False) is None
    assert recorder.why_not.startswith("RuntimeError: the package fails torch's loader in a fresh process ("), \
        recorder.why_not
