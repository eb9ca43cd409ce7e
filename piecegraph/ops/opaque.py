"""opaque(): turn any Python callable (a JIT library's loader and kernel together) into one custom-op node.

Dynamo cannot trace what JIT kernel libraries do on their first call (stat a cache directory, run the compiler
through ``subprocess``, take a lock, load a shared library, call through ctypes or tvm-ffi). ``opaque`` registers
the whole public entry as a ``torch.library`` op, so Dynamo records one node and never looks inside; the fake
implementation gives the output shapes while tracing.

How each parameter crosses the op boundary (Literal, Enum, tuples, constants, types from the first call) is
:mod:`piecegraph.ops.arguments`; the per-op code that does it, generated once, is :mod:`piecegraph.ops.converters`.

Registration goes through ``torch.library.Library(ns, "DEF")`` + ``define`` + ``impl`` + a fake, as serving
engines do: ``torch.library.custom_op`` costs ~2.4x more per call (37.8 vs 15.7 µs measured on an H200), and a
``"FRAGMENT"`` library made ``torch.compile`` fail on torch 2.11 ("'CustomDecompTable' object is not a mapping").
"""

from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch
from torch._guards import TracingContext

from piecegraph.ops.arguments import (
    Arg,
    OpaqueArgumentError,
    OpaqueError,
    classify,
    hints_of,
    parameters,
    with_first_call,
)
from piecegraph.ops.converters import (
    BY_VALUE,
    DROP,
    PASS,
    changed_constant,
    differs,
    make_adapter,
    make_lazy_wrapper,
    make_wrapper,
)
from piecegraph.ops.signature import make_fake, op_schema, return_type
from piecegraph.ops.split import split_op

__all__ = ["opaque", "is_opaque", "OpaqueError", "OpaqueArgumentError", "DEFAULT_NAMESPACE"]

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


def _make_impl(target: Callable, ret: Any, positions: list[int], fresh: bool) -> Callable:
    """The kernel registered for the op: ``target`` made to return None or fresh tensors as the schema says."""
    if ret is None or ret is type(None):
        def impl_none(*args: Any) -> None:
            target(*args)  # libraries often also return the written buffer; the schema says ()

        return impl_none
    if not positions or fresh:  # nothing to alias, or vouched for
        return target

    def impl(*args: Any) -> Any:
        return _fresh(target(*args), args, positions)

    return impl


@dataclass
class _Op:
    """One opaque op: what ``opaque()`` read from the callable; registration waits for the first call while some
    parameter is a constant or not typed yet (``args`` with ``base`` None)."""

    fn: Callable
    args: list[Arg]
    ret: Any
    fake: Any  # as given (a spec or a function)
    fake_impl: Callable  # from make_fake: spec fakes take every argument positionally
    mutates: tuple
    ns: str
    name: str
    lib: Any
    wrapper: Optional[Callable] = None
    plan: Optional[tuple] = None  # (ns, name, codes): call_planned's recipe, once registered
    first: Optional[tuple] = None  # (typed args, constants, first call's codes)
    fast: Optional[Callable] = None  # the typed wrapper whose code replaces the lazy one's
    lock: Any = field(default_factory=threading.Lock)

    @property
    def qualname(self) -> str:
        return f"{self.ns}::{self.name}"


def _define(op: _Op, args: list[Arg], consts: dict[str, Any]) -> Any:
    """Define, implement and fake ``op`` with fully typed ``args``; returns the OpOverload."""
    schema = op_schema(args, op.mutates, op.ret)
    passed = [a for a in args if not a.const]
    positions = [i for i, a in enumerate(passed) if a.base.startswith("Tensor")]
    fresh = bool(getattr(op.fn, "__piecegraph_fresh_outputs__", False))
    impl = _make_impl(make_adapter(op.fn, args, consts, True, op.qualname), op.ret, positions, fresh)
    spec_fake = op.fake_impl is not op.fake
    fake = make_adapter(op.fake_impl, args, consts, not spec_fake, op.qualname)
    op.lib.define(op.name + schema)
    op.lib.impl(op.name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(op.qualname, fake, lib=op.lib)
    return getattr(getattr(torch.ops, op.ns), op.name).default


def _finish(op: _Op, overload: Any, wrapper: Callable) -> Callable:
    functools.update_wrapper(wrapper, op.fn)
    setattr(wrapper, _MARK, op.qualname)
    wrapper.op = overload  # the OpOverload, for code that wants torch.ops directly (None until the first call)
    return wrapper


# ---------------------------------------------------------------------------------------- the first call
def _type_first_call(op: _Op, codes: tuple, objects: tuple) -> tuple[list[Arg], dict[str, Any]]:
    """``op.args`` typed by the first call's value codes (and the objects themselves, tensors left out)."""
    args, consts, untyped = list(op.args), {}, iter(zip(codes, objects))
    for i, a in enumerate(args):
        if a.base is not None:
            continue
        code, obj = next(untyped)
        if a.const and code.startswith("Tensor"):
            raise OpaqueError(f"opaque: argument {a.name!r} of {op.qualname} has a type hint no op schema can "
                              f"express, so it is bound as a constant, but the first call passed {code}: annotate "
                              f"it as a Tensor type (e.g. Optional[Tensor], List[Tensor])")
        args[i] = a if a.const else with_first_call(a, code, obj)
        if args[i].const:
            consts[a.name] = obj
    return args, consts


def _check_later_call(op: _Op, codes: tuple, objects: tuple) -> None:
    """A compiled call before the first eager one took the typed path: it must match the first call."""
    args, consts, first_codes = op.first
    typed = [a for a, b in zip(args, op.args) if b.base is None]
    for a, code, first_code, obj in zip(typed, codes, first_codes, objects):
        if a.const and obj is not consts[a.name] and differs(obj, consts[a.name]):
            changed_constant(op.qualname, a.name, consts[a.name], a.name not in _lazy_names(op), obj)
        same = code.replace("()", "[]") == first_code.replace("()", "[]")  # a list for a tuple is fine
        if not a.const and not same and not (code == "None" and a.optional):
            raise OpaqueArgumentError(f"{op.qualname}: argument {a.name!r} has no type hint and the first call "
                                      f"typed it {first_code}; this call passes {code}. Annotate it.")


def _lazy_names(op: _Op) -> set[str]:
    return {a.name for a in op.args if a.lazy}


def _first_call(op: _Op, namespace: dict[str, Any], codes: tuple, objects: tuple) -> tuple:
    """Register ``op`` from the first call's values (or check a later call against them); returns the plan.

    Runs for real even when the call is being compiled (Dynamo calls it at trace time with the value codes it
    derived from fake tensors and SymInts, and the objects themselves). The first eager call swaps the typed
    wrapper's code into the lazy one, so later calls cost what a typed op's do; under tracing the swap waits
    (the compiled code guards on the wrapper's code, so swapping there would cost a recompile).
    """
    with op.lock:
        if op.plan is None:
            args, consts = _type_first_call(op, codes, objects)
            overload = _define(op, args, consts)
            hinted = {a.name for a in op.args if a.const}
            op.fast = make_wrapper(op.fn, args, overload, op.qualname, consts, hinted, namespace)
            op.first = (args, consts, codes)
            op.plan = (op.ns, op.name, tuple(DROP if a.const else BY_VALUE if a.enum else PASS for a in args))
            op.wrapper.op = overload
        else:
            _check_later_call(op, codes, objects)
    if op.wrapper.__code__ is not op.fast.__code__ and TracingContext.try_get() is None:
        op.wrapper.__code__ = op.fast.__code__
    return op.plan


def _lazy_wrapper(op: _Op) -> Callable:
    namespace: dict[str, Any] = {}

    def first(codes: tuple, *objects: Any) -> tuple:
        return _first_call(op, namespace, codes, objects)

    first = torch._dynamo.assume_constant_result(first)  # Dynamo runs it for real while tracing
    return make_lazy_wrapper(op.fn, op.args, first, op.qualname, namespace)


# ------------------------------------------------------------------------------------------------ opaque()
def opaque(fn: Optional[Callable] = None, *, fake: Any = None, mutates: Iterable[str] = (),
           name: Optional[str] = None, split: bool = False) -> Callable:
    """Register ``fn`` (a JIT library's public entry: loader and kernel together) as one custom op.

    Returns a drop-in replacement with ``fn``'s signature, defaults and docstring (``functools.wraps``) that calls
    ``torch.ops.<namespace>.<name>``: under ``torch.compile`` the whole call is one graph node and Dynamo never
    looks inside. Usable as ``opaque(fn, ...)`` or as a decorator ``@opaque(fake="like:x")``.

    Parameters (see :mod:`piecegraph.ops.arguments`), each typed by its hint, else its default, else the first call:
      * schema types as they are: Tensor, int, float, bool, str, torch.dtype, torch.device, List / Sequence / Tuple
        of Tensor (``Optional[Tensor]`` items too), of int, float or bool, and Optional of any of these;
      * ``Literal[...]`` of str, int or bool: the value is checked on every call, a bad one refused
        (:class:`OpaqueArgumentError`) naming the allowed values;
      * an ``Enum`` of str or int values: passed as its value, rebuilt before ``fn`` runs;
      * anything else (an object, a callable, an Enum of objects): a constant, left out of the schema and bound to
        the first call's value; another object later (neither ``is`` nor ``==``) is refused, named. A hint that may
        hold tensors the schema cannot say (``Dict[str, Tensor]``, ``Union[Tensor, MyObject]``) is refused at
        once, named;
      * no hint and no telling default, or a ``Union`` of schema types (``Union[Tensor, int]``): typed by the first
        call's value (a ``None`` there binds a constant). The op is then registered at that first call, also when
        it is being compiled (types read from the fake values Dynamo sees); later calls must pass the same types.
        A compiled first call followed by an eager one costs one recompile (the wrapper's code is swapped for the
        typed one at the first eager call); an eager first call costs nothing later.
      ``*args``/``**kwargs`` are refused: wrap the callable in a def that names each argument.

    Constraints (what must be static):
      * the return annotation is ``-> Tensor``, a fixed tuple such as ``-> Tuple[Tensor, Tensor]``,
        ``-> List[Tensor]``, a scalar, or ``-> None`` for an op that only writes into ``mutates`` arguments; without
        one, a fake spec says it (``"like:x"``: a Tensor, a list of n specs: n tensors), or the fake's annotation.
      * returned tensors are new memory. One that shares memory with an input is copied (one copy, correct);
        to write into a caller's buffer, name it in ``mutates`` and return None.
      * it is an inference op: no autograd formula is registered.

    ``fake`` describes the outputs while tracing (it must not touch data):
      * a function with ``fn``'s parameters (called as ``fn`` is: keyword-only ones by keyword, Enum members and
        tuples rebuilt, constants passed) returning empty tensors;
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
        gemm = opaque(flashinfer.bmm_fp8, fake=...)          # backend: Literal["cudnn", "cublas", ...] = "cublas"
    """
    if fn is None:
        return lambda f: opaque(f, fake=fake, mutates=mutates, name=name, split=split)
    if getattr(fn, _MARK, None) is not None:
        return fn
    if fn in _REGISTRY.by_fn:
        return _REGISTRY.by_fn[fn]
    if not callable(fn):
        raise OpaqueError(f"opaque: {fn!r} is not callable")
    op = _prepare(fn, fake, tuple(mutates), name)
    if any(a.base is None for a in op.args):
        op.wrapper = _finish(op, None, _lazy_wrapper(op))
    else:
        overload = _define(op, op.args, {})
        op.wrapper = _finish(op, overload, make_wrapper(fn, op.args, overload, op.qualname))
    _REGISTRY.ops[op.qualname] = op.wrapper
    if split:
        split_op(op.qualname)
    _REGISTRY.by_fn[fn] = op.wrapper
    return op.wrapper


def _prepare(fn: Callable, fake: Any, mutates: tuple, name: Optional[str]) -> _Op:
    """Read ``fn``'s parameters, return type and fake, and pick a free op name; nothing is defined yet."""
    params, hints = parameters(fn), hints_of(fn)
    args = [classify(p, hints) for p in params]
    names = [a.name for a in args]
    for m in mutates:
        if m not in names:
            raise OpaqueError(f"opaque: mutates names {m!r}, which is not an argument of {fn!r} (arguments: {names})")
    ret = return_type(fn, hints, fake)
    ns, op_name, explicit = _split_name(fn, name)
    fake_impl = make_fake(fake, names, ret, f"{ns}::{op_name}")  # validate before touching the registry
    if all(a.base is not None for a in args):
        op_schema(args, mutates, ret)  # a mutated non-tensor or a bad return: refused now, not at the first call
    ns, lib = _REGISTRY.library(ns, explicit)
    base, n = op_name, 1
    while f"{ns}::{op_name}" in _REGISTRY.ops or hasattr(getattr(torch.ops, ns), op_name):
        if name is not None and explicit:
            raise OpaqueError(f"opaque: op {ns}::{op_name} is already defined; choose another name")
        n += 1
        op_name = f"{base}_{n}"  # two callables with one qualname (e.g. closures from one factory)
    return _Op(fn, args, ret, fake, fake_impl, mutates, ns, op_name, lib)


def is_opaque(fn: Any) -> bool:
    """Whether ``fn`` is a wrapper returned by :func:`opaque`."""
    return getattr(fn, _MARK, None) is not None
