"""The doctor as the engine's advisor (``piecegraph.graphs.fallback.Advisor``): its fixes for auto mode (and for
``Config(auto_opaque=True)``), the blockers it names, and piecegraph's error for piecewise/full traces.

:meth:`DoctorAdvisor.fix_trace` runs rounds of: the doctor's trace (breaks allowed) ▸ attribution ▸ fixes (the
FlashInfer adapter for the functions it covers, automatic opaque for other library functions, ``freeze`` of warm
loaders) ▸ apply, until the trace has no break or a round applies nothing new. None of its methods raises: a
doctor that cannot run must not hide the fallback or the original error.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from piecegraph.context import current_forward_context
from piecegraph.diagnose.attribute import Finding, attribute_one
from piecegraph.diagnose.autowrap import library_entries, plan_wraps
from piecegraph.diagnose.core import _Stage, _user_tops, blocker_lines
from piecegraph.diagnose.fixes import Applied, apply_fixes, choose_fixes
from piecegraph.diagnose.index import CodeIndex
from piecegraph.diagnose.trace import error_record
from piecegraph.graphs.fallback import TraceBreakError, TraceFixes, blocker_summary, wants_auto_opaque

log = logging.getLogger("piecegraph")
_ROUNDS = 4  # a fix can uncover the next break of a call chain; each round wraps every entry it saw


def fix_rounds(model: Any, values: dict[str, Any], context: Any, wrap: bool, token_dim: int = 0,
               static: tuple = (), retrace: Optional[Callable[[], Optional[Exception]]] = None) -> TraceFixes:
    """The fix loop (module docstring). ``values``: the forward's arguments by name (copies: they run).
    ``retrace``: the caller's trace, tried after each round that fixed something; when it succeeds the loop ends
    there (``traced``), without the diagnosis trace that would only confirm nothing blocks any more (a whole
    Dynamo trace with breaks: half of automatic opaque's time on a 24-layer MoE)."""
    tops, applied, refused = _user_tops(model, ()), Applied(), {}
    summary, stage, traced, error = None, None, False, None
    for _ in range(_ROUNDS):
        stage = _Stage(model, (), dict(values), context, tops, wrap, token_dim, static, refused)
        summary = "; ".join(blocker_lines(stage.findings)) if summary is None else summary
        refused.update(stage.wrapping.refused)
        fixable = [f for f in stage.findings if stage.fixes[id(f)].action is not None]
        if not stage.findings or apply_fixes(fixable, stage.fixes, applied, model) == 0:
            break  # nothing applied since the last retrace: its error stands for the module as it is
        if retrace is not None:
            error = retrace()
            if error is None:
                traced = True
                break
    else:
        stage = _Stage(model, (), dict(values), context, tops, wrap, token_dim, static, refused)
    wrapped = {op.entry: op.line for op in applied.ops}
    remaining = "" if traced else "; ".join(blocker_lines(stage.findings))
    return TraceFixes(list(applied.codes), wrapped, {k: v for k, v in refused.items() if k not in wrapped},
                      summary or "", remaining, applied.routes.undo, traced, error)


def _message(f: Finding, fix: str, mode: str, error: BaseException) -> str:
    called = f" (called at {f.frame.location})" if f.frame is not None else ""
    lines = "\n".join(f"      {line}" for line in fix.splitlines())
    dynamo = str(error).strip()
    return (f"piecegraph: mode={mode!r} traces the model as one Dynamo graph, and the trace breaks inside the "
            f"library {f.package!r}: {f.entry}{called} reaches {f.primitive} ({f.category}, {f.location}).\n"
            f"Fixes, either of:\n"
            f"  * mode=\"auto\" (or Config(auto_opaque=True) in this mode) wraps each library function that stops "
            f"Dynamo as an opaque op, its fake inferred by running it;\n"
            f"  * make it one graph node yourself, before the first call:\n{lines}\n"
            f"`piecegraph doctor` lists every blocker.\n\nDynamo's error ({type(error).__name__}):\n{dynamo}")


def explain(model: Any, values: dict[str, Any], config: Any, error: BaseException) -> Optional[TraceBreakError]:
    """A :class:`TraceBreakError` for a failed trace whose break lies inside an installed library; None otherwise
    (a break in the model's own code, or not a graph break: Dynamo's error is the clearest)."""
    if not isinstance(error, torch._dynamo.exc.Unsupported):
        return None
    index = CodeIndex()
    if isinstance(model, torch.nn.Module):
        index.add_classes({type(m) for m in model.modules()})
    finding = attribute_one(error_record(error), index, _user_tops(model, ()), model=model)
    if finding.package in ("user", "torch", "piecegraph"):
        return None
    context = current_forward_context()
    wrapping = plan_wraps(model, (), values, context, library_entries([finding]), config.token_dim,
                          tuple(config.static_inputs))
    fix = choose_fixes([finding], wrapping)[id(finding)].code
    return TraceBreakError(_message(finding, fix, config.mode, error))


class DoctorAdvisor:
    """Fixes, blocker names and errors from the doctor (see the module docstring)."""

    def fix_trace(self, model: Any, values: dict[str, Any], config: Any,
                  retrace: Optional[Callable[[], Optional[Exception]]] = None) -> TraceFixes:
        try:
            return fix_rounds(model, values, current_forward_context(), wants_auto_opaque(config),
                              config.token_dim, tuple(config.static_inputs), retrace)
        except Exception as err:  # noqa: BLE001
            log.info("piecegraph: the doctor could not run: %s", err)
            return TraceFixes()

    def apply_fixes(self, model: Any, values: dict[str, Any]) -> tuple[list[str], str]:
        """The fixes without automatic opaque (the FlashInfer adapter, ``freeze``): codes and blockers before."""
        try:
            fixed = fix_rounds(model, values, current_forward_context(), wrap=False)
        except Exception as err:  # noqa: BLE001
            log.info("piecegraph auto: the doctor could not run: %s", err)
            return [], ""
        return fixed.fixes, fixed.summary

    def summarize(self, model: Any, values: dict[str, Any], error: BaseException) -> str:
        try:
            stage = _Stage(model, (), values, current_forward_context(), _user_tops(model, ()), wrap=False)
            lines = blocker_lines(stage.findings)
        except Exception as err:  # noqa: BLE001
            log.info("piecegraph auto: the doctor could not summarise the blockers: %s", err)
            lines = []
        return "; ".join(lines) if lines else blocker_summary(error)

    def explain(self, model: Any, values: dict[str, Any], config: Any, error: BaseException
                ) -> Optional[BaseException]:
        try:
            return explain(model, values, config, error)
        except Exception as err:  # noqa: BLE001
            log.info("piecegraph: the doctor could not explain the trace failure: %s", err)
            return None
