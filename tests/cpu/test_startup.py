"""Start-up report and import cost: ``import piecegraph`` loads neither FlashInfer, transformers nor Dynamo;
``stats()["startup"]`` splits the start's seconds; ``capture()`` shows a progress bar when asked and logs one
summary line."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch

import piecegraph

pytestmark = pytest.mark.usefixtures("one_thread")

IMPORT_CHECK = """
import json, sys, time
start = time.perf_counter(); import torch; mid = time.perf_counter(); import piecegraph; end = time.perf_counter()
heavy = ("flashinfer", "transformers", "torch._dynamo", "torch._inductor", "sympy", "typer", "rich")
print(json.dumps({"loaded": [m for m in heavy if m in sys.modules], "torch_s": mid - start, "piecegraph_s": end - mid,
                  "import_s": piecegraph.IMPORT_S}))
"""


@pytest.fixture(scope="module")
def imported() -> dict:
    """What a fresh ``import torch; import piecegraph`` loaded, and the seconds each took."""
    done = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_piecegraph_loads_no_kernel_library_and_no_transformers(imported):
    assert not {"flashinfer", "transformers"} & set(imported["loaded"]), imported
    assert 0 < imported["import_s"] <= imported["piecegraph_s"] + 1e-3  # IMPORT_S is this very import's cost


def test_import_piecegraph_leaves_dynamo_inductor_and_sympy_to_the_first_compile(imported):
    # Dynamo alone costs ~1.5 s (measured 1.6 s of piecegraph's import before ops/freeze.py imported it lazily);
    # the CLI's typer and rich load when the CLI starts. A module-level `torch._dynamo.x` anywhere undoes this.
    assert imported["loaded"] == [], imported


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x


def _inputs(n: int):
    return (torch.randn(n, 8),), None


def test_stats_split_the_start_into_stages_and_capture_reports_each_size(caplog):
    model = Block().eval()
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=(2, 4, 8), emulate_graphs=True,
                                 progress=False)
    with caplog.at_level(logging.INFO, logger="piecegraph"):
        seconds = graphed.capture(_inputs)
    assert sorted(seconds) == [2, 4, 8] and all(s > 0 for s in seconds.values())
    startup = graphed.stats()["startup"]
    assert startup["cache"] == "off" and startup["num_sizes"] == 3
    assert startup["capture_s"] == pytest.approx(sum(graphed.stats()["capture_s"].values()))
    assert startup["ready_s"] == pytest.approx(startup["setup_s"] + startup["capture_s"])
    stages = startup["compiler_import_s"] + startup["prewarm_s"] + startup["trace_s"] + startup["compile_s"]
    assert 0 < stages <= startup["setup_s"] and startup["trace_s"] > 0 and startup["compile_s"] > 0
    assert startup["compiler_import_s"] >= 0  # 0 here: an earlier test imported Dynamo and Inductor
    lines = [r.getMessage() for r in caplog.records if "ready in" in r.getMessage()]
    assert len(lines) == 1 and "3 sizes" in lines[0] and "cache off" in lines[0]
    x = torch.randn(3, 8)
    torch.testing.assert_close(graphed(x), model(x))


def test_progress_bar_through_capture_only_when_asked(capsys):
    model = Block().eval()
    shown = piecegraph.compile(model, compiler="eager", capture_sizes=(2, 4, 8), emulate_graphs=True, progress=True)
    shown.capture(_inputs)
    err = capsys.readouterr().err
    assert "3/3 sizes" in err and "piecegraph capture" in err
    assert "piecegraph: ready in" in err and "3 sizes" in err  # and where the seconds went
    quiet = piecegraph.compile(model, compiler="eager", capture_sizes=(2, 4, 8), emulate_graphs=True)
    quiet.capture(_inputs)  # None: a bar only on a terminal (pytest's stderr is not one)
    assert "sizes" not in capsys.readouterr().err


def test_capturing_many_sizes_collects_garbage_once_not_per_size(monkeypatch):
    import gc

    from piecegraph.graphs.capture import capture_batch, capture_session

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a, **k: calls.append(1) or 0)
    with capture_session():  # what capture_batch() is on CUDA, around GraphedModule.capture's sizes
        for _ in range(3):
            with capture_session():  # each size's capture (replay.py)
                pass
    assert len(calls) == 1  # a full collection costs 0.1-0.4 s once Dynamo and Inductor have run
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with capture_batch():
        pass
    assert len(calls) == 1  # without CUDA nothing is captured for real: no collection at all
