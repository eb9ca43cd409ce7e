"""``piecegraph.doctor(model, *inputs)``: prewarm, trace, attribute, count, choose fixes, (fix), probe capture."""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any, Callable, Optional

import torch

from piecegraph.diagnose.attribute import Finding, attribute
from piecegraph.diagnose.autowrap import Wrapping, library_entries, plan_wraps
from piecegraph.diagnose.counting import count_calls
from piecegraph.diagnose.fixes import Applied, Fix, apply_fixes, choose_fixes, group_findings
from piecegraph.diagnose.index import CodeIndex, top_level
from piecegraph.diagnose.probe import CaptureFailure, count_pieces, probe_model
from piecegraph.diagnose.report import Report
from piecegraph.diagnose.trace import TraceResult, run_under, trace

__all__ = ["doctor", "EagerFailure"]


class EagerFailure(RuntimeError):
    """The model fails when run eagerly, before any tracing: nothing the doctor diagnoses can help yet."""


def _prewarm_or_explain(model: Any, inputs: tuple, kwargs: dict, context: Any) -> None:
    from piecegraph.ops.prewarm import prewarm

    try:
        run_under(context, lambda: prewarm(model, *inputs, **kwargs))
    except Exception as err:
        frames = traceback.extract_tb(err.__traceback__)
        where = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        raise EagerFailure(
            f"the model fails when run eagerly, before any tracing: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}{where}. The doctor diagnoses tracing and CUDA graph "
            f"capture; make the eager forward run on these inputs and this device first."
        ) from err

log = logging.getLogger("piecegraph.doctor")
_FIX_ROUNDS = 3  # a fix can uncover the next break of the same call chain; three rounds cover loader + kernel
_CAPTURE_ADVICE = {
    "device sync": "remove the synchronize from the forward (a graph replays without host waits), or run it "
                   "between pieces: piecegraph.opaque(fn, fake=..., split=True)",
    ".item()": "keep host values out of the graph: pass them in through piecegraph.forward_context, or make the "
               "op that reads them a split op (piecegraph.opaque(fn, fake=..., split=True))",
}


def _user_tops(model: Any, extra: tuple[str, ...]) -> set[str]:
    """Top-level packages of the model's own code: its class (or function) module, plus ``extra``."""
    owner = model if not isinstance(model, torch.nn.Module) else type(model)
    tops = {top_level(getattr(owner, "__module__", None)) or "__main__", "__main__", *extra}
    return {t for t in tops if t}


def _device(model: Any, inputs: tuple, device: Optional[str]) -> str:
    if device is not None:
        return str(device)
    tensors = [a for a in inputs if isinstance(a, torch.Tensor)]
    if isinstance(model, torch.nn.Module):
        tensors += list(model.parameters())[:1]
    return "cuda" if any(t.is_cuda for t in tensors) else "cpu"


class _Stage:
    """One trace of the model and everything derived from it (findings, inferred fakes, fixes, breaks per forward).

    ``wrap``: infer fakes for the library entries that break (probing runs of the model and of each function);
    ``token_dim``/``static``: how the model's token inputs are told (see :mod:`piecegraph.diagnose.autowrap`);
    ``refused``: entries refused in an earlier round (name -> why): not probed again, named with the reason.
    """

    def __init__(self, model: Callable, inputs: tuple, kwargs: dict, context: Any, user_tops: set[str],
                 wrap: bool = True, token_dim: int = 0, static: tuple = (), refused: Optional[dict] = None):
        self.result: TraceResult = trace(model, inputs, kwargs, context)
        index = CodeIndex()
        if isinstance(model, torch.nn.Module):  # classes defined inside a function are reachable only this way
            index.add_classes({type(m) for m in model.modules()})
        self.findings: list[Finding] = attribute(self.result.breaks, index, user_tops, model)
        count_calls(model, inputs, kwargs, context, self.findings)
        refused = dict(refused or {})
        entries = [e for e in library_entries(self.findings) if e.alias not in refused] if wrap else []
        self.wrapping: Wrapping = plan_wraps(model, inputs, kwargs, context, entries, token_dim, static)
        self.wrapping.refused = {**refused, **self.wrapping.refused}
        self.fixes: dict[int, Fix] = choose_fixes(self.findings, self.wrapping)
        self.findings = [f for g in group_findings(self.findings) for f in g]

    @property
    def graph_breaks(self) -> int:
        """Breaks per forward: each finding re-runs ``count`` times."""
        return sum(f.count for f in self.findings)


def _capture_finding(fail: CaptureFailure) -> Finding:
    advice = next((v for k, v in _CAPTURE_ADVICE.items() if fail.why.startswith(k)),
                  "run this op outside the graph: make it (or the function around it) a split op, "
                  "piecegraph.opaque(fn, fake=..., split=True)")
    category = "data_dependent" if fail.why.startswith(".item()") else "other"
    return Finding("capture", category, "user", f"{fail.piece}:{fail.node}", None, None, fail.target,
                   fail.location, 1, f"# {fail.location}: {advice}", reason=f"{fail.why}\n{fail.error}")


def _fix_rounds(first: _Stage, run: Callable[[], _Stage], applied: Applied, model: Any) -> _Stage:
    stage = first
    for _ in range(_FIX_ROUNDS):
        if not stage.findings or apply_fixes(stage.findings, stage.fixes, applied, model) == 0:
            break
        stage = run()
    return stage


def doctor(model: Callable, *inputs: Any, context: Any = None, fix: bool = False, device: Optional[str] = None,
           kwargs: Optional[dict] = None, user_packages: tuple[str, ...] = ()) -> Report:
    """Name everything that blocks a full-graph trace or a CUDA-graph capture of ``model(*inputs)``, with fixes.

    Runs the model eagerly a few times (prewarm, a profiled forward) and traces it once with Dynamo (breaks
    allowed, dim 0 dynamic); ``context`` is the forward-context metadata the model needs
    (``piecegraph.forward_context``). On CUDA each piece is then captured alone (see ``doctor.probe``).
    ``fix=True`` applies the known fixes (the FlashInfer adapter for the functions it covers, ``opaque`` with
    the fake inferred by probing for other library functions, ``freeze`` of warm loaders) and traces again; they
    stay applied (``report.applied.undo()`` takes them back).
    ``user_packages`` names top-level packages to treat as the user's own code besides the model's.

    Raises :class:`EagerFailure` when the model fails eagerly on these inputs (nothing to diagnose yet).

    Constraints: resets Dynamo's caches (``torch._dynamo.reset()``); the inputs must be reusable for several
    forwards. Example::

        report = piecegraph.doctor(model, ids, positions, context=meta)
        print(report.ok, [f.fix for f in report.findings])
    """
    start = time.perf_counter()
    kwargs = dict(kwargs or {})
    report = Report(torch=torch.__version__, device=_device(model, inputs, device))
    tops = _user_tops(model, tuple(user_packages))
    _prewarm_or_explain(model, inputs, kwargs, context)
    stage = first = _Stage(model, inputs, kwargs, context, tops)
    if fix and first.findings:
        report.applied = Applied()
        stage = _fix_rounds(first, lambda: _Stage(model, inputs, kwargs, context, tops), report.applied, model)
        report.before = {"graph_breaks": first.graph_breaks, "findings": len(first.findings)}
    report.findings = list(stage.findings)
    report.graph_breaks = stage.graph_breaks
    if stage.result.error is not None:
        report.error = f"{type(stage.result.error).__name__}: {str(stage.result.error).splitlines()[0][:300]}"
    report.pieces = sum(count_pieces(gm) for gm in stage.result.graphs)
    if report.device.startswith("cuda") and torch.cuda.is_available() and stage.result.error is None:
        report.pieces, failures = probe_model(model, inputs, kwargs, context)
        report.findings += [_capture_finding(f) for f in failures]
    report.seconds = time.perf_counter() - start
    log.info("doctor: %d finding(s), %d graph break(s), %.1f s", len(report.findings), report.graph_breaks,
             report.seconds)
    return report


def blocker_lines(findings: list[Finding], limit: int = 3) -> list[str]:
    """One line per root cause, most findings first: package ▸ entry ▸ loader: primitive (category, location);
    fix (its first line, and how many more)."""
    lines = []
    for group in group_findings(findings)[:limit]:
        f = group[0]
        chain = " ▸ ".join(x for x in (f.package, f.entry, f.loader) if x)
        fix = f.fix.splitlines() or [""]
        more = f" (+{len(fix) - 1} more lines)" if len(fix) > 1 else ""
        lines.append(f"{chain}: {f.primitive} ({f.category}, {f.location}); fix: {fix[0]}{more}")
    return lines
