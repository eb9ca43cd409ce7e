"""Python's cyclic garbage collector on the serving path: the start-up heap frozen while the engine's loops run,
and how long the collector paused a run.

After ``torch.compile`` the process holds hundreds of thousands of objects the collector tracks (Dynamo's and
Inductor's state, FX graphs, compiled modules; 420k for the tiny model on the CPU), and a full (generation 2)
collection walks all of them. On the H200 full collections fell inside 5 of 15 serve-bench runs at
c=1024, 150-420 ms each in runs of 2.4-12 s (piecewise: 42.3k output tok/s in the run with 424 ms of GC, 47.3k and
49.3k in the two without). :func:`frozen_heap` moves what exists when a loop starts out of the collector's reach
(``gc.freeze``, as vLLM's and SGLang's servers do after start-up) and gives it back when the loop ends
(``gc.unfreeze``), so a full collection walks only what serving made and nothing is kept alive past the loop.
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Iterator


@contextlib.contextmanager
def frozen_heap(enabled: bool = True) -> Iterator[None]:
    """Freeze every object the collector tracks now (``gc.freeze``) for the block, and unfreeze at its end.
    Objects made inside are collected as usual; frozen ones are still freed by reference counting, and cycles
    among them wait for the end of the block. Left alone (nothing frozen, nothing unfrozen) when ``enabled`` is
    false or something is frozen already: an enclosing block's, or the application's own ``gc.freeze()``."""
    if not enabled or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class GcPauses:
    """Counts the collector's runs and their seconds per generation while active (``with GcPauses() as p:``), from
    ``gc.callbacks``. ``summary()``: ``{"gc_pause_ms": total, "gc_full": generation-2 runs,
    "gc_full_max_ms": the longest of them}``."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_full = 0.0
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took, generation = time.perf_counter() - self._began, info["generation"]
        self.count[generation] += 1
        self.seconds[generation] += took
        if generation == 2:
            self.longest_full = max(self.longest_full, took)

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, float | int]:
        return {"gc_pause_ms": round(1e3 * sum(self.seconds), 2), "gc_full": self.count[2],
                "gc_full_max_ms": round(1e3 * self.longest_full, 2)}
