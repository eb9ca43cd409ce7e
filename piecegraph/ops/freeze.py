"""freeze(): turn a warm ``functools.cache`` loader or capability probe into a lookup Dynamo can trace.

Dynamo ignores ``functools.cache`` and traces the wrapped function, so a loader that stats files, runs the
compiler or takes a lock stops it even after a warm-up. ``freeze`` snapshots the warm cache into a plain dict and
puts a small function that looks arguments up in it wherever the loader was found: its module attribute and
every loaded module that imported it by name. A lookup of constant arguments traces with no graph break.

How the entries are captured: functools caches keep their keys private, but the C ``lru_cache`` wrapper reports
its cache dict to the garbage collector (``gc.get_referents``), together with its keyword marker. Each key is
decoded back into ``(args, kwargs)`` (the single-int/str fast path, the keyword marker and ``typed=True`` type
suffixes included) and the loader is called once more with them: a cache hit, so nothing is rebuilt, and the
result is exactly what later calls would return. ``calls=`` gives the arguments explicitly instead, for
caches this cannot read (a pure-Python ``lru_cache``).

Limits: a reference captured before ``freeze`` (a closure, a default argument, a class attribute, a
``functools.partial``) keeps the original; the snapshot does not see entries added to the original afterwards
except those that go through the frozen function; arguments must be hashable, as for the cache itself.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import torch

from piecegraph.ops.modules import LRU, functools_caches, in_package, rebind_everywhere

__all__ = ["freeze", "freeze_package", "unfreeze", "frozen_functions", "FrozenCacheMiss", "FreezeError"]

log = logging.getLogger(__name__)
_MISSING = object()


class FreezeError(TypeError):
    """``freeze`` was given something it cannot freeze (not a functools cache, not warm, unreadable keys)."""


class FrozenCacheMiss(RuntimeError):
    """A frozen loader was called with arguments it never saw while warm.

    Raised while tracing (where calling the real loader would stop Dynamo), while a CUDA graph is being captured
    (where a JIT build would run, or fail, inside the capture), and in plain eager calls when frozen with
    ``strict=True``. The fix is to run that call before compiling: ``piecegraph.prewarm(model, *inputs)`` with
    inputs that reach it, or a direct call with those arguments before ``freeze``.
    """


class _TracedFrozenCacheMiss(FrozenCacheMiss, AssertionError):
    """The trace-time form. Dynamo passes AssertionError through unwrapped, so callers can catch FrozenCacheMiss."""


@dataclass
class _Frozen:
    """One frozen loader: its original, the replacement, and the snapshot the replacement reads."""

    name: str
    original: Callable
    frozen: Callable = None  # type: ignore[assignment]
    table: dict = field(default_factory=dict)  # by bound key, and by the positional call as made
    strict: bool = False
    limit: Optional[int] = None  # a bounded lru_cache stays bounded: eager misses stop being recorded here
    entries: int = 0  # bound keys in the table (aliases not counted)
    comptime: Optional[Callable] = None  # Dynamo's comptime, imported when freezing (see _comptime)

    def keep(self, key: tuple, args: tuple, kwargs: dict, value: Any) -> None:
        """Record ``value`` under its bound key, and under ``args`` (the fast path) for a call without kwargs."""
        if key not in self.table:
            self.entries += 1
        self.table[key] = value
        if not kwargs:
            self.table[args] = value  # shorter than any bound key, so it never shadows another call


# The registry of frozen loaders, by id of the original and of the frozen function.
_FROZEN: dict[int, _Frozen] = {}


def _qualified(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


# ------------------------------------------------------------------------------------------- reading the cache
def _cache_dict_and_mark(fn: Callable) -> tuple[Optional[dict], Any]:
    """The C wrapper's private cache dict and keyword marker, found among its GC referents."""
    size = fn.cache_info().currsize
    own = getattr(fn, "__dict__", None)
    refs = gc.get_referents(fn)
    dicts = [r for r in refs if type(r) is dict and r is not own and len(r) == size]
    marks = [r for r in refs if type(r) is object]
    return (dicts[0] if len(dicts) == 1 else None), (marks[0] if marks else None)


def _decode(key: Any, mark: Any, typed: bool) -> tuple[tuple, dict]:
    """Invert functools' C ``_make_key``: ``args + (mark, k1, v1, ...) [+ types]`` -> ``(args, kwargs)``."""
    if not isinstance(key, tuple):
        return (key,), {}  # the single int/str argument fast path stores the argument itself
    at = next((i for i, k in enumerate(key) if k is mark), None)
    if at is None:
        return (key[: len(key) // 2] if typed else key), {}
    rest = key[at + 1:]
    n_kw = (len(rest) - at) // 3 if typed else len(rest) // 2
    pairs = rest[: 2 * n_kw]
    return key[:at], dict(zip(pairs[0::2], pairs[1::2]))


def _warm_calls(fn: Callable) -> list[tuple[tuple, dict]]:
    cache, mark = _cache_dict_and_mark(fn)
    if cache is None:
        raise FreezeError(f"freeze: cannot read the cache of {_qualified(fn)} (not CPython's C lru_cache?); "
                          f"pass the warm arguments explicitly: freeze(fn, calls=[(args...), ...])")
    typed = bool(fn.cache_parameters().get("typed", False))
    return [_decode(k, mark, typed) for k in list(cache)]


# ----------------------------------------------------------------------------------------------- the lookup
def _binder(fn: Callable) -> Callable[[tuple, dict], tuple]:
    """A Dynamo-traceable ``(args, kwargs) -> key``: every argument positionally, defaults filled in.

    So ``f(x)``, ``f(x, False)`` and ``f(x, flag=False)`` find one entry. Loaders with ``*args``/``**kwargs``
    keep the call as it was made (keyword arguments sorted).
    """
    try:
        params = list(inspect.signature(getattr(fn, "__wrapped__", fn)).parameters.values())
    except (TypeError, ValueError):
        params = None
    if params is None or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        def raw_key(args: tuple, kwargs: dict) -> tuple:
            return args if not kwargs else args + (_MISSING,) + tuple(sorted(kwargs.items()))

        return raw_key
    names = tuple(p.name for p in params)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    count = len(names)

    def bound_key(args: tuple, kwargs: dict) -> tuple:
        if not kwargs and len(args) == count:
            return args
        return args + tuple(kwargs[n] if n in kwargs else defaults.get(n, _MISSING) for n in names[len(args):])

    return bound_key


def _describe(name: str, args: tuple, kwargs: dict, where: str = "tracing") -> str:
    call = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
    return (f"frozen loader {name}({call}) was never called with these arguments while warm, and calling it now "
            f"would run its loader (file checks, compiler, locks) inside {where}. Run this call before compiling: "
            f"piecegraph.prewarm(model, *example_inputs) with inputs that reach it, or call {name}({call}) once "
            f"before freeze(); or unfreeze({name.rsplit('.', 1)[-1]}).")


def _raise_in_trace(ctx: Any) -> None:
    """comptime callback: runs for real while Dynamo traces the miss branch, with the miss's locals."""
    try:
        name, args, kwargs = (ctx.get_local(n).as_python_constant() for n in ("name", "args", "kwargs"))
        message = _describe(name, args, kwargs)
    except Exception:  # non-constant arguments: still say what happened
        message = _describe(ctx.get_local("name").as_python_constant(), ("<traced values>",), {})
    raise _TracedFrozenCacheMiss(message)


def _miss(record: _Frozen, key: tuple, args: tuple, kwargs: dict) -> Any:
    name = record.name
    if torch.compiler.is_compiling():
        if record.comptime is not None:  # read off the record: Dynamo sees the very comptime function
            record.comptime(_raise_in_trace)
        raise FrozenCacheMiss(f"frozen loader {name} was called while tracing with arguments it never saw warm")
    if _capturing():
        raise FrozenCacheMiss(_describe(name, args, kwargs, "CUDA graph capture"))
    if record.strict:
        raise FrozenCacheMiss(_describe(name, args, kwargs, "an eager call (strict=True)"))
    # Plain eager: the real loader is safe here (FlashInfer's own eager calls go through it), and its result is
    # kept so that a later trace finds it.
    log.info("freeze: %s missed its frozen table in an eager call; ran the real loader", name)
    value = record.original(*args, **kwargs)
    if record.limit is None or record.entries < record.limit:
        record.keep(key, args, kwargs, value)
    return value


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _comptime() -> Optional[Callable]:
    """Dynamo's ``comptime``, which runs a callback while Dynamo traces: how a miss surfaces as FrozenCacheMiss
    rather than a wrapped error. Imported here, when a loader is frozen, not when piecegraph is: importing
    ``torch._dynamo`` costs about 1.5 s, and ``import piecegraph`` must not pay it."""
    try:
        from torch._dynamo.comptime import comptime
    except ImportError:  # pragma: no cover - very old torch
        return None
    return comptime


def _make_frozen(record: _Frozen) -> Callable:
    table, key_of = record.table, _binder(record.original)

    def frozen(*args: Any, **kwargs: Any) -> Any:
        value = _MISSING if kwargs else table.get(args, _MISSING)  # one lookup for a call form seen before
        if value is _MISSING:
            key = key_of(args, kwargs)
            value = table.get(key, _MISSING)
            if value is _MISSING:
                return _miss(record, key, args, kwargs)
        return value

    functools.update_wrapper(frozen, record.original)
    frozen.__wrapped__ = record.original
    frozen.__piecegraph_frozen__ = record
    for attr in ("cache_info", "cache_clear", "cache_parameters"):  # callers that manage the cache keep working
        if hasattr(record.original, attr):
            setattr(frozen, attr, getattr(record.original, attr))
    return frozen


# ---------------------------------------------------------------------------------------------- replacement
def replace_everywhere(mapping: dict[int, tuple[Any, Any]]) -> int:
    """In every loaded module, rebind each global that *is* ``old`` to ``new`` (``mapping[id(old)]``); returns the
    count of rebound names (see :func:`piecegraph.ops.modules.rebind_everywhere`)."""
    return len(rebind_everywhere(mapping))


def _prepare(fn: Callable, calls: Optional[Iterable[Any]], strict: bool) -> _Frozen:
    if not isinstance(fn, LRU) or not hasattr(fn, "cache_info"):
        raise FreezeError(f"freeze: {fn!r} is not a functools.cache / lru_cache function")
    record = _Frozen(name=_qualified(fn), original=fn, strict=strict, comptime=_comptime())
    if calls is None:
        if fn.cache_info().currsize == 0:
            raise FreezeError(f"freeze: {record.name} is not warm (its cache is empty). Call it first, e.g. run "
                              f"piecegraph.prewarm(model, *example_inputs), then freeze it.")
        warm = _warm_calls(fn)
    else:
        warm = [(c[0], c[1]) if isinstance(c, tuple) and len(c) == 2 and isinstance(c[1], dict) else
                (c if isinstance(c, tuple) else (c,), {}) for c in calls]
    key_of = _binder(fn)
    misses = fn.cache_info().misses
    for args, kwargs in warm:
        record.keep(key_of(args, kwargs), args, kwargs, fn(*args, **kwargs))  # a hit: nothing is rebuilt
    if fn.cache_info().misses != misses and calls is None:
        log.warning("freeze: re-reading %s missed its cache; its entries were rebuilt once", record.name)
    maxsize = fn.cache_parameters().get("maxsize")
    record.limit = None if maxsize is None else max(maxsize, record.entries)
    record.frozen = _make_frozen(record)
    return record


def freeze(fn: Callable, *, calls: Optional[Iterable[Any]] = None, strict: bool = False) -> Callable:
    """Replace the warm ``functools.cache``/``lru_cache`` function ``fn`` with a frozen lookup; return it.

    The replacement is bound wherever ``fn`` was found: its module attribute and every loaded module that
    imported it by name. A call with arguments seen while warm returns the cached object (Dynamo traces this as
    a dict lookup: no graph break); one never seen raises :class:`FrozenCacheMiss`, naming the loader and the
    arguments, while tracing or capturing a CUDA graph. In a plain eager call it runs the original and keeps
    the result, because library code calls its loaders eagerly too (``strict=True``: raise there as well).
    ``calls`` lists the warm arguments explicitly (each an args tuple, or ``(args, kwargs)``).
    Idempotent; :func:`unfreeze` restores the original everywhere.

    Example::

        mylib.get_module("rmsnorm")          # warm: builds once
        piecegraph.freeze(mylib.get_module)  # now torch.compile(fullgraph=True) traces through it
    """
    record = getattr(fn, "__piecegraph_frozen__", None) or _FROZEN.get(id(fn))
    if record is not None:
        return record.frozen
    record = _prepare(fn, calls, strict)
    _register([record])
    return record.frozen


def _register(records: list[_Frozen]) -> None:
    for r in records:
        _FROZEN[id(r.original)] = _FROZEN[id(r.frozen)] = r
    replace_everywhere({id(r.original): (r.original, r.frozen) for r in records})


def warm_caches(package: Optional[str] = None) -> list[Callable]:
    """The warm functools caches defined in ``package`` (all loaded modules when None), found in module globals."""
    found = []
    for value in functools_caches(package):
        owner = getattr(value, "__module__", None) or ""
        if id(value) not in _FROZEN and (package is None or in_package(owner, package)) \
                and value.cache_info().currsize > 0:
            found.append(value)
    return found


def freeze_package(package: str, *, strict: bool = False, exclude: Iterable[str] = ()) -> list[str]:
    """Freeze every warm functools cache defined in the imported ``package`` (module globals of its submodules).

    ``exclude`` holds qualified names (``"pkg.mod.fn"``) or prefixes to leave alone. Caches that cannot be read
    are skipped with a warning. Returns the qualified names frozen now (already frozen ones are not repeated).
    """
    if not any(in_package(m, package) for m in sys.modules):
        raise FreezeError(f"freeze_package: {package!r} is not imported; import it and run the model once "
                          f"(piecegraph.prewarm) so that its loaders are warm")
    exclude = tuple(exclude)
    records = []
    for fn in warm_caches(package):
        name = _qualified(fn)
        if any(name == e or name.startswith(e) for e in exclude):
            continue
        try:
            records.append(_prepare(fn, None, strict))
        except Exception as err:  # one odd cache must not stop the others
            log.warning("freeze_package: skipped %s: %s", name, err)
    _register(records)
    return [r.name for r in records]


def unfreeze(target: Union[None, str, Callable] = None) -> list[str]:
    """Restore originals everywhere: all (None), one package (``"name"``) or one function (original or frozen).
    All or a package: the functions automatic opaque routed (:mod:`piecegraph.ops.auto_opaque`) are put back too.

    Returns the qualified names restored.
    """
    routed = []
    if target is None or isinstance(target, str):
        from piecegraph.ops.auto_opaque import unroute_all

        routed = unroute_all(target)
    records = {id(r): r for r in _FROZEN.values()}.values()
    if isinstance(target, str):
        records = [r for r in records if in_package(r.name.rsplit(".", 1)[0], target) or r.name == target]
    elif target is not None:
        rec = getattr(target, "__piecegraph_frozen__", None) or _FROZEN.get(id(target))
        records = [rec] if rec is not None else []
    records = list(records)
    replace_everywhere({id(r.frozen): (r.frozen, r.original) for r in records})
    for r in records:
        _FROZEN.pop(id(r.original), None)
        _FROZEN.pop(id(r.frozen), None)
    return [r.name for r in records] + routed


def frozen_functions() -> dict[str, Callable]:
    """The frozen loaders now in place: qualified name -> frozen function."""
    return {r.name: r.frozen for r in {id(r): r for r in _FROZEN.values()}.values()}
