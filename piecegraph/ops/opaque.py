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

import functools
import inspect
import re
from typing import Any, Callable, Iterable, Optional

import torch

from piecegraph.ops.signature import OpaqueError, infer_schema, make_fake
from piecegraph.ops.split import split_op

__all__ = ["opaque", "OpaqueError", "DEFAULT_NAMESPACE"]

DEFAULT_NAMESPACE = "piecegraph_opaque"

_MARK = "__piecegraph_opaque__"  # attribute on wrappers: the "ns::name" they call


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
    if not positions or getattr(fn, "__piecegraph_fresh_outputs__", False):  # nothing to alias, or vouched for
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
