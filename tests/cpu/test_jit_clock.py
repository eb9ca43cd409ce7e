"""FlashInfer's JIT builds are timed apart (``stats()["startup"]["jit_build_s"]``): a stand-in ``flashinfer.jit.core``
whose ``run_ninja`` builds a module's library the first time (and finds it up to date after), as FlashInfer's does."""

from __future__ import annotations

import functools
import logging
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import piecegraph
from piecegraph.adapters.jit_clock import jit_builds, summarize

BUILD_S = 0.05


def _run_ninja(workdir: Path, ninja_file: Path, verbose: bool) -> None:
    """FlashInfer's contract: build ``<dir>/<name>.so`` beside ``build.ninja`` when it is missing."""
    library = ninja_file.parent / f"{ninja_file.parent.name}.so"
    if not library.exists():
        time.sleep(BUILD_S)
        library.write_bytes(b"kernels")
    if verbose == "fail":
        raise RuntimeError("Ninja build failed.")


@pytest.fixture
def core(monkeypatch, tmp_path):
    """A stand-in ``flashinfer.jit.core`` in ``sys.modules`` and one module's build folder."""
    module = types.ModuleType("flashinfer.jit.core")
    module.run_ninja = _run_ninja
    monkeypatch.setitem(sys.modules, "flashinfer.jit.core", module)
    (tmp_path / "norm").mkdir()
    module.ninja = tmp_path / "norm" / "build.ninja"
    return module


def test_a_build_is_timed_and_told_from_an_up_to_date_check(core):
    with jit_builds() as builds:
        core.run_ninja(core.ninja.parent.parent, core.ninja, False)
        core.run_ninja(core.ninja.parent.parent, core.ninja, False)
    assert core.run_ninja is _run_ninja  # put back
    assert [(b.name, b.built) for b in builds] == [("norm", True), ("norm", False)]
    assert builds[0].seconds >= BUILD_S > builds[1].seconds
    facts = summarize(builds)
    assert facts["jit_built"] == ["norm"] and facts["jit_checks"] == 1
    assert facts["jit_build_s"] == pytest.approx(builds[0].seconds)


def test_nested_blocks_count_once_and_a_failed_build_still_restores(core):
    with jit_builds() as outer:
        with jit_builds() as inner:
            with pytest.raises(RuntimeError, match="Ninja"):
                core.run_ninja(core.ninja.parent.parent, core.ninja, "fail")
        assert core.run_ninja is not _run_ninja  # the outer block's clock is still on
    assert inner == [] and [b.name for b in outer] == ["norm"] and outer[0].built
    assert core.run_ninja is _run_ninja


def test_without_flashinfer_loaded_nothing_is_patched_or_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "flashinfer.jit.core", raising=False)
    with jit_builds() as builds:
        pass
    assert builds == [] and "flashinfer.jit.core" not in sys.modules


class LoadsKernels(torch.nn.Module):
    """Calls a cached loader the first time it runs, as FlashInfer's ops do."""

    def __init__(self, core: types.ModuleType) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.load = functools.cache(lambda: core.run_ninja(core.ninja.parent.parent, core.ninja, False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.load()
        return torch.relu(self.lin(x)) + x


def test_startup_reports_the_jit_build_of_a_models_first_run(core, caplog):
    model = LoadsKernels(core).eval()
    graphed = piecegraph.compile(model, mode="breakable", capture_sizes=(2, 4), emulate_graphs=True, progress=False)
    with caplog.at_level(logging.INFO, logger="piecegraph"):
        graphed.capture(lambda n: ((torch.randn(n, 8),), None))
    startup = graphed.stats()["startup"]
    assert startup["jit_built"] == ["norm"] and startup["jit_build_s"] >= BUILD_S
    assert startup["jit_build_s"] <= startup["prewarm_s"]  # the first eager run built it: inside prewarm's seconds
    line = next(r.getMessage() for r in caplog.records if "ready in" in r.getMessage())
    assert "FlashInfer JIT build" in line and "(1 module)" in line
    x = torch.randn(3, 8)
    torch.testing.assert_close(graphed(x), model(x))
