"""prewarm(): one eager forward before tracing, so every JIT build happens now rather than inside capture.

It also says what happened: which functools-cached loaders filled during the run (their cache sizes are read
before and after, from the globals of loaded modules) and how long the first call took. A terminal gets a rich
spinner; anything else gets one summary line through ``logging``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from piecegraph.ops.freeze import freeze
from piecegraph.ops.modules import functools_caches

__all__ = ["prewarm", "PrewarmReport", "FilledLoader"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FilledLoader:
    """A functools cache that gained entries during the prewarm run."""

    name: str  # module.qualname
    new_entries: int
    fn: Callable = field(repr=False, compare=False)  # the cached function itself, e.g. to freeze() it


@dataclass(frozen=True)
class PrewarmReport:
    """What :func:`prewarm` saw: seconds of the first eager call and the loaders that filled, largest first."""

    seconds: float
    filled: list[FilledLoader]
    frozen: list[str] = field(default_factory=list)  # names frozen afterwards (prewarm(..., freeze=True))

    def summary(self) -> str:
        """One line: time, count of filled loaders and the first few names."""
        names = ", ".join(f"{f.name} (+{f.new_entries})" for f in self.filled[:5])
        more = f", +{len(self.filled) - 5} more" if len(self.filled) > 5 else ""
        froze = f"; froze {len(self.frozen)}" if self.frozen else ""
        filled = f": {names}{more}" if self.filled else ""
        seconds = f"{self.seconds:.3f} s"
        return f"prewarm: first eager call {seconds}, {len(self.filled)} cached loaders filled{filled}{froze}"


def _cache_sizes() -> dict[int, tuple[Callable, int]]:
    """``id -> (cached function, current size)`` for every functools cache in a loaded module's globals."""
    sizes: dict[int, tuple[Callable, int]] = {}
    for value in functools_caches():
        try:
            sizes[id(value)] = (value, value.cache_info().currsize)
        except Exception:  # noqa: BLE001  (a broken wrapper must not stop the report)
            continue
    return sizes


def _filled(before: dict[int, tuple[Callable, int]], after: dict[int, tuple[Callable, int]]) -> list[FilledLoader]:
    out = []
    for key, (fn, size) in after.items():
        old = before.get(key, (fn, 0))[1]  # a module imported during the run starts from zero
        if size > old:
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
            out.append(FilledLoader(name=name, new_entries=size - old, fn=fn))
    return sorted(out, key=lambda f: (-f.new_entries, f.name))


@contextlib.contextmanager
def _status(message: str) -> Iterator[None]:
    """A rich spinner when stderr is a terminal; silence otherwise (no progress noise in logs or CI)."""
    if not sys.stderr.isatty():
        yield
        return
    try:
        from rich.console import Console
    except ImportError:
        yield
        return
    with Console(stderr=True).status(message, spinner="dots"):
        yield


def _sync(args: tuple, kwargs: dict) -> None:
    """Wait for CUDA work so the time includes the kernels, not only their launch."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


def prewarm(model: Callable, *example_inputs: Any, freeze_loaders: bool = False, **example_kwargs: Any
            ) -> PrewarmReport:
    """Run ``model(*example_inputs, **example_kwargs)`` once eagerly under ``torch.no_grad()`` and report.

    Every JIT build the run triggers (kernel compilation, library loading, capability probes) happens now, so
    tracing and graph capture find warm caches. The inputs should reach every code path that will be compiled
    (each dtype, each kernel variant): a loader first called later is cold then. Nothing is copied or kept:
    the model's output is dropped. With ``freeze_loaders=True`` every loader that filled is then frozen
    (:func:`piecegraph.freeze`), so Dynamo traces those lookups without breaks.

    Returns a :class:`PrewarmReport` (seconds, filled loaders with their new entry counts) and logs its
    one-line summary at INFO.
    """
    before = _cache_sizes()
    with _status("piecegraph: prewarm - first eager call, JIT kernels build now"):
        start = time.perf_counter()
        with torch.no_grad():
            model(*example_inputs, **example_kwargs)
        _sync(example_inputs, example_kwargs)
        seconds = time.perf_counter() - start
    filled = _filled(before, _cache_sizes())
    frozen = []
    if freeze_loaders:
        for loader in filled:
            try:
                freeze(loader.fn)
                frozen.append(loader.name)
            except Exception as err:  # one unreadable cache must not stop the others
                log.warning("prewarm: could not freeze %s: %s", loader.name, err)
    report = PrewarmReport(seconds=seconds, filled=filled, frozen=frozen)
    log.info(report.summary())
    return report
