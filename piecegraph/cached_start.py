"""How a GraphedModule starts from what was kept: the cache's AOTInductor packages, the cache's traced program, or
another module's trace (``trace_from``); and what it keeps for later starts. A mixin of :class:`GraphedModule`."""

from __future__ import annotations

import logging
import pickle
from typing import Any, Callable

from .auto import piecewise_config
from .build import TraceSnapshot, cuda_index, load_packaged_trace, load_trace, packaged_record, trace_snapshot
from .cache.session import CacheEntry

log = logging.getLogger("piecegraph")
TRACED_PROGRAM_MODES = ("piecewise", "full", "auto")  # modes whose program a traced snapshot can build


class CachedStart:
    """The GraphedModule methods that build its program from kept artifacts instead of Dynamo and Inductor."""

    def _load_trace(self, entry: CacheEntry) -> bool:
        """Build the program from the cache's traced program instead of Dynamo (piecewise, full, and auto, whose
        traced program is a piecewise one); False (and a warning, unless there was none) when there is none or it
        does not fit this model: then it traces."""
        if not entry.enabled:
            return False
        self._startup.cache["trace"] = "traced"
        if entry.trace is None or self.config.mode not in TRACED_PROGRAM_MODES:
            return False
        if not self._build_from(lambda: pickle.loads(entry.trace), "piecegraph cache: the traced program"):
            entry.trace = None  # so the new trace replaces it
            return False
        self._startup.cache["trace"] = "loaded"
        return True

    def _load_packages(self, values: dict[str, Any], entry: CacheEntry) -> bool:
        """Build the program from the cache's AOTInductor packages (no Dynamo, no Inductor imported); False when
        there are none for this start, or (with a warning) when they do not fit: then it compiles."""
        try:
            record = packaged_record(self.config, values, entry)
            if record is None:
                return False
            snapshot = pickle.loads(entry.trace)
            config = self.config.replace(static_inputs=snapshot.static_inputs)
            built, verify = piecewise_config(config) if config.mode == "auto" else (config, None)
            binding = load_packaged_trace(self.model, snapshot, record, entry.folder, built, self._runners, verify,
                                          self._startup, cuda_index(values))
        except Exception as err:  # noqa: BLE001  (never run what does not fit: compile instead, and say so)
            log.warning("piecegraph cache: the compiled packages could not be used (%s: %s); compiling anew",
                        type(err).__name__, err)
            self._reset()
            return False
        self.config, self._binding, self._compiled = config, binding, self.runner
        self._weights.bind(binding)
        self._snapshot = snapshot if self._shares_trace else None
        self._startup.cache["trace"] = "packaged"
        return True

    def trace_from(self, other: Any) -> None:
        """Build this module's program from ``other``'s Dynamo trace instead of tracing the model again (an
        engine's piecewise and full modules of one model: one trace, two programs). ``other`` must wrap the same
        model and set up first; it keeps its trace's snapshot for this. Where it has none (automatic opaque
        wrapped a function, breakable, a trace that cannot be snapshotted) or the snapshot does not fit, this
        module traces as usual. ``stats()["startup"]["trace"]`` says ``"shared"`` when it was used."""
        if other.model is not self.model:
            raise ValueError("trace_from(other): other must wrap the same model object as this module")
        for field in ("token_dim", "static_inputs"):  # what decides the trace's inputs: a shared one must agree
            theirs, ours = getattr(other.config, field), getattr(self.config, field)
            if _as_set(theirs) != _as_set(ours):
                raise ValueError(f"trace_from(other): other's Config.{field}={theirs!r} differs from this "
                                 f"module's {ours!r}; give both the same")
        if self._compiled is not None:
            raise RuntimeError("trace_from(other) must come before this module's first call or capture")
        self._trace_source, other._shares_trace = other, True

    def _load_shared(self, entry: CacheEntry) -> bool:
        """The program from the trace of :meth:`trace_from`'s module, if it has one; False: trace."""
        source = self._trace_source
        if source is None or self.config.mode not in TRACED_PROGRAM_MODES:
            return False
        snapshot = source._snapshot
        if snapshot is None:
            log.info("piecegraph: the module traced first has no plain trace to share; tracing")
            return False
        if not self._build_from(lambda: snapshot, "the shared trace"):
            return False
        self._startup.cache["trace"] = "shared"
        if entry.enabled:
            entry.new_trace = pickle.dumps(snapshot)
        return True

    def _build_from(self, snapshot_of: Callable[[], TraceSnapshot], what: str) -> bool:
        """Build and bind the program of a traced program's snapshot without Dynamo; False (and a warning
        naming ``what``) when it does not fit this model."""
        try:
            snapshot = snapshot_of()
            config = self.config.replace(static_inputs=snapshot.static_inputs)
            built, verify = piecewise_config(config) if config.mode == "auto" else (config, None)
            binding = load_trace(self.model, snapshot, built, self._runners, verify, self._startup, self._packages)
        except Exception as err:  # noqa: BLE001  (never load what does not fit: trace anew, and say so)
            log.warning("%s could not be used (%s: %s); tracing anew", what, type(err).__name__, err)
            self._reset()
            return False
        self.config, self._binding, self._compiled = config, binding, self.runner
        self._weights.bind(binding)
        self._snapshot = snapshot if self._shares_trace else None
        return True

    def _keep_trace(self, entry: CacheEntry, snapshots: list | None) -> None:
        """Hand the cache a snapshot of a plain trace (one program, bound, nothing wrapped by automatic opaque)."""
        if not snapshots or self._trace_fixes is not None or len(self._runners) != 1:
            return
        snapshot = trace_snapshot(snapshots[-1], self._binding, self.model, self.config)
        if snapshot is not None and entry.enabled:
            entry.new_trace = pickle.dumps(snapshot)
        self._snapshot = snapshot if self._shares_trace else None


def _as_set(value: Any) -> Any:
    """A config value compared as a set of names (``static_inputs``: one name or several), else as it is."""
    if isinstance(value, str):
        return {value}
    return set(value) if isinstance(value, (tuple, list)) else value
