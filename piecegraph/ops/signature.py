"""Schemas and fake implementations for :func:`piecegraph.opaque` (what a callable's signature says).

How each parameter crosses the op boundary is :mod:`piecegraph.ops.arguments`; this module turns those into the
schema string, reads the return type (its hint, else the fake's), and builds the fake implementation.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable, Iterable, Optional

import torch

from piecegraph.ops.arguments import Arg, OpaqueError, classify, classify_hint, hints_of, parameters

__all__ = ["OpaqueError", "hints_of", "schema_type", "infer_schema", "op_schema", "return_type", "make_fake"]


# ----------------------------------------------------------------------------------------------------- schemas
def _return_schema(tp: Any) -> str:
    if tp is None or tp is type(None):
        return "()"
    origin = typing.get_origin(tp)
    if origin is tuple:
        items = typing.get_args(tp)
        if Ellipsis in items or not items:
            raise OpaqueError("opaque: a tuple return needs a fixed length, e.g. Tuple[Tensor, Tensor]")
        return "(" + ", ".join(_return_schema(i) for i in items) + ")"
    try:
        fields = classify_hint("return", tp) or {}
    except OpaqueError:
        fields = {}
    base = fields.get("base")
    if base is None or fields.get("as_tuple") or set(fields) - {"base", "as_tuple"} or base in ("str", "Device"):
        raise OpaqueError(f"opaque: return type {tp!r} is not supported; return Tensor, a fixed tuple of "
                          f"tensors, a list of tensors, int, float, bool or None")
    return base


def op_schema(args: list[Arg], mutates: Iterable[str], ret: Any) -> str:
    """``"(Tensor x, str backend, ...) -> Tensor"``: every argument but the constants, mutated ones aliased.

    Defaults are left out on purpose: the wrapper always passes every argument, so a default that has no schema
    spelling (a dtype, a tuple) is never a problem.
    """
    mutates = tuple(mutates)
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    for a in args:
        if a.const and a.name in mutates:
            raise OpaqueError(f"opaque: mutates names {a.name!r}, which is bound as a constant, not a Tensor")
    schema = [a.schema(next(letters) if a.name in mutates else None) for a in args if not a.const]
    return f"({', '.join(schema)}) -> {_return_schema(ret)}"


def _is_spec(fake: Any) -> bool:
    """A fake given as a spec (``"like:x"``, a dict, a list of those), not as a function."""
    return fake is not None and (not callable(fake) or isinstance(fake, (str, tuple, list, dict)))


def _multi(fake: Any) -> bool:
    """A spec of several outputs: a list, or a tuple that is not ``("like", "x")``."""
    return isinstance(fake, list) or (isinstance(fake, tuple) and _like_name(fake) is None)


def return_type(fn: Callable, hints: dict[str, Any], fake: Any) -> Any:
    """``fn``'s return hint; else the fake function's; else what a fake spec describes (``"like:x"`` or a dict:
    ``Tensor``, a list of n specs: a tuple of n tensors). :class:`OpaqueError` when nothing says it."""
    if "return" in hints:
        return hints["return"]
    if _is_spec(fake):
        return typing.Tuple[(torch.Tensor,) * len(fake)] if _multi(fake) else torch.Tensor
    if fake is not None and "return" in hints_of(fake):
        return hints_of(fake)["return"]
    raise OpaqueError(f"opaque: {fn!r} has no return annotation and no fake spec says its outputs; add `-> Tensor`, "
                      f"`-> Tuple[Tensor, Tensor]` or `-> None` (for an op that only writes into arguments named "
                      f"in mutates), or pass fake='like:<arg>'")


def schema_type(p: inspect.Parameter, hints: dict[str, Any]) -> Optional[Any]:
    """The type :func:`opaque` would give parameter ``p`` (its hint, else its default's type), or None when it
    has none before the first call: a constant (an object, a callable) or a parameter typed by the first call."""
    try:
        arg = classify(p, hints)
    except OpaqueError:
        return None
    if arg.base is None:
        return None
    tp = hints.get(p.name, inspect.Parameter.empty)
    if tp is inspect.Parameter.empty:
        tp = type(p.default) if not arg.base.endswith("[]") else \
            (typing.Tuple[type(p.default[0]), ...] if arg.as_tuple else typing.List[type(p.default[0])])
    return Optional[tp] if arg.optional else tp


def infer_schema(fn: Callable, mutates: Iterable[str] = ()) -> tuple[str, list[str], Any, list[int]]:
    """``(schema "(...) -> ...", argument names, return annotation, positions of tensor arguments)`` of ``fn``,
    whose every parameter has a schema type before any call (:class:`OpaqueError` otherwise, also for a constant
    or a parameter typed by the first call, which :func:`opaque` takes but only types at the first call)."""
    params, hints = parameters(fn), hints_of(fn)
    args = [classify(p, hints) for p in params]
    untyped = [a.name for a in args if a.base is None]
    if untyped:
        raise OpaqueError(f"opaque: {fn!r} has arguments typed only by its first call: {untyped}")
    names = [a.name for a in args]
    for m in mutates:
        if m not in names:
            raise OpaqueError(f"opaque: mutates names {m!r}, which is not an argument of {fn!r} (arguments: {names})")
    if "return" not in hints:
        raise OpaqueError(f"opaque: {fn!r} has no return annotation; add `-> Tensor`, `-> Tuple[Tensor, Tensor]` "
                          f"or `-> None` (for an op that only writes into arguments named in mutates)")
    ret = hints["return"]
    tensors = [i for i, a in enumerate(args) if a.base.startswith("Tensor")]
    return op_schema(args, mutates, ret), names, ret, tensors


# ------------------------------------------------------------------------------------------------------ fakes
def _like_name(spec: Any) -> Optional[str]:
    """``"like:x"`` or ``("like", "x")`` -> ``"x"``; anything else -> None."""
    if isinstance(spec, str) and spec.startswith("like:"):
        return spec[5:].strip()
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "like" and isinstance(spec[1], str):
        return spec[1]
    return None


def _resolve(value: Any, bound: dict[str, Any], attr: str) -> Any:
    """A spec field: ``"like:x"`` -> ``x.<attr>``; a callable -> ``value(**bound)``; else the value itself."""
    name = _like_name(value)
    if name is not None:
        return getattr(bound[name], attr)
    return value(**bound) if callable(value) and not isinstance(value, (torch.dtype, torch.device)) else value


def _check_names(spec: Any, names: list[str]) -> None:
    for field in (spec.values() if isinstance(spec, dict) else [spec]):
        name = _like_name(field)
        if name is not None and name not in names:
            raise OpaqueError(f"opaque: fake spec {field!r} names {name!r}, which is not an argument ({names})")


def _one_output(spec: Any, names: list[str]) -> Callable[[dict[str, Any]], torch.Tensor]:
    """A maker of one fake output from one spec (``like`` or a dict with shape/dtype/device)."""
    _check_names(spec, names)
    name = _like_name(spec)
    if name is not None:
        return lambda bound: torch.empty_like(bound[name])
    if not isinstance(spec, dict) or "shape" not in spec:
        raise OpaqueError(f"opaque: bad fake spec {spec!r}; use a function, 'like:arg', ('like', 'arg') or "
                          f"{{'shape': ..., 'dtype': ..., 'device': ...}} (shape required)")
    def make(bound: dict[str, Any]) -> torch.Tensor:
        tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
        default = tensors[0] if tensors else None
        shape = _resolve(spec["shape"], bound, "shape")
        dtype = _resolve(spec.get("dtype"), bound, "dtype") or (default.dtype if default is not None else None)
        device = _resolve(spec.get("device"), bound, "device") or (default.device if default is not None else None)
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    return make


def make_fake(fake: Any, names: list[str], ret: Any, qualname: str) -> Callable:
    """The fake implementation for ``fake`` (see :func:`opaque`), called with every argument positionally."""
    if fake is None:
        if ret is None or ret is type(None):
            return lambda *args: None  # only writes into mutated arguments: nothing to describe
        raise OpaqueError(f"opaque: {qualname} returns {ret!r}, so Dynamo needs a fake that gives the output "
                          f"shapes: pass fake='like:<arg>', fake={{'shape': ..., 'dtype': ...}} or a function with "
                          f"the same signature that returns empty tensors of the right shape")
    if not _is_spec(fake):
        return fake
    multi = _multi(fake)
    makers = [_one_output(s, names) for s in (fake if multi else [fake])]
    arity = len(typing.get_args(ret)) if typing.get_origin(ret) is tuple else 1
    if len(makers) != arity:
        raise OpaqueError(f"opaque: {qualname} returns {arity} output(s) but the fake spec describes {len(makers)}")

    def fake_impl(*args: Any) -> Any:
        bound = dict(zip(names, args))
        outs = [m(bound) for m in makers]
        return tuple(outs) if multi else outs[0]

    return fake_impl
