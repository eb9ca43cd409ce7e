"""Automatic opaque: a library function that stops Dynamo becomes an opaque op with a fake inferred by probing
(:mod:`piecegraph.ops.probe_fake`), and the model's calls are routed through it. No library file is edited.

1. :func:`record_calls`: the functions are rebound, for one eager forward, to recorders that clone each distinct
   call's arguments *before* it runs (so an in-place write cannot spoil them), then put back;
2. :func:`wrap`: the fake is inferred from those calls and registered with :func:`piecegraph.opaque` (``mutates=``
   the arguments it writes), guarded: a traced call unlike every call probed (another static shape, dtype, a
   ``None`` that was a tensor, another constant, token dimensions of different counts) raises
   :class:`AutoOpaqueUnseen` while tracing, never a wrong shape;
3. :func:`route`: the op's drop-in is bound where the model looks the function up (every module global that holds
   it, the library's attribute included, and attributes of the model's submodules; for a method of an object the
   model holds, ``obj.run(...)``, an attribute of that one instance); every rebound name is
   kept while an owner holds the op (a :class:`Routes`: the module that wrapped it, and any module traced through
   the routes since, :func:`hold_routed`), undone when the last releases it (:meth:`Routes.undo`, a
   GraphedModule's release) or by :func:`unroute_all` (``piecegraph.unfreeze()``).

:func:`opaque_line` writes the ``piecegraph.opaque(...)`` line that makes a wrapped function permanent.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from piecegraph.ops.modules import (
    Spot,
    identity,
    is_bound_method,
    rebind_everywhere,
    rebind_in,
    rebind_method,
    undo_spots,
)
from piecegraph.ops.opaque import OpaqueError, is_opaque, opaque
from piecegraph.ops.probe_calls import Call, ProbeRefused, kind_of, shape_of
from piecegraph.ops.probe_fake import Inferred, infer_fake
from piecegraph.ops.signature import hints_of, op_schema

__all__ = ["AutoOp", "AutoOpaqueUnseen", "Routes", "opaque_line", "record_calls", "infer", "register", "wrap", "route",
           "hold_routed", "unroute_all", "auto_ops"]


class AutoOpaqueUnseen(RuntimeError):
    """A traced call of an automatically wrapped function is unlike every call its fake was inferred from."""


@dataclass
class AutoOp:
    """One wrapped function: its public name, the object, the opaque drop-in, the line that makes it permanent,
    the calls its fake holds for (:class:`~piecegraph.ops.probe_calls.Case`) and the names routed to it now."""

    entry: str
    fn: Callable
    line: str
    fake: str
    mutates: tuple
    cases: list = field(default_factory=list)
    ret: Any = None  # the return type the fake gives (when fn has no annotation)
    wrapper: Optional[Callable] = None  # the opaque drop-in, once registered
    spots: list = field(default_factory=list)
    holders: int = 0  # the Routes that keep the spots bound (see Routes.undo)
    generation: int = 0  # bumped by unroute_all: holds taken before it are void


# The automatic part of the op registry: identity(public function) -> its AutoOp. An op is registered once per function
# (opaque() is idempotent), so later inferences for the same function add cases here instead.
_AUTO: dict[int, AutoOp] = {}


def auto_ops() -> dict[str, AutoOp]:
    """The functions wrapped so far, by public name."""
    return {op.entry: op for op in _AUTO.values()}


def opaque_line(alias: str, fake: str, mutates: tuple) -> str:
    """``alias = piecegraph.opaque(alias, fake=..., mutates=(...))``: run before the model's first call, it makes the
    wrapping permanent (no probing)."""
    extra = f", mutates={tuple(mutates)!r}" if mutates else ""
    return f"{alias} = piecegraph.opaque({alias}, fake={fake}{extra})"


# ------------------------------------------------------------------------------------------------- recording
def _snapshot(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, value in values.items():
        kind = kind_of(value)
        out[name] = value.detach().clone() if kind == "tensor" else \
            type(value)(v.detach().clone() for v in value) if kind == "tensors" else value
    return out


def _key(values: dict[str, Any]) -> tuple:
    """What makes two calls the same for probing: argument shapes, dtypes, layouts and the other values."""
    key = []
    for name, value in values.items():
        kind = kind_of(value)
        if kind == "tensor":
            key.append((name, tuple(value.shape), value.dtype, str(value.device), value.stride()))
        elif kind == "tensors":
            key.append((name, tuple((tuple(v.shape), v.dtype) for v in value)))
        else:
            try:
                hash(value)
                key.append((name, "v", value))
            except TypeError:
                key.append((name, "id", id(value)))
    return tuple(key)


class _Recorder:
    """Stands in for one function during a recorded forward: notes every call's argument shapes, keeps a copy of
    each distinct call's arguments (``keep``), then calls the function itself."""

    def __init__(self, fn: Callable, keep: bool, tokens: int, weights: frozenset = frozenset()):
        self.fn, self.keep, self.tokens, self.weights = fn, keep, tokens, weights
        self.signature = inspect.signature(fn)
        self.shapes: list[dict[str, Any]] = []  # every call, in order
        self.calls: list[tuple[int, Call]] = []  # (index in shapes, call) of each distinct call
        self.seen: set = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
            self.shapes.append({k: shape_of(v) for k, v in values.items()})
            key = _key(values)
            if self.keep and key not in self.seen:
                self.seen.add(key)
                static = frozenset(k for k, v in values.items() if _is_weight(v, self.weights))
                self.calls.append((len(self.shapes) - 1, Call(_snapshot(values), self.tokens, static=static)))
        except (TypeError, ProbeRefused):  # a call it cannot read: let the probing refuse it later
            pass
        return self.fn(*args, **kwargs)


def _weights(model: Any) -> frozenset:
    """Storage addresses of the model's parameters and buffers (an argument in one of them is static)."""
    if not isinstance(model, torch.nn.Module):
        return frozenset()
    tensors = [*model.parameters(), *model.buffers()]
    return frozenset(t.untyped_storage().data_ptr() for t in tensors if t.numel())


def _is_weight(value: Any, weights: frozenset) -> bool:
    kind = kind_of(value)
    items = [value] if kind == "tensor" else list(value) if kind == "tensors" else []
    return bool(items) and all(t.numel() and t.untyped_storage().data_ptr() in weights for t in items)


def _instance_spots(model: Any, mapping: dict[int, tuple[Any, Any]]) -> list[Spot]:
    """Rebind attributes of the model's submodules that hold a mapped object (``self.fn = lib.op``)."""
    spots: list[Spot] = []
    if isinstance(model, torch.nn.Module):
        for module in model.modules():
            spots += rebind_in(vars(module), mapping)
    return spots


def _rebind(mapping: dict[int, tuple[Any, Any]], model: Any) -> list[Spot]:
    methods = [rebind_method(old, new) for old, new in mapping.values() if is_bound_method(old)]
    return rebind_everywhere(mapping) + _instance_spots(model, mapping) + methods


def record_calls(fns: list[Callable], run: Callable[[int], Any], tokens: int, twin_tokens: Optional[int],
                 model: Any = None) -> dict[int, list[Call]]:
    """The distinct calls of each of ``fns`` (by id) in ``run(tokens)``, with their twins' shapes from
    ``run(twin_tokens)`` when that second forward runs and calls them in the same order (else no twins)."""
    first = {id(fn): _Recorder(fn, True, tokens, _weights(model)) for fn in fns}
    spots = _rebind({i: (r.fn, r) for i, r in first.items()}, model)
    try:
        run(tokens)
    finally:
        undo_spots(spots)
    twins = {id(fn): _Recorder(fn, False, twin_tokens or 0) for fn in fns} if twin_tokens else {}
    if twins:
        spots = _rebind({i: (r.fn, r) for i, r in twins.items()}, model)
        try:
            run(twin_tokens)
        except Exception:  # noqa: BLE001  (a forward that needs its own token count: infer without twins)
            twins = {}
        finally:
            undo_spots(spots)
    out = {}
    for i, rec in first.items():
        other = twins.get(i)
        same = other is not None and len(other.shapes) == len(rec.shapes)
        for index, call in rec.calls:
            if same:
                call.twin, call.twin_tokens = other.shapes[index], twin_tokens
        out[i] = [call for _, call in rec.calls]
    return out


# ------------------------------------------------------------------------------------------------- wrapping
def _guarded_fake(op: AutoOp, fn: Callable, ret: Any) -> Callable:
    params = [p.replace(annotation=p.empty) for p in inspect.signature(fn).parameters.values()]
    signature, names = inspect.Signature(params), [p.name for p in params]

    def fake(*args: Any, **kwargs: Any) -> Any:
        values = signature.bind(*args, **kwargs).arguments
        for case in op.cases:
            if case.accepts(values):
                return case.fake(*[values[n] for n in names])
        seen = "; ".join(_describe(c.key) for c in op.cases[:4])
        raise AutoOpaqueUnseen(
            f"{op.entry} was wrapped as an opaque op with a fake inferred from the calls the model made in "
            f"prewarm ({seen}); this traced call ({_describe_values(values)}) is none of them. Run a call like it "
            f"eagerly before compiling, or make the wrapping permanent with a fake written for it:\n    {op.line}")

    fake.__annotations__ = {"return": ret}
    fake.__name__ = fake.__qualname__ = f"{getattr(fn, '__name__', 'fn')}_inferred_fake"
    return fake


def _describe(key: dict) -> str:
    parts = []
    for name, spec in key.items():
        if spec[0] == "T":
            dims = ["n" if d is None else d for d in spec[2]]
            parts.append(f"{name}: {str(spec[1]).replace('torch.', '')}{dims}")
        elif spec[0] == "V" and spec[1] is not None:
            parts.append(f"{name}={spec[1]!r:.30}")
    return ", ".join(parts)


def _describe_values(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {str(v.dtype).replace('torch.', '')}{list(v.shape)}" if isinstance(v, torch.Tensor)
                     else f"{k}={v!r:.30}" for k, v in values.items() if v is not None)


def _check_return(fn: Callable, ret: Any) -> None:
    hint = hints_of(fn).get("return", inspect.Signature.empty)
    if hint is inspect.Signature.empty:
        if ret is None:
            raise ProbeRefused("it returns None and has no return annotation, which opaque() needs (`-> None`)")
        return
    try:
        declared = op_schema([], (), hint)
    except OpaqueError:
        declared = None
    if declared != op_schema([], (), ret):
        raise ProbeRefused(f"its return annotation ({hint!r}) says other outputs than it returns ({ret!r})")


def infer(fn: Callable, alias: str, calls: list[Call], target: Optional[str] = None) -> AutoOp:
    """Infer and check ``fn``'s fake from ``calls``: an :class:`AutoOp` with its line (assigning ``target``, an
    expression that names ``fn``; default ``alias``), not registered yet (see :func:`register`).
    :class:`~piecegraph.ops.probe_calls.ProbeRefused` names the reason when it cannot be done safely."""
    if is_opaque(fn):
        raise ProbeRefused("it is an opaque op already")
    inferred: Inferred = infer_fake(fn, calls)
    _check_return(fn, inferred.ret)
    line = opaque_line(target or alias, inferred.fake.text, inferred.mutates)
    return AutoOp(alias, fn, line, inferred.fake.text, inferred.mutates, list(inferred.cases), ret=inferred.ret)


def register(op: AutoOp) -> AutoOp:
    """Register ``op`` (from :func:`infer`) as a guarded opaque op, once per function: a function wrapped before
    keeps its op and gains ``op``'s cases (another model's calls). Returns the registered op (not routed)."""
    known = _AUTO.get(identity(op.fn))
    if known is not None and identity(known.fn) == identity(op.fn):
        if known.mutates != op.mutates:
            raise ProbeRefused(f"it was wrapped before with mutates={known.mutates}, and these calls write "
                               f"{op.mutates}")
        known.cases.extend(c for c in op.cases if all(c.key != k.key for k in known.cases))
        return known
    try:
        op.wrapper = opaque(op.fn, fake=_guarded_fake(op, op.fn, op.ret), mutates=op.mutates)
    except OpaqueError as err:
        raise ProbeRefused(f"opaque() cannot register it: {err}") from None
    _AUTO[identity(op.fn)] = op
    return op


def wrap(fn: Callable, alias: str, calls: list[Call], target: Optional[str] = None) -> AutoOp:
    """:func:`infer` then :func:`register`."""
    return register(infer(fn, alias, calls, target))


# --------------------------------------------------------------------------------------------------- routing
@dataclass
class Routes:
    """One owner's hold on automatic opaque ops' routes. An op's names stay routed while any owner holds it: a
    module traced through routes another module made (Dynamo saw the drop-in, so nothing was wrapped for it) holds
    them too (:func:`hold_routed`), or releasing the other module would unroute them under it."""

    ops: list = field(default_factory=list)  # (AutoOp, its generation when held), one entry per hold

    def undo(self) -> None:
        """Release the holds; the last holder of an op puts its original functions back where they were routed
        (names rebound since are left). A second call does nothing, nor does a hold :func:`unroute_all` voided
        (a module released after ``unfreeze()`` must not unroute what a newer module routed since)."""
        while self.ops:
            op, generation = self.ops.pop()
            if generation != op.generation:
                continue
            op.holders -= 1
            if op.holders <= 0:
                op.holders = 0
                undo_spots(op.spots)
                op.spots.clear()

    def add(self, other: "Routes") -> None:
        self.ops += other.ops
        other.ops = []


def route(op: AutoOp, model: Any = None) -> Routes:
    """Bind ``op``'s drop-in wherever the model may look its function up (module globals, the library's own
    attributes, the model's submodules' attributes); returns the hold to release."""
    op.spots += _rebind({id(op.fn): (op.fn, op.wrapper)}, model)
    op.holders += 1
    return Routes([(op, op.generation)])


def hold_routed() -> Routes:
    """A hold on every automatic opaque op routed now (what a trace made now may have gone through)."""
    held = [op for op in _AUTO.values() if op.spots]
    for op in held:
        op.holders += 1
    return Routes([(op, op.generation) for op in held])


def unroute_all(package: Optional[str] = None) -> list[str]:
    """Put every automatically wrapped function (of ``package`` only, when given) back everywhere it was routed;
    returns their names."""
    names = []
    for op in _AUTO.values():
        module = getattr(op.fn, "__module__", None) or ""
        if op.spots and (package is None or module == package or module.startswith(package + ".")):
            names.append(op.entry)
            undo_spots(op.spots)
            op.spots.clear()
            op.holders, op.generation = 0, op.generation + 1
    return names
