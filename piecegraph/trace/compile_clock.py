"""Where torch's compiler spent a setup's seconds, by its own timers: the regions torch times with
``dynamo_timed`` (Dynamo's bytecode tracing, AOTAutograd, Inductor's lowering, scheduling and code generation, the
wait for Triton's compile workers, cache loads, first-run autotuning), kept per process in
``torch._dynamo.utils.compilation_time_metrics``. The regions nest (``compile_fx_inner`` holds
``Scheduler.codegen``), so their seconds overlap and do not sum to the setup; the report shows which regions a
cold or warm start pays and what to cut next, on the machine that ran it."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

TOP = 16  # regions kept in the report, the longest first
MIN_S = 0.05  # shorter regions are left out


def _totals() -> dict[str, float]:
    # Read only if Dynamo is imported already: importing it just to look would cost a warm start seconds
    utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(utils, "compilation_time_metrics", None)
    return {name: sum(times) for name, times in list(metrics.items())} if metrics else {}


@contextlib.contextmanager
def compile_regions(into: dict[str, float]) -> Iterator[None]:
    """Add to ``into`` the seconds each of torch's timed compile regions took inside the block (the ``TOP``
    longest of at least ``MIN_S``, name -> seconds, rounded to ms), also when the block raises."""
    before = _totals()
    try:
        yield
    finally:
        spent = {name: total - before.get(name, 0.0) for name, total in _totals().items()}
        for name, seconds in sorted(spent.items(), key=lambda item: -item[1])[:TOP]:
            if seconds >= MIN_S:
                into[name] = round(into.get(name, 0.0) + seconds, 3)
