"""Prometheus metrics in the text exposition format, written by hand: a dozen series need no dependency and no
process-global registry (each server owns its :class:`Metrics`)."""

from __future__ import annotations

import bisect
import threading
from typing import Callable, Iterable

# Latency buckets in seconds: sub-millisecond decode steps on a GPU up to multi-second prefills under load.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# name -> (type, help); every series the server writes is declared here, in exposition order.
SERIES = {
    "piecegraph_requests_total": ("counter", "Finished generations by finish reason (stop, length, abort)."),
    "piecegraph_request_errors_total": ("counter", "Refused or failed requests by HTTP status."),
    "piecegraph_prompt_tokens_total": ("counter", "Prompt tokens of accepted requests."),
    "piecegraph_generation_tokens_total": ("counter", "Output tokens sent to clients."),
    "piecegraph_time_to_first_token_seconds": ("histogram", "Request arrival to its first output token."),
    "piecegraph_inter_token_latency_seconds": ("histogram", "Gap between consecutive token events of a request, "
                                               "per token."),
    "piecegraph_request_latency_seconds": ("histogram", "Request arrival to its last output token."),
    "piecegraph_requests_waiting": ("gauge", "Accepted requests without a first token yet (queue depth)."),
    "piecegraph_requests_running": ("gauge", "Requests generating."),
    "piecegraph_engine_steps_total": ("counter", "Engine steps by graph kind (full, piecewise, none, eager, ...)."),
    "piecegraph_kv_pages_used": ("gauge", "KV-cache pages held by sequences."),
    "piecegraph_kv_pages_total": ("gauge", "KV-cache pages sequences can use (the scratch page excluded)."),
}


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> Iterable[str]:
        total = 0
        for bound, n in zip(self.buckets, self.counts):
            total += n
            yield f'{name}_bucket{{le="{bound}"}} {total}'
        yield f'{name}_bucket{{le="+Inf"}} {self.count}'
        yield f"{name}_sum {self.sum}"
        yield f"{name}_count {self.count}"


class Metrics:
    """Counters, gauges and histograms of :data:`SERIES`; thread-safe (the engine loop and the HTTP handlers both
    write). ``gauges``: a callable read at each scrape that returns current gauge values by series name."""

    def __init__(self, gauges: Callable[[], dict[str, float]] | None = None) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._hists = {name: _Histogram(LATENCY_BUCKETS) for name, (kind, _) in SERIES.items() if kind == "histogram"}
        self.gauges = gauges

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (self._known(name), tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + value

    def observe(self, name: str, seconds: float, times: int = 1) -> None:
        """Record ``seconds`` ``times`` times (a token event that carried several tokens counts each)."""
        with self._lock:
            self._hists[self._known(name)].observe(seconds, times)

    def value(self, name: str, **labels: str) -> float:
        """A counter's current value (0 when never written): for tests and logs."""
        with self._lock:
            return self._values.get((name, tuple(sorted(labels.items()))), 0.0)

    def render(self) -> str:
        """The exposition text (``text/plain; version=0.0.4``)."""
        gauges = self.gauges() if self.gauges else {}
        out: list[str] = []
        with self._lock:
            for name, (kind, help_text) in SERIES.items():
                out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                if kind == "histogram":
                    out += self._hists[name].lines(name)
                elif name in gauges:
                    out.append(f"{name} {gauges[name]}")
                else:
                    rows = [(labels, v) for (n, labels), v in sorted(self._values.items()) if n == name]
                    out += [f"{name}{_labels(labels)} {v:g}" for labels, v in rows]
        return "\n".join(out) + "\n"

    @staticmethod
    def _known(name: str) -> str:
        if name not in SERIES:
            raise KeyError(f"metric {name!r} is not declared in piecegraph.server.metrics.SERIES")
        return name


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
