"""``mode="auto"``: what to fix when tracing fails, and the one warning that says what was given up."""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("piecegraph")


def _error_frames(error: BaseException) -> list[str]:
    """File names on the user stack of a Dynamo error (``real_stack``), else on its traceback."""
    stack = getattr(error, "real_stack", None)
    if stack:
        return [frame.filename for frame in stack]
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return frames


def _packages_on_stack(error: BaseException) -> list[str]:
    """Top-level packages (not torch, not piecegraph, not the standard library) whose files the error passed."""
    files = set(_error_frames(error))
    found = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        top = name.split(".")[0]
        if path in files and top not in ("torch", "piecegraph", "functools") and top not in found:
            if not path.startswith(sys.base_prefix) or "site-packages" in path:
                found.append(top)
    return found


def apply_known_fixes(model: Any, values: dict[str, Any], error: BaseException) -> list[str]:
    """Apply what piecegraph knows fixes a trace failure; return a description of each fix applied.

    FlashInfer loaded: its adapter (opaque ops with fakes, frozen probes). Packages on the failing stack: their
    warm functools-cached loaders are frozen so Dynamo reads them as constants. Nothing else is changed.
    """
    from ..ops.freeze import freeze_package

    fixes = []
    if "flashinfer" in sys.modules:
        from ..ops.adapters import flashinfer

        try:
            installed = flashinfer.install()
            fixes.append(f"piecegraph.adapters.flashinfer.install() ({len(installed.ops)} ops)")
        except Exception as err:  # a broken adapter must not hide the original failure
            log.warning("piecegraph auto: FlashInfer adapter failed: %s", err)
    for package in _packages_on_stack(error):
        try:
            frozen = freeze_package(package)
        except Exception as err:
            log.info("piecegraph auto: could not freeze %s: %s", package, err)
            continue
        if frozen:
            fixes.append(f"piecegraph.freeze_package({package!r}) ({len(frozen)} loaders)")
    return fixes


def blocker_summary(error: BaseException) -> str:
    """One line: the error's type, its first message line, and the deepest non-torch frame it came through."""
    message = (str(error).strip().splitlines() or [""])[0]
    stack = getattr(error, "real_stack", None)
    where = ""
    if stack:
        frame = stack[-1]
        where = f" at {frame.filename}:{frame.lineno} ({frame.name})"
    return f"{type(error).__name__}: {message[:200]}{where}"


def doctor_summary(model: Any, values: dict[str, Any], error: BaseException) -> str:
    """The doctor's blockers (package ▸ entry ▸ loader: primitive, with the fix), else the error's own line."""
    from ..context import current_forward_context
    from ..doctor.core import blocker_lines

    try:
        lines = blocker_lines(model, (), kwargs=values, context=current_forward_context(), limit=3)
    except Exception as err:  # the summary must never hide the fallback itself
        log.info("piecegraph auto: the doctor could not summarise the blockers: %s", err)
        lines = []
    return "; ".join(lines) if lines else blocker_summary(error)


def fallback_warning(summary: str, fixes: list[str], fallback: str) -> str:
    tried = f" after trying {'; '.join(fixes)}" if fixes else ""
    return (
        f"piecegraph auto: the model does not trace with Dynamo{tried}. Blockers: {summary}. "
        f"Running {fallback} instead, which gives up Inductor's fusion (about 2x at small batches). "
        "`piecegraph doctor` lists every blocker with its fix."
    )
