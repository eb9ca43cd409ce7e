"""opaque(): turn any Python callable (a JIT library's loader and kernel together) into one custom-op node.

Dynamo cannot trace what JIT kernel libraries do on their first call (stat a cache directory, run the compiler
through ``subprocess``, take a lock, load a shared library, call through ctypes or tvm-ffi). ``opaque`` registers
the whole public entry as a ``torch.library`` op, so Dynamo records one node and never looks inside; the fake
implementation gives the output shapes while tracing.

Registration goes through ``torch.library.Library(ns, "DEF")`` + ``define`` + ``impl`` + a fake, as serving
engines do: ``torch.library.custom_op`` costs ~2.4x more per call (37.8 vs 15.7 µs measured on an H200), and a
``"FRAGMENT"`` library made ``torch.compile`` fail on torch 2.11 ("'CustomDecompTable' object is not a mapping").
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import re
import types
import typing
from typing import Any, Callable, Iterable, Optional

import torch

from piecegraph.ops.split import split_op

__all__ = ["opaque", "OpaqueError", "DEFAULT_NAMESPACE"]

DEFAULT_NAMESPACE = "piecegraph_opaque"

_MARK = "__piecegraph_opaque__"  # attribute on wrappers: the "ns::name" they call


class OpaqueError(TypeError):
    """A callable cannot be made opaque as asked: its signature, its fake or its name. The message says the fix."""


class _Registry:
    """The op registry (the one module-level mutable global): DEF libraries, ops, and callable -> wrapper.

    Libraries must stay referenced: when a ``Library`` is collected its registrations disappear.
    """

    def __init__(self) -> None:
        self.libs: dict[str, torch.library.Library] = {}
        self.ops: dict[str, Callable] = {}  # "ns::name" -> wrapper
        self.by_fn: dict[Any, Callable] = {}  # original callable -> wrapper

    def library(self, ns: str, explicit: bool) -> tuple[str, torch.library.Library]:
        """The DEF library of ``ns``; a taken default namespace (a reloaded module) moves to ``ns_1``, ``ns_2``..."""
        candidates = [ns] if explicit else [ns] + [f"{ns}_{i}" for i in range(1, 100)]
        for cand in candidates:
            if cand in self.libs:
                return cand, self.libs[cand]
            try:
                lib = torch.library.Library(cand, "DEF")
            except RuntimeError as err:
                if explicit:
                    raise OpaqueError(
                        f"opaque: cannot create a torch.library namespace {cand!r} ({err}). Another library already "
                        f"defines it; pass name='my_namespace::op' with a namespace of your own."
                    ) from err
                continue
            self.libs[cand] = lib
            return cand, lib
        raise OpaqueError(f"opaque: no free namespace derived from {ns!r}")


_REGISTRY = _Registry()


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


def _hints(fn: Callable) -> dict[str, Any]:
    """Resolved type hints (string annotations included); falls back to raw annotations."""
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
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


def infer_schema(fn: Callable, mutates: Iterable[str] = ()) -> tuple[str, list[str], Any, list[int]]:
    """``(schema "(...) -> ...", argument names, return annotation, positions of tensor arguments)`` of ``fn``.

    Defaults are left out of the schema on purpose: the wrapper always passes every argument, so a default
    that has no schema spelling (a dtype, a tuple) is never a problem.
    """
    params, hints = _params(fn), _hints(fn)
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


# ------------------------------------------------------------------------------------------------ registration
def _sanitize(text: str) -> str:
    """A legal op name: letters, digits and underscores, not starting with a digit."""
    text = re.sub(r"[^0-9A-Za-z_]+", "_", text.replace("<locals>", "locals")).strip("_")
    return ("op_" + text) if not text or text[0].isdigit() else text


def _split_name(fn: Callable, name: Optional[str]) -> tuple[str, str, bool]:
    """``(namespace, op name, namespace given explicitly)``; derived from ``fn.__module__ + __qualname__``."""
    if name is not None:
        ns, _, op = name.rpartition("::")
        if _sanitize(op) != op or (ns and _sanitize(ns) != ns):
            raise OpaqueError(f"opaque: name {name!r} must be 'op' or 'namespace::op' of letters, digits, underscores")
        return (ns or DEFAULT_NAMESPACE), op, bool(ns)
    qual = getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", "fn")
    return DEFAULT_NAMESPACE, _sanitize(f"{getattr(fn, '__module__', None) or 'anon'}.{qual}"), False


def _inputs(args: tuple, positions: list[int]) -> list[torch.Tensor]:
    flat = []
    for i in positions:
        a = args[i]
        if isinstance(a, torch.Tensor):
            flat.append(a)
        elif isinstance(a, (list, tuple)):
            flat.extend(t for t in a if isinstance(t, torch.Tensor))
    return flat


def _aliases(t: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    # Fast path (a non-view tensor that no input views), written as plain loops because this runs on every
    # call: storage pointers cost ~0.1 µs each, generator expressions as much again.
    if t._base is None:
        for a in inputs:
            if a is t or a._base is t:
                break
        else:
            return False
    if t.numel() == 0:
        return False
    ptr = t.untyped_storage().data_ptr()
    for a in inputs:
        if a.untyped_storage().data_ptr() == ptr:
            return True
    return False


def _fresh(out: Any, args: tuple, positions: list[int]) -> Any:
    """``out`` with every tensor that shares memory with an input replaced by a copy.

    The schema promises new tensors; an alias of an input (``return out``) would let the compiled graph reuse or
    mutate the input's memory behind its back, so it costs a copy instead of a wrong answer.
    """
    if isinstance(out, torch.Tensor):
        return out.clone() if _aliases(out, _inputs(args, positions)) else out
    if not isinstance(out, (tuple, list)):
        return out
    inputs = _inputs(args, positions)
    fixed = [t.clone() if isinstance(t, torch.Tensor) and _aliases(t, inputs) else t for t in out]
    return type(out)(fixed)


def _make_impl(fn: Callable, ret: Any, positions: list[int]) -> Callable:
    """The kernel registered for the op: ``fn`` itself, made to return None or fresh tensors as the schema says."""
    if ret is None or ret is type(None):
        def impl_none(*args: Any) -> None:
            fn(*args)  # libraries often also return the written buffer; the schema says ()

        return impl_none
    if not positions:
        return fn

    def impl(*args: Any) -> Any:
        return _fresh(fn(*args), args, positions)

    return impl


def _make_wrapper(fn: Callable, op: Any, qualname: str) -> Callable:
    """A drop-in for ``fn``: same parameters and defaults, calling ``op`` with every argument positionally.

    Generated as plain source so that a call costs one Python frame (no ``Signature.bind``) and Dynamo traces it
    as an ordinary function that records one op node.
    """
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    bare = sig.replace(parameters=[p.replace(default=p.empty, annotation=p.empty) for p in params],
                       return_annotation=sig.empty)  # str() gives "(a, b, /, c, *, d)": the same kinds
    call = ", ".join(p.name for p in params)
    src = f"def opaque_wrapper{bare}:\n    return _op({call})\n"
    namespace: dict[str, Any] = {"_op": op}
    exec(compile(src, f"<piecegraph opaque {qualname}>", "exec"), namespace)  # noqa: S102 - names are identifiers
    wrapper = namespace["opaque_wrapper"]
    wrapper.__defaults__ = tuple(p.default for p in params if p.kind != p.KEYWORD_ONLY
                                 and p.default is not p.empty) or None
    wrapper.__kwdefaults__ = {p.name: p.default for p in params if p.kind == p.KEYWORD_ONLY
                              and p.default is not p.empty} or None
    functools.update_wrapper(wrapper, fn)
    setattr(wrapper, _MARK, qualname)
    wrapper.op = op  # the OpOverload, for code that wants torch.ops directly
    return wrapper


def opaque(fn: Optional[Callable] = None, *, fake: Any = None, mutates: Iterable[str] = (),
           name: Optional[str] = None, split: bool = False) -> Callable:
    """Register ``fn`` (a JIT library's public entry: loader and kernel together) as one custom op.

    Returns a drop-in replacement with ``fn``'s signature, defaults and docstring (``functools.wraps``) that calls
    ``torch.ops.<namespace>.<name>``: under ``torch.compile`` the whole call is one graph node and Dynamo never
    looks inside. Usable as ``opaque(fn, ...)`` or as a decorator ``@opaque(fake="like:x")``.

    Constraints (what must be static):
      * every argument has a type hint (or a bool/int/float/str default): Tensor, Optional[Tensor], int, float,
        bool, str, torch.dtype, torch.device, a list of those, or Optional of those. ``*args``/``**kwargs`` and
        objects are refused with the argument named; wrap the callable in a def that takes plain values.
      * the return annotation is ``-> Tensor``, a fixed tuple such as ``-> Tuple[Tensor, Tensor]``,
        ``-> List[Tensor]``, a scalar, or ``-> None`` for an op that only writes into ``mutates`` arguments.
      * returned tensors are new memory. One that shares memory with an input is copied (one copy, correct);
        to write into a caller's buffer, name it in ``mutates`` and return None.
      * it is an inference op: no autograd formula is registered.

    ``fake`` describes the outputs while tracing (it must not touch data):
      * a function with ``fn``'s parameters (called with every argument positionally) returning empty tensors;
      * ``"like:x"`` or ``("like", "x")``: an output shaped, typed and placed like argument ``x``;
      * ``{"shape": ..., "dtype": ..., "device": ...}``: each field a value, ``"like:x"`` or a callable taking
        every argument by keyword, e.g. ``{"shape": lambda x, **_: (x.shape[0], x.shape[1] // 2),
        "dtype": "like:x"}``; dtype and device default to those of the first tensor argument;
      * a list of such specs for a tuple output, e.g. ``["like:q", "like:k"]``;
      * None: allowed only for ``-> None`` ops (the fake does nothing).

    ``mutates`` names the tensor arguments written in place (schema ``Tensor(a!)``). ``name`` is ``"op"`` or
    ``"namespace::op"``; by default it comes from ``fn.__module__`` and ``__qualname__`` in the namespace
    ``piecegraph_opaque``. ``split=True`` also declares the op a split op (the graph is cut there and it runs
    eagerly between captured pieces). Idempotent: the same ``fn`` gives the same wrapper, and a wrapper is
    returned unchanged.

    Example::

        rmsnorm = opaque(mylib.rmsnorm, fake="like:x")      # def rmsnorm(x: Tensor, w: Tensor, eps: float = 1e-6)
    """
    if fn is None:
        return lambda f: opaque(f, fake=fake, mutates=mutates, name=name, split=split)
    if getattr(fn, _MARK, None) is not None:
        return fn
    if fn in _REGISTRY.by_fn:
        return _REGISTRY.by_fn[fn]
    if not callable(fn):
        raise OpaqueError(f"opaque: {fn!r} is not callable")
    wrapper = _register(fn, *infer_schema(fn, mutates), fake, name)
    if split:
        split_op(getattr(wrapper, _MARK))
    _REGISTRY.by_fn[fn] = wrapper
    return wrapper


def _register(fn: Callable, schema: str, names: list[str], ret: Any, positions: list[int], fake: Any,
              name: Optional[str]) -> Callable:
    ns, op_name, explicit = _split_name(fn, name)
    fake_impl = make_fake(fake, names, ret, f"{ns}::{op_name}")  # validate before touching the registry
    ns, lib = _REGISTRY.library(ns, explicit)
    base, n = op_name, 1
    while f"{ns}::{op_name}" in _REGISTRY.ops or hasattr(getattr(torch.ops, ns), op_name):
        if name is not None and explicit:
            raise OpaqueError(f"opaque: op {ns}::{op_name} is already defined; choose another name")
        n += 1
        op_name = f"{base}_{n}"  # two callables with one qualname (e.g. closures from one factory)
    qualname = f"{ns}::{op_name}"
    lib.define(op_name + schema)
    lib.impl(op_name, _make_impl(fn, ret, positions), "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake_impl, lib=lib)
    op = getattr(getattr(torch.ops, ns), op_name).default
    wrapper = _make_wrapper(fn, op, qualname)
    _REGISTRY.ops[qualname] = wrapper
    return wrapper


def is_opaque(fn: Any) -> bool:
    """Whether ``fn`` is a wrapper returned by :func:`opaque`."""
    return getattr(fn, _MARK, None) is not None
