"""How often each finding re-runs per forward.

One eager forward under ``sys.setprofile``: every Python call is checked against the watched code (the function
a library entry decorates, or the entry itself; the function holding a user finding). Dynamo re-runs a break each
time that code runs, warm cache or not, since it traces through ``functools.cache``.

Constraint: a profile hook already installed (a profiler, a coverage tool) is suspended during this one forward.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from piecegraph.diagnose.attribute import Finding
from piecegraph.diagnose.entry import code_of
from piecegraph.diagnose.trace import run_under

__all__ = ["CallCounts", "count_calls"]

log = logging.getLogger("piecegraph")


@dataclass
class CallCounts:
    """Calls per watched code key ``(file, name, firstline)``."""

    calls: dict[tuple, int] = field(default_factory=dict)


def _key_of(finding: Finding) -> tuple | None:
    code = None
    if finding.entry_ref is not None:  # the decorated function: a decorator's code is shared by many
        fn = finding.entry_ref.fn
        while getattr(fn, "__wrapped__", None) is not None and code_of(fn.__wrapped__) is not None:
            fn = fn.__wrapped__
        code = code_of(fn)
    elif finding.entry_fn is not None:
        code = finding.entry_fn.fn.__code__
    return None if code is None else (os.path.realpath(code.co_filename), code.co_name, code.co_firstlineno)


def count_calls(model: Callable, args: tuple, kwargs: dict, context: Any, findings: list[Finding]) -> CallCounts:
    """Run one eager forward and set ``finding.count`` for each finding whose code could be located."""
    keys = {id(f): _key_of(f) for f in findings}
    watched = {k for k in keys.values() if k is not None}
    counts = CallCounts()
    if not watched:
        return counts
    files = {k[0] for k in watched}
    real: dict[str, str] = {}

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        path = real.get(code.co_filename)
        if path is None:
            path = real[code.co_filename] = os.path.realpath(code.co_filename)
        if path not in files:
            return
        key = (path, code.co_name, code.co_firstlineno)
        if key in watched:
            counts.calls[key] = counts.calls.get(key, 0) + 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    threading.setprofile(hook)  # kernels launched from helper threads still count
    try:
        run_under(context, lambda: model(*args, **kwargs))
    except Exception as err:  # noqa: BLE001  (a model that fails eagerly: its findings say so; counts stay partial)
        log.info("piecegraph doctor: the counting run raised %s: %s", type(err).__name__, err)
    finally:
        sys.setprofile(previous)
        threading.setprofile(None)
    for f in findings:
        key = keys[id(f)]
        if key is not None and counts.calls.get(key):
            f.count = counts.calls[key]
    return counts
