"""How a GraphedModule starts from what was kept: the cache's AOTInductor packages, the cache's traced program, or
another module's trace (``trace_from``); what it keeps for later starts; and, for a full graph compiled by pieces,
the swap to the whole graph's package once the background worker made it. A mixin of :class:`GraphedModule`."""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..cache.packaging import read_state, running
from ..cache.session import TRACE, CacheEntry
from ..cache.store import LockTimeout, Store
from ..context import override_forward_context
from ..trace.aot_package import PROGRAM_FILE
from .auto import piecewise_config
from .build import (
    Startup,
    TraceSnapshot,
    cuda_index,
    load_packaged_trace,
    load_trace,
    packaged_record,
    trace_snapshot,
)

log = logging.getLogger("piecegraph")
TRACED_PROGRAM_MODES = ("piecewise", "full", "auto")  # modes whose program a traced snapshot can build
UPGRADE_POLL_S = 1.0  # how often a call looks for the worker's packages (a file read) while it runs


@dataclass
class PendingUpgrade:
    """A full graph compiled by pieces whose whole graph a background worker is packaging: where its packages
    will be (the cache entry and the trace they belong to), the call's device, when to look next, and the inputs
    of the last :meth:`~piecegraph.GraphedModule.capture` (to capture the captured sizes again after the swap)."""

    root: Path
    key: str
    material: dict[str, Any]
    trace: bytes
    device_index: int | None
    started: float
    next_check: float = 0.0
    make_inputs: Callable[[int], Any] | None = None


def pending_upgrade(by_pieces: bool, entry: CacheEntry, values: dict[str, Any]) -> PendingUpgrade | None:
    """The upgrade to wait for after a setup whose entry a worker is packaging, or ``None``: only a full graph
    compiled by pieces (``by_pieces``: ``Program.by_pieces``) runs other code than its package will."""
    trace = entry.new_trace or entry.trace
    if not by_pieces or entry.root is None or entry.key is None or trace is None:
        return None
    now = time.monotonic()
    return PendingUpgrade(entry.root, entry.key, entry.material or {}, trace, cuda_index(values), now,
                          now + UPGRADE_POLL_S)


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
        """Build and bind the program of a traced program's snapshot without Dynamo; False (and a warning naming
        ``what``) when it does not fit this model. With :meth:`trace_from`, a full graph compiled by pieces takes
        the source module's compiled pieces where they are this program's (trace/handover.py), and
        ``stats()["startup"]["pieces"]`` says ``"shared"``."""
        source = self._trace_source
        offered = source.runner.program.offered if source is not None and source._runners else None
        try:
            snapshot = snapshot_of()
            config = self.config.replace(static_inputs=snapshot.static_inputs)
            built, verify = piecewise_config(config) if config.mode == "auto" else (config, None)
            binding = load_trace(self.model, snapshot, built, self._runners, verify, self._startup, self._packages,
                                 offered)
        except Exception as err:  # noqa: BLE001  (never load what does not fit: trace anew, and say so)
            log.warning("%s could not be used (%s: %s); tracing anew", what, type(err).__name__, err)
            self._reset()
            return False
        self.config, self._binding, self._compiled = config, binding, self.runner
        self._weights.bind(binding)
        self._snapshot = snapshot if self._shares_trace else None
        if self.runner.program.took_pieces:
            self._startup.cache["pieces"] = "shared"
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


class PackagedUpgrade:
    """The GraphedModule methods that swap a full graph compiled by pieces for the whole graph's package."""

    swaps = 0  # how many times the program was swapped for its package (per instance once it swapped)

    def poll_upgrade(self) -> bool:
        """Look for the background worker's package now (no more than every ``UPGRADE_POLL_S``; a call does this
        itself) and swap it in when it is there. For a caller that may not call this module for a while (the
        engine, whose auto mode may replay the piecewise module instead). True when the program was swapped."""
        upgrade = self._upgrade
        if upgrade is None or time.monotonic() < upgrade.next_check:
            return False
        with self._call_lock.lock, torch.no_grad():  # the swap's captures, as a call's
            before = self.swaps
            if self._upgrade is not None:  # another thread's call may have swapped meanwhile
                self._poll_upgrade()
            return self.swaps != before

    def _poll_upgrade(self) -> None:
        """At the start of a call (at most every UPGRADE_POLL_S): once the worker is done, swap the program for
        its package (the whole graph, fused across the split ops) and capture the captured sizes again, before
        the call runs; if it failed, keep the program and stop looking. A swap that fails keeps the old program,
        with a warning; an entry another start holds is looked at again later."""
        pending = self._upgrade
        pending.next_check = time.monotonic() + UPGRADE_POLL_S
        if running(pending.root, pending.key):
            return
        self._upgrade = None
        state = read_state(pending.root, pending.key) or {}  # read after the worker ended: its last word
        if state.get("state") != "done":
            log.info("piecegraph: keeping the full graph compiled by pieces: the background packaging %s (%s)",
                     state.get("state", "ended"), state.get("why") or "no word")
            return
        try:
            self._swap_in_packages(pending)
        except LockTimeout:  # another start holds the entry (compiling, publishing): look again later
            self._upgrade = pending
        except Exception as err:  # noqa: BLE001  (a swap that fails keeps the working program)
            log.warning("piecegraph: the whole graph's package could not be swapped in (%s: %s); keeping the full "
                        "graph compiled by pieces", type(err).__name__, err)

    def _swap_in_packages(self, pending: PendingUpgrade) -> None:
        store = Store(pending.root)
        with store.locked(pending.key, timeout=0.05):  # never hold a serving call for another start's setup
            files = store.load(pending.key, pending.material).files
        if files is None or PROGRAM_FILE not in files or files.get(TRACE) != pending.trace:
            raise LookupError("the cache entry no longer holds this program's packages")
        runners: list[Any] = []
        binding = load_packaged_trace(self.model, pickle.loads(files[TRACE]), pickle.loads(files[PROGRAM_FILE]),
                                      store.entry(pending.key), self.config, runners, None, Startup(),
                                      pending.device_index)
        old = (self._runners, self._binding, self._compiled)
        captured = sorted(self.runner.capture_s, reverse=True)
        self._runners, self._binding, self._compiled = runners, binding, runners[-1]
        self._weights.bind(binding)
        try:
            if pending.make_inputs is not None and captured:
                with override_forward_context(None):  # inside a call: its context set aside for the captures'
                    self._capture_sizes(pending.make_inputs, captured)
        except BaseException:
            self._runners, self._binding, self._compiled = old  # its graphs are still there: as before the swap
            self._weights.bind(self._binding)
            raise
        for runner in old[0]:
            runner.drop_graphs()
        self.swaps += 1
        self._startup.cache["aot"] = (f"the whole graph's package, swapped in {time.monotonic() - pending.started:.0f}"
                                      " s after the setup")
        log.info("piecegraph: %s", self._startup.cache["aot"])
