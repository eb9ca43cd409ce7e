"""serve-bench with the modes' runs interleaved: every mode's engine started first, on one shared KV cache, then
each concurrency's repeats run mode after mode, the order rotated each repeat (A B, then B A).

Run one mode after another, a comparison of close modes also measures the order: on the H200 the FP8 MoE's piecewise
engine served c=1 at 218 output tok/s first in its process and at 167 second, its host launch work per step 2.9
against 5.4 ms (the SM clock held 1,980 MHz, unthrottled, in a later run). Interleaved, each mode's runs meet the
host's drift alike, and the median of rotated repeats leaves no mode always first. The engines share one KV cache (a
second one would take a second share of the GPU's memory), which is safe because runs never overlap: every run ends
with every page free (``measure`` checks). Memory: every engine's graphs and compiled code at once, so a mode that
keeps many buffers (breakable) may not fit beside the others.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

import torch

from piecegraph.serve.bench import measure, median_row
from piecegraph.serve.engine import Engine
from piecegraph.serve.executor import Progress
from piecegraph.serve.sweep import Plan, finish_mode, log_row, release, start_mode, works_of


def rotation(modes: list[str], repeat: int) -> list[str]:
    """The run order of ``modes`` in repeat ``repeat`` (0-based): rotated left by ``repeat``, so over
    ``len(modes)`` repeats each mode runs once in each position."""
    shift = repeat % len(modes) if modes else 0
    return modes[shift:] + modes[:shift]


def run_interleaved(model: torch.nn.Module, plan: Plan, log: Callable[[str], None] = print,
                    progress: Callable[[str], Progress | None] = lambda mode: None,
                    on_mode: Callable[[list[dict[str, Any]]], None] | None = None, keep_going: bool = True
                    ) -> list[dict[str, Any]]:
    """Every mode of ``plan``, interleaved (module docstring), with :func:`~piecegraph.serve.sweep.run_sweep`'s
    arguments and results (one per mode); each row adds ``run_order``: the mode's position in each repeat. A mode
    that fails to start is recorded with its error and left out (``keep_going``, else raised); a run that fails
    ends the loops (the shared cache's state is then unknown), keeping the rows finished; a mode whose reference
    loop or estimate fails keeps its rows and records the error."""
    engines: dict[str, Engine] = {}
    results: dict[str, dict[str, Any]] = {}
    for mode in plan.modes:
        start, cache = time.perf_counter(), next(iter(engines.values())).cache if engines else None
        try:
            engines[mode], results[mode] = start_mode(model, mode, plan, log, progress, cache)
        except Exception as exc:  # noqa: BLE001  (one failing mode must not lose the others' results)
            if not keep_going:
                raise
            results[mode] = _failed(mode, exc, log)
        results[mode]["start_s"] = round(time.perf_counter() - start, 2)
    start, works = time.perf_counter(), works_of(model, plan)
    try:
        _loops(engines, results, plan, works, log)
    except Exception as exc:  # noqa: BLE001
        if not keep_going:
            raise
        log(f"interleaved loops stopped: {type(exc).__name__}: {exc}")
        log(traceback.format_exc(limit=6))
        for mode in engines:
            results[mode].setdefault("error", f"the interleaved loops stopped: {type(exc).__name__}: {exc}"[:500])
    else:
        for mode, engine in engines.items():
            try:
                finish_mode(engine, plan, works, results[mode], log)
            except Exception as exc:  # noqa: BLE001  (one mode's reference loop must not cost the others)
                if not keep_going:
                    raise
                results[mode] = {**_failed(mode, exc, log), "rows": results[mode]["rows"]}
    out = [results[mode] for mode in plan.modes]
    for result in out:
        # its own start, plus the loops every mode shared (interleaved, no mode has loops of its own to time)
        result["wall_s"] = round(result.pop("start_s", 0.0) + time.perf_counter() - start, 2)
        result["interleaved"] = True
    engines.clear()
    release()
    if on_mode:
        on_mode(out)
    return out


def _loops(engines: dict[str, Engine], results: dict[str, dict[str, Any]], plan: Plan, works: dict[int, Any],
           log: Callable[[str], None]) -> None:
    """Each concurrency: ``plan.repeats`` rounds, each running every started mode once in :func:`rotation`'s
    order; then each mode's median row."""
    modes = list(engines)
    for c, work in works.items():
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for repeat in range(max(1, plan.repeats)):
            for mode in rotation(modes, repeat):
                runs[mode].append(measure(engines[mode], work, c))
        for mode in modes:
            row = {"mode": mode, **median_row(runs[mode]),
                   "run_order": [rotation(modes, r).index(mode) for r in range(len(runs[mode]))]}
            results[mode]["rows"].append(row)
            log_row(log, mode, row)


def _failed(mode: str, exc: Exception, log: Callable[[str], None]) -> dict[str, Any]:
    log(f"{mode}: failed: {type(exc).__name__}: {exc}")
    log(traceback.format_exc(limit=6))
    return {"mode": mode, "rows": [], "error": f"{type(exc).__name__}: {exc}"[:500]}
