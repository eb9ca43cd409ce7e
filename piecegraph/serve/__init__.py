"""Continuous batching: scheduler, pages, chunked prefill, preemption; per step full graphs for pure decode,
piecewise graphs for everything else, one pool. ``piecegraph serve-bench`` measures it by concurrency."""

from piecegraph.serve.config import ENGINE_MODES, EngineConfig, serve_sizes
from piecegraph.serve.engine import Engine
from piecegraph.serve.request import Request, SamplingParams, Status
from piecegraph.serve.stats import StepStats, summarize

__all__ = [
    "ENGINE_MODES",
    "Engine",
    "EngineConfig",
    "Request",
    "SamplingParams",
    "Status",
    "StepStats",
    "serve_sizes",
    "summarize",
]
