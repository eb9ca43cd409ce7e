"""The bench's ``auto`` row: what the engine's ``mode="auto"`` runs, as one callable.

Prefill (and any step that is not a pure decode) goes to piecegraph ``mode="auto"`` (piecewise graphs, library
kernels nobody adapted wrapped as opaque ops, static code per size where the program reduces over tokens, breakable
when nothing traces). A pure decode step goes to the faster of that module and a full graph (Inductor), measured
per decode size at setup with CUDA events, as the engine's executor does at capture; ties go to full. Both modules
share one graph pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import piecegraph
from piecegraph.bench.harness import sync
from piecegraph.context import current_forward_context
from piecegraph.graphs.capture import step_ms


class AutoDispatch:
    """``fn(input_ids, positions)`` under a forward context: a decode step of a size both modules captured
    replays the module measured faster for it; every other call replays the auto (piecewise) module."""

    def __init__(self, model: torch.nn.Module, decode_sizes: Sequence[int], prefill_sizes: Sequence[int],
                 make_inputs: Callable[[int], Any]) -> None:
        pool = piecegraph.GraphPool()
        every = tuple(sorted(set(decode_sizes) | set(prefill_sizes)))
        self.mixed = piecegraph.compile(model, mode="auto", capture_sizes=every, pool=pool)
        self.mixed.capture(make_inputs)
        self.full = None
        self.choice: dict[int, dict[str, Any]] = {}
        if self.mixed.stats().get("mode") != "breakable":  # a model Dynamo cannot trace has no full graph either
            self.full = piecegraph.compile(model, mode="full", compiler="inductor", auto_opaque=True,
                                           capture_sizes=tuple(decode_sizes), pool=pool)
            self.full.capture(make_inputs)
            self._choose(decode_sizes, make_inputs)

    def _choose(self, sizes: Sequence[int], make_inputs: Callable[[int], Any]) -> None:
        for n in sizes:
            inputs = make_inputs(n)
            full, mixed = step_ms(self.full, inputs), step_ms(self.mixed, inputs)
            self.choice[n] = {"pick": "piecewise" if mixed < full else "full", "full_ms": full, "piecewise_ms": mixed}

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = current_forward_context()
        n = input_ids.shape[0]
        if self.full is not None and meta is not None and meta.is_decode and self.choice.get(n, {}).get(
                "pick") == "full":
            return self.full(input_ids, positions)
        return self.mixed(input_ids, positions)

    def stats(self) -> dict[str, Any]:
        """The auto module's stats (mode, pieces, sizes, startup, wrapped entries), replays and fallbacks of both
        modules, setup seconds of both, and the per-size decode choice."""
        out = dict(self.mixed.stats())
        if self.full is not None:
            full = self.full.stats()
            out["replays"] = out.get("replays", 0) + full.get("replays", 0)
            out["fallbacks"] = out.get("fallbacks", 0) + full.get("fallbacks", 0)
            out["decode_choice"] = {n: dict(c) for n, c in self.choice.items()}
        return out


def prepare_auto(model: torch.nn.Module, decode_sizes: Sequence[int], prefill_sizes: Sequence[int],
                 make_inputs: Callable[[int], Any]) -> tuple[AutoDispatch, float]:
    """The auto row's callable, built and captured now, and its setup seconds."""
    sync()
    start = time.perf_counter()
    auto = AutoDispatch(model, decode_sizes, prefill_sizes, make_inputs)
    sync()
    return auto, time.perf_counter() - start
