"""``mode="auto"``: who says what to fix when tracing fails, and the one warning that says what was given up.

The engine does not import the doctor: ``GraphedModule`` is handed an :class:`Advisor` (``piecegraph.compile``
passes the doctor's, ``piecegraph.diagnose.advisor.DoctorAdvisor``); without one, auto falls back with the
error's own line and no fixes.
"""

from __future__ import annotations

from typing import Any, Protocol


class Advisor(Protocol):
    """What auto mode asks when Dynamo cannot trace the model."""

    def apply_fixes(self, model: Any, values: dict[str, Any]) -> tuple[list[str], str]:
        """Apply the known safe fixes; return the code of each fix applied and the blockers found before them."""

    def summarize(self, model: Any, values: dict[str, Any], error: BaseException) -> str:
        """One line naming what blocks tracing (``blocker_summary(error)`` when nothing better is known)."""


class NoAdvice:
    """An advisor that knows no fixes and names only the error."""

    def apply_fixes(self, model: Any, values: dict[str, Any]) -> tuple[list[str], str]:
        return [], ""

    def summarize(self, model: Any, values: dict[str, Any], error: BaseException) -> str:
        return blocker_summary(error)


def blocker_summary(error: BaseException) -> str:
    """One line: the error's type, its first message line, and the deepest non-torch frame it came through."""
    message = (str(error).strip().splitlines() or [""])[0]
    stack = getattr(error, "real_stack", None)
    where = ""
    if stack:
        frame = stack[-1]
        where = f" at {frame.filename}:{frame.lineno} ({frame.name})"
    return f"{type(error).__name__}: {message[:200]}{where}"


def fallback_warning(summary: str, fixes: list[str], fallback: str) -> str:
    tried = f" after trying {'; '.join(fixes)}" if fixes else ""
    return (
        f"piecegraph auto: the model does not trace with Dynamo{tried}. Blockers: {summary}. "
        f"Running {fallback} instead, which gives up Inductor's fusion (about 2x at small batches). "
        "`piecegraph doctor` lists every blocker with its fix."
    )
