"""Fixes: the code to paste for each finding, grouping by root cause, and ``--fix`` (apply, then trace again).

Choice, from what the finding shows (first that applies):
  1. a FlashInfer frame: ``piecegraph.adapters.flashinfer.install()`` (opaque ops with checked fakes);
  2. a library entry whose fake can be derived safely: ``piecegraph.opaque(entry, fake="like:arg")``. Safely
     means: the entry was called in the eager forward, has the type hints ``opaque`` needs, and running it
     once more on that call's arguments gives tensors shaped, typed and placed like one tensor argument each;
  3. a warm cached loader: ``piecegraph.freeze(loader)`` (a cold one: prewarm with inputs that reach it first);
  4. a library entry otherwise: ``piecegraph.opaque(entry, fake=...)`` with the fake left to the user;
  5. user code: advice by category (no safe automatic change exists).
Only 1-3 are applied by ``--fix``; each application can be undone (:meth:`Applied.undo`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from piecegraph.diagnose.attribute import Finding
from piecegraph.diagnose.counting import CallCounts, _key_of
from piecegraph.ops.freeze import freeze, frozen_functions, unfreeze
from piecegraph.ops.modules import rebind_everywhere, undo_spots
from piecegraph.ops.opaque import opaque

__all__ = ["Applied", "choose_fixes", "group_findings", "apply_fixes", "derive_fake"]

log = logging.getLogger("piecegraph.doctor")
_FLASHINFER_FIX = "import piecegraph.adapters.flashinfer; piecegraph.adapters.flashinfer.install()"
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
    """What to do about one finding: the code, and how ``--fix`` would apply it (None: it cannot)."""

    code: str
    action: Optional[str] = None  # "flashinfer" | "opaque" | "freeze"
    fake: Optional[str] = None  # the derived "like:arg" for "opaque"


# -------------------------------------------------------------------------------------------- fake derivation
def _tensors(out: Any) -> Optional[list[torch.Tensor]]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple) and out and all(isinstance(t, torch.Tensor) for t in out):
        return list(out)
    return None


def derive_fake(fn: Callable, bound: dict[str, Any]) -> Optional[str]:
    """``"like:<arg>"`` when ``fn(**bound)`` returns one tensor shaped, typed and placed like tensor ``arg``.

    Runs ``fn`` once for real (it was just called with these arguments in the eager forward, so its caches are
    warm). Multiple outputs or an output matching no argument give None: the user must write the fake.
    """
    from piecegraph.ops.signature import OpaqueError, infer_schema

    try:
        infer_schema(fn)
    except OpaqueError:
        return None
    try:
        with torch.no_grad():
            out = fn(**bound)
    except Exception:  # arguments that only made sense once (consumed iterators, ...): no safe fake
        return None
    outs = _tensors(out)
    if outs is None or len(outs) != 1:
        return None
    for name, value in bound.items():
        if isinstance(value, torch.Tensor) and value is not outs[0] and value.shape == outs[0].shape and \
                value.dtype == outs[0].dtype and value.device == outs[0].device:
            return f"like:{name}"
    return None


# ------------------------------------------------------------------------------------------------- choosing
def _fix_for(f: Finding, counts: CallCounts) -> Fix:
    if f.package == "flashinfer":
        return Fix(_FLASHINFER_FIX, "flashinfer")
    if f.package != "user" and f.entry_fn is not None:
        key = _key_of(f)
        bound = counts.first_args.get(key) if key else None
        fake = derive_fake(f.entry_fn.fn, bound) if bound is not None else None
        if fake is not None:
            return Fix(f'{f.entry} = piecegraph.opaque({f.entry}, fake="{fake}")', "opaque", fake)
    if f.loader is not None and f.loader_warm:
        return Fix(f"piecegraph.freeze({f.loader})", "freeze")
    if f.loader is not None:
        return Fix(f"piecegraph.prewarm(model, *inputs)  # with inputs that reach {f.loader}; then "
                   f"piecegraph.freeze({f.loader})")
    if f.package != "user" and f.entry:
        return Fix(f"{f.entry} = piecegraph.opaque({f.entry}, fake=...)  # fake: empty outputs of the right shape")
    advice = _USER_ADVICE.get(f.category, f"move {f.primitive} out of the forward (do it once, at init), or wrap "
                                         f"the function that calls it in piecegraph.opaque(fn, fake=...)")
    return Fix(f"# {f.location}: {advice}")


def choose_fixes(findings: list[Finding], counts: CallCounts) -> dict[int, Fix]:
    """A :class:`Fix` per finding (by ``id``); the finding's ``fix`` text is set too."""
    fixes = {}
    for f in findings:
        fix = _fix_for(f, counts) if f.kind == "trace" else Fix(f.fix)
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
    """The fixes ``--fix`` applied (code lines) and how to take them back."""

    codes: list[str] = field(default_factory=list)
    _undo: list[Callable[[], Any]] = field(default_factory=list, repr=False)

    def undo(self) -> None:
        """Restore every original function (opaque entries, frozen loaders, the FlashInfer adapter)."""
        while self._undo:
            self._undo.pop()()


def _rebind(old: Any, new: Any) -> Callable[[], None]:
    """Bind ``new`` wherever a loaded module's global is ``old``; return the undo for exactly those names.

    Names bound to ``new`` already (a wrapper the user made with ``opaque`` before) are left alone by the undo.
    """
    spots = rebind_everywhere({id(old): (old, new)})
    return lambda: undo_spots(spots)


def _apply_one(f: Finding, fix: Fix, applied: Applied) -> None:
    if fix.action == "flashinfer":
        from piecegraph.adapters import flashinfer

        flashinfer.install()
        applied._undo.append(flashinfer.uninstall)
    elif fix.action == "opaque":
        original = f.entry_fn.fn
        applied._undo.append(_rebind(original, opaque(original, fake=fix.fake)))
    elif fix.action == "freeze":
        already = set(map(id, frozen_functions().values()))
        frozen = freeze(f.loader_fn)
        if id(frozen) not in already:  # a loader the user froze stays frozen after undo()
            applied._undo.append(lambda: unfreeze(frozen))
    applied.codes.append(fix.code)


def apply_fixes(findings: list[Finding], fixes: dict[int, Fix], applied: Applied) -> int:
    """Apply each distinct applicable fix once; returns how many were applied now."""
    done = set(applied.codes)
    count = 0
    for f in findings:
        fix = fixes[id(f)]
        if fix.action is None or fix.code in done:
            continue
        try:
            _apply_one(f, fix, applied)
            count += 1
        except Exception as err:  # one fix that does not apply must not stop the others
            log.warning("doctor --fix: could not apply %s: %s", fix.code, err)
        done.add(fix.code)
    return count
