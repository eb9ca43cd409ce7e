"""prewarm(): one eager run before tracing that reports which cached loaders filled and how long it took."""

import functools
import logging
import sys
from pathlib import Path

import pytest
import torch

try:
    import jitlib  # noqa: F401 - the package import is the point (a folder on sys.path)
except ImportError:  # pytest's importlib mode does not put the test folder on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import jitlib  # noqa: F401
from jitlib import kernels

from piecegraph.ops import PrewarmReport, prewarm, unfreeze

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler (cc) on this machine")


class JitModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))

    def forward(self, x, *, residual=None):
        h = kernels.rmsnorm(x.contiguous(), self.weight.detach())
        return h if residual is None else kernels.scaled_add(h, residual)


@pytest.fixture(autouse=True)
def _cold_loaders():
    unfreeze()
    kernels.get_kernel_module.cache_clear()  # the shared libraries stay on disk: refilling is cheap
    yield
    unfreeze()


def test_reports_the_loaders_that_filled_and_the_time(caplog, capsys):
    x = torch.randn(3, 8)
    with caplog.at_level(logging.INFO, logger="piecegraph.ops.prewarm"):
        report = prewarm(JitModel(), x, residual=torch.randn(3, 8))
    assert isinstance(report, PrewarmReport) and report.seconds > 0
    filled = {f.name: f.new_entries for f in report.filled}
    assert filled.get("jitlib.kernels.get_kernel_module") == 2  # rmsnorm and scaled_add were built
    summaries = [r.getMessage() for r in caplog.records if r.name == "piecegraph.ops.prewarm"]
    assert len(summaries) == 1 and "get_kernel_module" in summaries[0]
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""  # not a terminal: no spinner, no noise


def test_a_second_prewarm_finds_nothing_new():
    model, x = JitModel(), torch.randn(2, 8)
    prewarm(model, x)
    assert all(f.name != "jitlib.kernels.get_kernel_module" for f in prewarm(model, x).filled)


def test_runs_without_grad_and_can_freeze_what_filled():
    seen = []

    def model(x):
        seen.append(torch.is_grad_enabled())
        return kernels.scaled_add(x, x)

    report = prewarm(model, torch.randn(4, requires_grad=False), freeze_loaders=True)
    assert seen == [False]
    assert "jitlib.kernels.get_kernel_module" in report.frozen
    assert not isinstance(kernels.get_kernel_module, functools._lru_cache_wrapper)

    def traced(x):
        return x * (kernels.get_kernel_module("scaled_add") is not None)

    assert torch._dynamo.explain(traced)(torch.ones(2)).graph_break_count == 0
