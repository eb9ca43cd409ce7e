"""Python's cyclic garbage collector on the serving path: how long it paused the host loop during a run.

After ``torch.compile`` the process holds hundreds of thousands of objects the collector tracks (Dynamo's and
Inductor's state, FX graphs, compiled modules; 420k for the tiny model on the CPU), and a full (generation 2)
collection walks all of them: 0.1-0.3 s each on the CPU. serve-bench reports the collector's time and its full
collections per run, so a run slowed by them says so (vLLM and SGLang ``gc.freeze()`` their start-up heap against
exactly this; on the CPU no full collection fell inside a serving run, 2,323 steps at c=64).
"""

from __future__ import annotations

import gc
import time
from typing import Any


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
