"""Editing loaded modules, in one place: the functools caches in module globals, and rebinding a global
everywhere it is bound (the defining module and every ``from x import name`` of it).

Used by ``freeze`` (warm caches, rebinding frozen loaders), ``prewarm`` (which caches a run filled), the
FlashInfer adapter and the doctor's fixes (rebinding, with undo) and the doctor's code index.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

LRU = functools._lru_cache_wrapper  # the C type of functools.cache / lru_cache wrappers


def is_functools_cache(value: Any) -> bool:
    """Whether ``value`` is a ``functools.cache`` / ``lru_cache`` wrapper (``type()``: no ``__class__`` hooks run)."""
    return type(value) is LRU


def in_package(name: str, package: str) -> bool:
    """Whether module ``name`` is ``package`` or inside it."""
    return name == package or name.startswith(package + ".")


def module_namespaces() -> Iterator[tuple[str, dict[str, Any]]]:
    """``(module name, its globals)`` of every loaded module that has a dict (a snapshot: safe while importing)."""
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            yield name, namespace


def functools_caches(package: str | None = None) -> list[Callable]:
    """Every functools cache bound in the globals of a loaded module (of ``package`` only, when given), once.

    One pass over module dicts (a few thousand modules, tens of milliseconds): caches reachable only through
    classes or closures are not seen, which is the price of keeping this cheap.
    """
    found: dict[int, Callable] = {}
    for name, namespace in module_namespaces():
        if package is not None and not in_package(name, package):
            continue
        for value in list(namespace.values()):
            if is_functools_cache(value):
                found.setdefault(id(value), value)
    return list(found.values())


Spot = tuple[dict, str, Any, Any]  # (namespace, attribute, old value, new value)
ABSENT = object()  # a spot's old value when the attribute was not in the namespace: undo deletes it


def is_bound_method(fn: Any) -> bool:
    """Whether ``fn`` is a method bound to an instance (not to a module or a class)."""
    owner = getattr(fn, "__self__", None)
    return inspect.ismethod(fn) and not inspect.ismodule(owner) and not inspect.isclass(owner)


def identity(fn: Any) -> Any:
    """What stays the same across lookups of ``fn``: its id, or for a bound method (a new object at every
    attribute access) the ids of its instance and function."""
    return (id(fn.__self__), id(fn.__func__)) if is_bound_method(fn) else id(fn)


def rebind_method(method: Any, new: Any) -> Spot:
    """Shadow the bound ``method`` on its instance with ``new`` (an instance attribute wins over the class's
    function); undone by :func:`undo_spots`, which deletes it again."""
    namespace, attr = vars(method.__self__), method.__name__
    old = namespace.get(attr, ABSENT)
    namespace[attr] = new
    return (namespace, attr, old, new)


def rebind_everywhere(mapping: dict[int, tuple[Any, Any]]) -> list[Spot]:
    """In every loaded module, rebind each global that *is* ``old`` to ``new`` (``mapping[id(old)]``).

    One pass over ``sys.modules`` for the whole mapping. Returns the spots rebound, so a caller can undo exactly
    those (:func:`undo_spots`).
    """
    spots: list[Spot] = []
    for _, namespace in module_namespaces():
        spots += rebind_in(namespace, mapping)
    return spots


def rebind_in(namespace: dict[str, Any], mapping: dict[int, tuple[Any, Any]]) -> list[Spot]:
    """Rebind each name of one ``namespace`` (a module's globals, an object's ``vars``) that *is* an ``old`` of
    ``mapping`` to its ``new``; returns the spots rebound."""
    spots: list[Spot] = []
    for attr, value in list(namespace.items()):
        pair = mapping.get(id(value))
        if pair is not None and pair[0] is value:
            namespace[attr] = pair[1]
            spots.append((namespace, attr, pair[0], pair[1]))
    return spots


def undo_spots(spots: list[Spot]) -> None:
    """Put back the old values of ``spots``, where nobody rebound them since."""
    for namespace, attr, old, new in spots:
        if namespace.get(attr) is new:
            if old is ABSENT:
                del namespace[attr]
            else:
                namespace[attr] = old
