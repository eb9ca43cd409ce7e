"""The doctor as auto mode's advisor (``piecegraph.graphs.fallback.Advisor``): its safe fixes and its blockers."""

from __future__ import annotations

import logging
from typing import Any

from piecegraph.context import current_forward_context
from piecegraph.diagnose.core import apply_safe_fixes, blocker_lines
from piecegraph.graphs.fallback import blocker_summary

log = logging.getLogger("piecegraph")


class DoctorAdvisor:
    """Fixes: the FlashInfer adapter and the freeze of warm loaders. Summary: package ▸ entry ▸ loader:
    primitive, with the fix, for the first three blockers. Neither ever raises: a doctor that cannot run must not
    hide the fallback itself."""

    def apply_fixes(self, model: Any, values: dict[str, Any]) -> tuple[list[str], str]:
        try:
            fixes, lines = apply_safe_fixes(model, (), kwargs=values, context=current_forward_context())
        except Exception as err:  # noqa: BLE001
            log.info("piecegraph auto: the doctor could not run: %s", err)
            return [], ""
        return fixes, "; ".join(lines)

    def summarize(self, model: Any, values: dict[str, Any], error: BaseException) -> str:
        try:
            lines = blocker_lines(model, (), kwargs=values, context=current_forward_context(), limit=3)
        except Exception as err:  # noqa: BLE001
            log.info("piecegraph auto: the doctor could not summarise the blockers: %s", err)
            lines = []
        return "; ".join(lines) if lines else blocker_summary(error)
