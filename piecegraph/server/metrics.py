"""Prometheus metrics in the text exposition format, written by hand: a dozen series need no dependency and no
process-global registry (each server owns its :class:`Metrics`). With several front-end processes
(``--api-servers``) each keeps its own and ``/metrics`` adds the others' latest snapshots (``peers``), so a scrape
that reaches any of them sees the whole server."""

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
    "piecegraph_prompt_cached_tokens_total": ("counter", "Prompt tokens of finished requests that the prefix "
                                              "cache held (not computed again)."),
    "piecegraph_generation_tokens_total": ("counter", "Output tokens sent to clients."),
    "piecegraph_time_to_first_token_seconds": ("histogram", "Request arrival to its first output token."),
    "piecegraph_inter_token_latency_seconds": ("histogram", "Gap between consecutive token events of a request, "
                                               "per token."),
    "piecegraph_request_latency_seconds": ("histogram", "Request arrival to its last output token."),
    "piecegraph_requests_waiting": ("gauge", "Accepted requests without a first token yet (queue depth)."),
    "piecegraph_requests_running": ("gauge", "Requests generating."),
    "piecegraph_engine_steps_total": ("counter", "Engine steps by graph kind (full, piecewise, none, eager, ...)."),
    "piecegraph_engine_loop_seconds_total": ("counter", "Engine loop wall seconds by part: step (scheduling, "
                                             "launch, waiting for tokens), publish (tokens to the front ends), "
                                             "commands (new requests, aborts), idle (waiting for work)."),
    "piecegraph_engine_step_phase_seconds_total": ("counter", "Engine step host seconds by phase (schedule, "
                                                   "metadata, forward_launch, sample_sync)."),
    "piecegraph_engine_time_to_first_token_seconds_total": ("counter", "Engine seconds from taking a request to "
                                                            "its first token on the host, summed over requests."),
    "piecegraph_engine_first_tokens_total": ("counter", "Requests whose first token the engine published."),
    "piecegraph_kv_pages_used": ("gauge", "KV-cache pages held by sequences."),
    "piecegraph_kv_pages_total": ("gauge", "KV-cache pages sequences can use (the scratch page excluded)."),
}

# Gauges each front-end process holds its own share of (summed over front ends); the KV pages are the engine's.
FRONT_END_GAUGES = ("piecegraph_requests_waiting", "piecegraph_requests_running")


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += times
        self.sum += value * times
        self.count += times

    def add(self, counts: list[int], total: float, count: int) -> None:
        self.counts = [a + b for a, b in zip(self.counts, counts)]
        self.sum += total
        self.count += count

    def copy(self) -> "_Histogram":
        other = _Histogram(self.buckets)
        other.add(self.counts, self.sum, self.count)
        return other

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
    write). ``gauges``: a callable read at each scrape that returns current gauge values by series name.
    ``peers``: a callable returning the other front-end processes' :meth:`snapshot` dicts, added in at render."""

    def __init__(self, gauges: Callable[[], dict[str, float]] | None = None,
                 peers: Callable[[], list[dict]] | None = None) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._hists = {name: _Histogram(LATENCY_BUCKETS) for name, (kind, _) in SERIES.items() if kind == "histogram"}
        self.gauges, self.peers = gauges, peers

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

    def snapshot(self) -> dict:
        """This process's series as plain data (JSON-able): counters, histograms, and the front-end gauges."""
        gauges = self.gauges() if self.gauges else {}
        with self._lock:
            return {"values": [[name, [list(kv) for kv in labels], v] for (name, labels), v in self._values.items()],
                    "hists": {name: [h.counts, h.sum, h.count] for name, h in self._hists.items()},
                    "gauges": {name: gauges[name] for name in FRONT_END_GAUGES if name in gauges}}

    def render(self) -> str:
        """The exposition text (``text/plain; version=0.0.4``), the peers' snapshots added in."""
        gauges = dict(self.gauges() if self.gauges else {})
        peers = self.peers() if self.peers else []
        with self._lock:
            values, hists = dict(self._values), {name: h.copy() for name, h in self._hists.items()}
        for peer in peers:
            for name, labels, v in peer["values"]:
                key = (name, tuple(tuple(kv) for kv in labels))
                values[key] = values.get(key, 0.0) + v
            for name, (counts, total, count) in peer["hists"].items():
                hists[name].add(counts, total, count)
            for name, value in peer["gauges"].items():
                gauges[name] = gauges.get(name, 0) + value
        out: list[str] = []
        for name, (kind, help_text) in SERIES.items():
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            if kind == "histogram":
                out += hists[name].lines(name)
            elif name in gauges:
                out.append(f"{name} {gauges[name]}")
            else:
                rows = [(labels, v) for (n, labels), v in sorted(values.items()) if n == name]
                out += [f"{name}{_labels(labels)} {_number(v)}" for labels, v in rows]
        return "\n".join(out) + "\n"

    @staticmethod
    def _known(name: str) -> str:
        if name not in SERIES:
            raise KeyError(f"metric {name!r} is not declared in piecegraph.server.metrics.SERIES")
        return name


def _number(value: float) -> str:
    """A counter's value exactly (what Python reads back as the same float): ``:g`` kept 6 significant digits, so a
    seconds counter moved in steps of 10 us past 10 s and of whole seconds past a day, and two scrapes' difference
    (what ``rate()`` and ``serve-bench --url`` compute) carried that error."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
