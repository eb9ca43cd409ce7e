"""``mode="auto"``: what to fix when tracing fails, and the one warning that says what was given up."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("piecegraph")


def apply_doctor_fixes(model: Any, values: dict[str, Any]) -> tuple[list[str], str]:
    """The doctor's safe fixes (FlashInfer adapter, freeze of warm loaders), applied; and its blocker summary.

    Returns the code of each fix applied and the blockers the doctor found before them ("" if it could not run).
    """
    from ..context import current_forward_context
    from ..doctor.core import apply_safe_fixes

    try:
        fixes, lines = apply_safe_fixes(model, (), kwargs=values, context=current_forward_context())
    except Exception as err:  # the doctor must never hide the fallback itself
        log.info("piecegraph auto: the doctor could not run: %s", err)
        return [], ""
    return fixes, "; ".join(lines)


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
