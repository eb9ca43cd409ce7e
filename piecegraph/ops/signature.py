"""Schema inference and fake implementations for :func:`piecegraph.opaque` (what a callable's signature says)."""

from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from typing import Any, Callable, Iterable, Optional

import torch


class OpaqueError(TypeError):
    """A callable cannot be made opaque as asked: its signature, its fake or its name. The message says the fix."""


# ----------------------------------------------------------------------------------------------- schema inference
_SCALARS: dict[Any, str] = {
    torch.Tensor: "Tensor", int: "SymInt", float: "float", bool: "bool", str: "str",
    torch.dtype: "ScalarType", torch.device: "Device",
}
_SEQUENCES = (list, tuple, collections.abc.Sequence)  # typing.get_origin maps List/Sequence/Tuple onto these
_HINT = ("supported: Tensor, Optional[Tensor], int, float, bool, str, torch.dtype, torch.device, "
         "list of those, Optional of those")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``Optional[X]`` / ``X | None`` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_str(tp: Any) -> Optional[str]:
    """Schema type of a (non-optional) annotation, or None when it has no schema type."""
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin = typing.get_origin(tp)
    if origin in _SEQUENCES:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if len(set(args)) == 1 and args[0] in _SCALARS and args[0] not in (str, torch.device):
            return _SCALARS[args[0]] + "[]"
    return None


def _arg_schema(name: str, tp: Any, alias: Optional[str]) -> str:
    inner, optional = _unwrap_optional(tp)
    base = _type_str(inner)
    if base is None:
        raise OpaqueError(f"opaque: argument {name!r} has type {tp!r}, which a torch op schema cannot express "
                          f"({_HINT}). Wrap the callable in a function that takes supported types "
                          f"(e.g. pass a tensor instead of an object, an int instead of an enum).")
    if alias is not None:
        if not base.startswith("Tensor"):
            raise OpaqueError(f"opaque: mutates names {name!r}, but it is a {base}, not a Tensor")
        base = base.replace("Tensor", f"Tensor({alias}!)", 1)
    return f"{base}{'?' if optional else ''} {name}"


def _return_schema(tp: Any) -> str:
    if tp is None or tp is type(None):
        return "()"
    origin = typing.get_origin(tp)
    if origin is tuple:
        items = typing.get_args(tp)
        if Ellipsis in items or not items:
            raise OpaqueError("opaque: a tuple return needs a fixed length, e.g. Tuple[Tensor, Tensor]")
        return "(" + ", ".join(_return_schema(i) for i in items) + ")"
    base = _type_str(tp)
    if base is None or base in ("str", "Device"):
        raise OpaqueError(f"opaque: return type {tp!r} is not supported; return Tensor, a fixed tuple of "
                          f"tensors, a list of tensors, int, float, bool or None")
    return base


def hints_of(fn: Callable) -> dict[str, Any]:
    """Resolved type hints (string annotations included); falls back to raw annotations."""
    # A callable object's hints live on its bound __call__ (callable() would only say it has one).
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)  # noqa: B004
    try:
        return typing.get_type_hints(target)
    except Exception:  # unresolvable forward references: use what is there
        return dict(getattr(target, "__annotations__", {}))


def _params(fn: Callable) -> list[inspect.Parameter]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as err:
        raise OpaqueError(f"opaque: cannot read the signature of {fn!r}; wrap it in a def with type hints") from err
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise OpaqueError(f"opaque: argument {p.name!r} is *{p.name} / **{p.name}; a torch op needs a fixed "
                              f"argument list. Wrap the callable in a def that names each argument.")
    return params


def _param_type(p: inspect.Parameter, hints: dict[str, Any]) -> Any:
    tp = hints.get(p.name, inspect.Parameter.empty)
    if tp is inspect.Parameter.empty:
        if p.default is not inspect.Parameter.empty and type(p.default) in (bool, int, float, str):
            return type(p.default)  # eps=1e-6 without a hint is a float
        raise OpaqueError(f"opaque: argument {p.name!r} has no type hint; annotate it ({_HINT})")
    if p.default is None:
        return Optional[tp]  # `out: Tensor = None` (FlashInfer style) is an Optional[Tensor]
    return tp


def schema_type(p: inspect.Parameter, hints: dict[str, Any]) -> Optional[Any]:
    """The type :func:`opaque` would give parameter ``p`` (its hint, else its default's type), or None when a
    torch op schema cannot express it."""
    try:
        tp = _param_type(p, hints)
        _arg_schema(p.name, tp, None)
    except OpaqueError:
        return None
    return tp


def infer_schema(fn: Callable, mutates: Iterable[str] = ()) -> tuple[str, list[str], Any, list[int]]:
    """``(schema "(...) -> ...", argument names, return annotation, positions of tensor arguments)`` of ``fn``.

    Defaults are left out of the schema on purpose: the wrapper always passes every argument, so a default
    that has no schema spelling (a dtype, a tuple) is never a problem.
    """
    params, hints = _params(fn), hints_of(fn)
    mutates = tuple(mutates)
    names = [p.name for p in params]
    for m in mutates:
        if m not in names:
            raise OpaqueError(f"opaque: mutates names {m!r}, which is not an argument of {fn!r} (arguments: {names})")
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    args = [_arg_schema(p.name, _param_type(p, hints), next(letters) if p.name in mutates else None)
            for p in params]
    if "return" not in hints:
        raise OpaqueError(f"opaque: {fn!r} has no return annotation; add `-> Tensor`, `-> Tuple[Tensor, Tensor]` "
                          f"or `-> None` (for an op that only writes into arguments named in mutates)")
    ret = hints["return"]
    tensors = [i for i, a in enumerate(args) if a.startswith("Tensor")]
    return f"({', '.join(args)}) -> {_return_schema(ret)}", names, ret, tensors


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
    if callable(fake) and not isinstance(fake, (str, tuple, list, dict)):
        return fake
    multi = isinstance(fake, list) or (isinstance(fake, tuple) and _like_name(fake) is None)
    makers = [_one_output(s, names) for s in (fake if multi else [fake])]
    arity = len(typing.get_args(ret)) if typing.get_origin(ret) is tuple else 1
    if len(makers) != arity:
        raise OpaqueError(f"opaque: {qualname} returns {arity} output(s) but the fake spec describes {len(makers)}")

    def fake_impl(*args: Any) -> Any:
        bound = dict(zip(names, args))
        outs = [m(bound) for m in makers]
        return tuple(outs) if multi else outs[0]

    return fake_impl
