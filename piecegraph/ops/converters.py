"""The code :func:`piecegraph.opaque` generates once per op, so that a call does only the work its signature needs.

* :func:`make_wrapper`: the drop-in the user calls. It checks ``Literal`` values, passes Enum members by value and
  refuses another object than a bound constant, each a line generated only for the parameters that need it; then
  it calls the op with every schema argument positionally (one frame, no ``Signature.bind``). A function whose
  parameters are all plain schema types gets exactly ``return _pg_op(a, b, c)``.
* :func:`make_lazy_wrapper`: the same drop-in before the first call has typed every parameter. It registers the
  op on that call, through a function Dynamo runs for real at trace time (``assume_constant_result``), then calls
  it through :func:`call_planned`; the first eager call swaps in :func:`make_wrapper`'s code.
* :func:`make_adapter`: the kernel side, between the op and the callable (or its fake): rebuilds Enum members and
  tuples, puts the bound constants back and passes keyword-only parameters by keyword. None needed: the callable
  itself is registered.

Generated names start with ``_pg_``; a parameter named so would shadow them (refused).
"""

from __future__ import annotations

import enum
import functools
import inspect
from typing import AbstractSet, Any, Callable, Optional

import torch

from piecegraph.ops.arguments import Arg, OpaqueArgumentError, OpaqueError, value_codes, value_objects
from piecegraph.program import describe

PASS, DROP, BY_VALUE = 0, 1, 2  # what call_planned does with each argument


def _build(src: str, namespace: dict[str, Any], name: str, qualname: str) -> Callable:
    exec(compile(src, f"<piecegraph opaque {qualname}>", "exec"), namespace)  # noqa: S102 - names are identifiers
    return namespace[name]


def _bare_signature(fn: Callable) -> str:
    """``"(a, b, /, c, *, d)"``: ``fn``'s parameters with their kinds, no defaults or annotations."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if any(p.name.startswith("_pg_") for p in params):
        raise OpaqueError(f"opaque: {fn!r} has a parameter named _pg_*, a prefix opaque() keeps for itself")
    return str(sig.replace(parameters=[p.replace(default=p.empty, annotation=p.empty) for p in params],
                           return_annotation=sig.empty))


def _set_defaults(wrapper: Callable, fn: Callable) -> None:
    params = inspect.signature(fn).parameters.values()
    wrapper.__defaults__ = tuple(p.default for p in params if p.kind != p.KEYWORD_ONLY
                                 and p.default is not p.empty) or None
    wrapper.__kwdefaults__ = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY
                              and p.default is not p.empty} or None


# ----------------------------------------------------------------------------------------------- refusals
def bad_literal(qualname: str, name: str, allowed: tuple, value: Any) -> None:
    """Raise :class:`OpaqueArgumentError`: ``value`` is none of the values of ``name``'s Literal hint."""
    raise OpaqueArgumentError(f"{qualname}: argument {name!r} is {value!r}, not one of the values its Literal hint "
                              f"allows: {', '.join(map(repr, allowed))}")


def changed_constant(qualname: str, name: str, bound: Any, hinted: bool, value: Any) -> None:
    """Raise :class:`OpaqueArgumentError`: ``value`` is not the constant ``name`` was bound to at the first call."""
    why = ("its type has no op schema spelling" if hinted else
           "it has no type hint and the first call passed " + ("None" if bound is None else "an object"))
    raise OpaqueArgumentError(
        f"{qualname}: argument {name!r} was bound as a constant to the value of the first call ({describe(bound)}), "
        f"since {why}, and this call passes another ({describe(value)}), neither `is` nor `==` the first. Pass the "
        f"same object on every call, or make a new opaque op for the other value (opaque() of a def that passes it)"
        + ("; or annotate it (e.g. Optional[Tensor]) to make it an op argument." if not hinted else "."))


def differs(value: Any, bound: Any) -> bool:
    try:
        return bool(value != bound)
    except Exception:  # an == that does not give a bool (arrays): not the same
        return True


# ------------------------------------------------------------------------------------------------- wrappers
def _check_lines(args: list[Arg], namespace: dict[str, Any], qualname: str, consts: dict[str, Any],
                 hinted: AbstractSet[str]) -> list[str]:
    lines = []
    for a in args:
        n = a.name
        if a.allowed is not None:
            namespace[f"_pg_allowed_{n}"] = a.allowed
            namespace[f"_pg_bad_{n}"] = functools.partial(bad_literal, qualname, n, a.allowed)
            lines.append(f"    if {n} not in _pg_allowed_{n}:\n        _pg_bad_{n}({n})")
        if a.enum is not None:
            namespace[f"_pg_enum_{n}"] = a.enum
            lines.append(f"    if isinstance({n}, _pg_enum_{n}):\n        {n} = {n}._value_")  # 0.1 µs less than .value
        if a.const and n in consts:
            namespace[f"_pg_const_{n}"] = consts[n]
            namespace[f"_pg_changed_{n}"] = functools.partial(changed_constant, qualname, n, consts[n], n in hinted)
            lines.append(f"    if {n} is not _pg_const_{n} and _pg_differs({n}, _pg_const_{n}):\n"
                         f"        _pg_changed_{n}({n})")
    return lines


def make_wrapper(fn: Callable, args: list[Arg], op: Any, qualname: str, consts: Optional[dict[str, Any]] = None,
                 hinted: AbstractSet[str] = frozenset(), namespace: Optional[dict[str, Any]] = None) -> Callable:
    """A drop-in for ``fn``: same parameters and defaults; checks, converts, then calls ``op`` positionally with
    the schema arguments (constants left out). ``namespace``: the lazy wrapper's, when replacing its code."""
    namespace = {} if namespace is None else namespace
    namespace.update({"_pg_op": op, "_pg_differs": differs})
    lines = _check_lines(args, namespace, qualname, consts or {}, hinted)
    call = ", ".join(a.name for a in args if not a.const)
    src = f"def opaque_wrapper{_bare_signature(fn)}:\n" + "".join(f"{ln}\n" for ln in lines) + \
        f"    return _pg_op({call})\n"
    wrapper = _build(src, namespace, "opaque_wrapper", qualname)
    _set_defaults(wrapper, fn)
    return wrapper


def call_planned(values: tuple, plan: tuple) -> Any:
    """Call op ``plan = (namespace, name, codes)`` with ``values`` as the codes say (PASS, DROP, BY_VALUE).

    The first call's path (and a compiled first call's traced code): Dynamo unrolls the loop over constant codes.
    """
    ns, name, codes = plan
    passed = []
    for code, value in zip(codes, values):
        if code == PASS:
            passed.append(value)
        elif code == BY_VALUE:
            passed.append(value._value_ if isinstance(value, enum.Enum) else value)
    return getattr(getattr(torch.ops, ns), name).default(*passed)


def make_lazy_wrapper(fn: Callable, args: list[Arg], first: Callable, qualname: str,
                      namespace: dict[str, Any]) -> Callable:
    """The drop-in before the first call typed every parameter: ``first(codes, *objects)`` registers the op (or
    checks a later call against it) and returns the plan :func:`call_planned` follows. ``namespace`` is kept for
    :func:`make_wrapper` to put the typed code in."""
    namespace.update({"_pg_first": first, "_pg_call": call_planned, "_pg_codes": value_codes,
                      "_pg_objects": value_objects})
    lines = _check_lines([a for a in args if a.allowed is not None], namespace, qualname, {}, set())
    every = "".join(f"{a.name}, " for a in args)
    untyped = "".join(f"{a.name}, " for a in args if a.base is None)
    src = (f"def opaque_wrapper{_bare_signature(fn)}:\n" + "".join(f"{ln}\n" for ln in lines) +
           f"    return _pg_call(({every}), _pg_first(_pg_codes(({untyped})), *_pg_objects(({untyped}))))\n")
    wrapper = _build(src, namespace, "opaque_wrapper", qualname)
    _set_defaults(wrapper, fn)
    return wrapper


# ----------------------------------------------------------------------------------------------- kernel side
def make_adapter(target: Callable, args: list[Arg], consts: dict[str, Any], by_keyword: bool,
                 qualname: str) -> Callable:
    """``target`` called with the op's (schema) arguments: Enum members and tuples rebuilt, constants put back,
    keyword-only parameters by keyword when ``by_keyword`` (else all positionally, as spec fakes take them).
    Returns ``target`` itself when nothing needs doing."""
    keyword = by_keyword and any(a.kind == inspect.Parameter.KEYWORD_ONLY for a in args)
    if not keyword and not any(a.rebuilt for a in args):
        return target
    namespace: dict[str, Any] = {"_pg_target": target}
    lines, call = [], []
    for a in args:
        n = a.name
        if a.enum is not None:  # a dict lookup (~0.05 µs) before Enum(value) (~0.5 µs, and its error message)
            namespace[f"_pg_enum_{n}"], namespace[f"_pg_members_{n}"] = a.enum, {m.value: m for m in a.enum}
            conv = f"_pg_members_{n}[{n}] if {n} in _pg_members_{n} else _pg_enum_{n}({n})"
        elif a.as_tuple:
            conv = f"tuple({n})"
        if a.enum is not None or a.as_tuple:
            lines.append(f"    {n} = None if {n} is None else {conv}" if a.optional else f"    {n} = {conv}")
        value = n
        if a.const:
            namespace[f"_pg_const_{n}"] = consts[n]
            value = f"_pg_const_{n}"
        call.append(f"{n}={value}" if by_keyword and a.kind == inspect.Parameter.KEYWORD_ONLY else value)
    params = ", ".join(a.name for a in args if not a.const)
    src = f"def opaque_impl({params}):\n" + "".join(f"{ln}\n" for ln in lines) + \
        f"    return _pg_target({', '.join(call)})\n"
    return _build(src, namespace, "opaque_impl", qualname)
