"""Fixes: the code to paste for each finding, grouping by root cause, and ``--fix`` (apply, then trace again).

Choice, from what the finding shows (first that applies):
  1. a library finding: for each entry that broke there (:mod:`piecegraph.diagnose.entry`), the FlashInfer
     adapter (``piecegraph.adapters.flashinfer.install()``) when it adapts that function, else the
     ``piecegraph.opaque(entry, fake=...)`` line with the fake inferred by probing the function
     (:mod:`piecegraph.diagnose.autowrap`); one line each;
  2. a warm cached loader: ``piecegraph.freeze(loader)`` (a cold one: prewarm with inputs that reach it first);
  3. a library entry that could not be wrapped: ``piecegraph.opaque(entry, fake=...)``, with the reason;
  4. user code: advice by category (no safe automatic change exists).
Only 1-2 are applied by ``--fix`` (and by ``mode="auto"``); each application can be undone (:meth:`Applied.undo`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from piecegraph.diagnose.attribute import Finding
from piecegraph.diagnose.autowrap import Wrapping, adapter_covers, finding_entries
from piecegraph.ops.auto_opaque import AutoOp, Routes, register, route
from piecegraph.ops.freeze import freeze, frozen_functions, unfreeze

__all__ = ["Applied", "Fix", "choose_fixes", "group_findings", "apply_fixes", "FLASHINFER_FIX"]

log = logging.getLogger("piecegraph.doctor")
FLASHINFER_FIX = "import piecegraph.adapters.flashinfer; piecegraph.adapters.flashinfer.install()"
_USER_ADVICE = {
    "data_dependent": "keep host values out of the forward (compute them before the call, pass them through "
                      "piecegraph.forward_context), or set torch._dynamo.config.capture_scalar_outputs = True",
    "print_logging": "remove the print/logging call from the forward (or guard it with "
                     "`if not torch.compiler.is_compiling():`)",
    "numpy": "use torch ops instead of numpy inside the forward, or compute the value once at init",
    "clock": "time the forward from outside it (torch.cuda.Event or time around the call)",
}


@dataclass
class Fix:
    """What to do about one finding: the code (one line per change), and how ``--fix`` applies it: ``action``
    ``"wrap"`` (the adapter when ``adapter``, and ``ops``, inferred opaque ops) or ``"freeze"``; None: it cannot."""

    code: str
    action: Optional[str] = None
    adapter: bool = False
    ops: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------------- choosing
def _wrap_fix(f: Finding, wrapping: Wrapping) -> Optional[Fix]:
    entries = finding_entries(f)
    names = [e.alias for e in entries] or ([f.entry] if f.entry else [])
    adapter = any(adapter_covers(f.package, n) for n in names)
    ops = [wrapping.ops[e.alias] for e in entries if e.alias in wrapping.ops]
    if not adapter and not ops:
        return None
    lines = ([FLASHINFER_FIX] if adapter else []) + [op.line for op in ops]
    return Fix("\n".join(lines), "wrap", adapter, ops)


def _fix_for(f: Finding, wrapping: Wrapping) -> Fix:
    if f.package != "user":
        fix = _wrap_fix(f, wrapping)
        if fix is not None:
            return fix
    if f.loader is not None and f.loader_warm:
        return Fix(f"piecegraph.freeze({f.loader})", "freeze")
    if f.loader is not None:
        return Fix(f"piecegraph.prewarm(model, *inputs)  # with inputs that reach {f.loader}; then "
                   f"piecegraph.freeze({f.loader})")
    if f.package != "user" and f.entry:
        why = wrapping.refused.get(f.entry)
        note = f"not inferred: {why}" if why else "fake: empty outputs of the right shape"
        return Fix(f"{f.entry} = piecegraph.opaque({f.entry}, fake=...)  # {note}")
    advice = _USER_ADVICE.get(f.category, f"move {f.primitive} out of the forward (do it once, at init), or wrap "
                                         f"the function that calls it in piecegraph.opaque(fn, fake=...)")
    return Fix(f"# {f.location}: {advice}")


def choose_fixes(findings: list[Finding], wrapping: Optional[Wrapping] = None) -> dict[int, Fix]:
    """A :class:`Fix` per finding (by ``id``); the finding's ``fix`` text is set too. ``wrapping``: the fakes
    inferred for the library entries (none: library findings get the adapter, freeze or a hand-written fake)."""
    wrapping = wrapping or Wrapping()
    fixes = {}
    for f in findings:
        fix = _fix_for(f, wrapping) if f.kind == "trace" else Fix(f.fix)
        f.fix = fix.code
        fixes[id(f)] = fix
    return fixes


def group_findings(findings: list[Finding]) -> list[list[Finding]]:
    """Groups of one root cause each (same fix, or same package ▸ entry ▸ loader), most findings first.

    Each group is cleared by one fix, so leading with the largest groups gives the fewest fixes that clear the
    most findings. Sets ``finding.group`` (1-based) and reorders nothing else.
    """
    groups: dict[Any, list[Finding]] = {}
    for f in findings:
        key = f.fix if f.package != "user" else (f.package, f.entry, f.loader, f.fix)
        groups.setdefault(key, []).append(f)
    ordered = sorted(groups.values(), key=lambda g: (-len(g), -sum(f.count for f in g)))
    for n, group in enumerate(ordered, 1):
        for f in group:
            f.group = n
    return ordered


# -------------------------------------------------------------------------------------------------- applying
@dataclass
class Applied:
    """The fixes ``--fix`` applied (code), the opaque ops it wrapped, the names routed to them, and the undo."""

    codes: list[str] = field(default_factory=list)
    ops: list = field(default_factory=list)  # AutoOp
    routes: Routes = field(default_factory=Routes)
    _undo: list[Callable[[], Any]] = field(default_factory=list, repr=False)

    def undo(self) -> None:
        """Restore every original function (routed entries, frozen loaders, the FlashInfer adapter)."""
        self.routes.undo()
        while self._undo:
            self._undo.pop()()


def _apply_wrap(fix: Fix, applied: Applied, model: Any) -> None:
    if fix.adapter:
        from piecegraph.adapters import flashinfer

        flashinfer.install()
        applied._undo.append(flashinfer.uninstall)
    for planned in fix.ops:
        op: AutoOp = register(planned)
        applied.routes.add(route(op, model))
        if all(o is not op for o in applied.ops):
            applied.ops.append(op)


def _apply_one(f: Finding, fix: Fix, applied: Applied, model: Any) -> None:
    if fix.action == "wrap":
        _apply_wrap(fix, applied, model)
    elif fix.action == "freeze":
        already = set(map(id, frozen_functions().values()))
        frozen = freeze(f.loader_fn)
        if id(frozen) not in already:  # a loader the user froze stays frozen after undo()
            applied._undo.append(lambda: unfreeze(frozen))
    applied.codes.extend(line for line in fix.code.splitlines() if line not in applied.codes)


def apply_fixes(findings: list[Finding], fixes: dict[int, Fix], applied: Applied, model: Any = None) -> int:
    """Apply each distinct applicable fix once; returns how many were applied now. ``model``: whose submodules'
    attributes may hold a wrapped function (``self.fn = lib.op``), routed too."""
    done = set(applied.codes)
    count = 0
    for f in findings:
        fix = fixes[id(f)]
        if fix.action is None or all(line in done for line in fix.code.splitlines()):
            continue
        try:
            _apply_one(f, fix, applied, model)
            count += 1
        except Exception as err:  # one fix that does not apply must not stop the others
            log.warning("doctor --fix: could not apply %s: %s", fix.code, err)
        done.update(fix.code.splitlines())
    return count
