"""When Dynamo cannot trace the model: who says what to fix, what auto mode and automatic opaque say they did, and
piecegraph's error for piecewise and full modes.

The engine does not import the doctor: ``GraphedModule`` is handed an :class:`Advisor` (``piecegraph.compile``
passes the doctor's, ``piecegraph.diagnose.advisor.DoctorAdvisor``); without one, auto falls back with the
error's own line and no fixes, and piecewise/full raise Dynamo's error as it is.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn, Optional, Protocol

__all__ = ["Advisor", "NoAdvice", "TraceFixes", "TraceBreakError", "blocker_summary", "fallback_warning",
           "wrapped_warning", "wants_auto_opaque", "trace_or_explain"]


class TraceBreakError(RuntimeError):
    """``mode="piecewise"``/``"full"``: the model does not trace as one Dynamo graph because a library function
    stops it. The message names the function, the primitive and the fixes; Dynamo's own error is attached below
    it (and is the ``__cause__``)."""


def _nothing() -> None:
    return None


@dataclass
class TraceFixes:
    """What an advisor did to make the model trace: the code of every fix applied (one line each: the FlashInfer
    adapter, ``freeze``, the ``piecegraph.opaque(...)`` lines of automatic opaque), the functions wrapped (name ->
    line), those it could not wrap (name -> why), the blockers found before (``summary``) and left after
    (``remaining``), ``release``: undoes the routing of the wrapped functions (the owner's release),
    ``traced``: the caller's ``retrace`` succeeded inside :meth:`Advisor.fix_trace` (the module is set up), and
    ``error``: what the last ``retrace`` raised otherwise (None when it never ran), for the module as it is now."""

    fixes: list = field(default_factory=list)
    wrapped: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    summary: str = ""
    remaining: str = ""
    release: Callable[[], None] = field(default=_nothing, repr=False)
    traced: bool = False
    error: Optional[Exception] = None

    def trace_error(self, retrace: Callable[[], Optional[Exception]]) -> Optional[Exception]:
        """After fixes: the module's trace error (None: it traced), from the advisor's last ``retrace`` when one
        ran (the fixes were all applied before it), else from ``retrace`` now."""
        if self.traced:
            return None
        return self.error if self.error is not None else retrace()


class Advisor(Protocol):
    """What the engine asks when Dynamo cannot trace the model."""

    def fix_trace(self, model: Any, values: dict[str, Any], config: Any,
                  retrace: Optional[Callable[[], Optional[Exception]]] = None) -> TraceFixes:
        """Apply the known safe fixes (and automatic opaque when :func:`wants_auto_opaque`), tracing again after
        each round, until nothing blocks or nothing more can be done. ``retrace``: the caller's own trace (its
        error, or None once the module is set up), tried after each round that fixed something before another
        diagnosis round (``traced`` in the result when it succeeded). Never raises."""

    def summarize(self, model: Any, values: dict[str, Any], error: BaseException) -> str:
        """One line naming what blocks tracing (``blocker_summary(error)`` when nothing better is known)."""

    def explain(self, model: Any, values: dict[str, Any], config: Any, error: BaseException
                ) -> Optional[BaseException]:
        """piecegraph's error for a failed piecewise/full trace (a :class:`TraceBreakError`), or None to raise
        Dynamo's as it is."""


class NoAdvice:
    """An advisor that knows no fixes and names only the error."""

    def fix_trace(self, model: Any, values: dict[str, Any], config: Any,
                  retrace: Optional[Callable[[], Optional[Exception]]] = None) -> TraceFixes:
        return TraceFixes()

    def apply_fixes(self, model: Any, values: dict[str, Any]) -> tuple[list[str], str]:
        return [], ""

    def summarize(self, model: Any, values: dict[str, Any], error: BaseException) -> str:
        return blocker_summary(error)

    def explain(self, model: Any, values: dict[str, Any], config: Any, error: BaseException
                ) -> Optional[BaseException]:
        return None


def wants_auto_opaque(config: Any) -> bool:
    """``Config.auto_opaque``: None (default) means on in ``mode="auto"`` only."""
    value = getattr(config, "auto_opaque", None)
    return value if value is not None else getattr(config, "mode", None) == "auto"


def blocker_summary(error: BaseException) -> str:
    """One line: the error's type, its first message line, and the deepest non-torch frame it came through."""
    message = (str(error).strip().splitlines() or [""])[0]
    stack = getattr(error, "real_stack", None)
    where = ""
    if stack:
        frame = stack[-1]
        where = f" at {frame.filename}:{frame.lineno} ({frame.name})"
    return f"{type(error).__name__}: {message[:200]}{where}"


def fallback_warning(summary: str, fixes: list[str], fallback: str, refused: Optional[dict] = None) -> str:
    tried = f" after trying {'; '.join(fixes)}" if fixes else ""
    why = "".join(f" {name} was not wrapped as an opaque op: {reason}." for name, reason in (refused or {}).items()
                  if reason not in summary)  # the blockers' lines may say it already
    return (
        f"piecegraph auto: the model does not trace with Dynamo{tried}. Blockers: {summary}.{why} "
        f"Running {fallback} instead, which gives up Inductor's fusion (about 2x at small batches). "
        "`piecegraph doctor` lists every blocker with its fix."
    )


def wrapped_warning(wrapped: dict, mode: str) -> str:
    """The one warning automatic opaque gives: each wrapped function with the line that makes it permanent."""
    lines = "\n".join(f"    {line}" for line in wrapped.values())
    return (f"piecegraph: {len(wrapped)} library function(s) stopped Dynamo and now run as opaque ops (one graph "
            f"node each; fakes inferred by running each at three token counts and checked at two more); the model "
            f"traces {mode}. To make this permanent and skip the probing, run before compiling:\n{lines}")


def trace_or_explain(model: Any, copies: Callable[[], dict], config: Any, advisor: Advisor,
                     try_trace: Callable[[], Optional[Exception]], stacklevel: int = 6) -> Optional[TraceFixes]:
    """piecewise/full: trace; when Dynamo cannot, automatic opaque (``Config(auto_opaque=True)``) and trace again;
    else raise the advisor's error (a :class:`TraceBreakError`) from Dynamo's, or Dynamo's own. ``copies()``:
    fresh copies of the call's arguments for the advisor's runs. Returns what automatic opaque did (None:
    nothing was needed)."""
    error = try_trace()
    if error is None:
        return None
    if wants_auto_opaque(config):
        fixed = advisor.fix_trace(model, copies(), config, retrace=try_trace)
        if fixed.fixes:
            error = fixed.trace_error(try_trace)
            if error is None:
                if fixed.wrapped:
                    warnings.warn(wrapped_warning(fixed.wrapped, config.mode), stacklevel=stacklevel)
                return fixed
        fixed.release()
        explained = _with_refusals(advisor.explain(model, copies(), config, error), fixed.refused)
        _raise_explained(explained, error)
    _raise_explained(advisor.explain(model, copies(), config, error), error)


def _with_refusals(explained: Optional[BaseException], refused: dict) -> Optional[BaseException]:
    """``explained`` with a paragraph naming what automatic opaque tried and why it could not wrap each function
    (its fix line alone would send the user in a circle), before Dynamo's own text."""
    if not isinstance(explained, TraceBreakError) or not refused:
        return explained
    lines = "\n".join(f"  * {name}: {why}" for name, why in refused.items())
    text, marker = str(explained), "\n\nDynamo's error"
    head, sep, tail = text.partition(marker)
    return TraceBreakError(f"{head}\nAutomatic opaque was on and could not wrap:\n{lines}{sep}{tail}")


def _raise_explained(explained: Optional[BaseException], error: BaseException) -> NoReturn:
    if explained is None:
        raise error
    raise explained from error
