"""Where code lives: source file -> module, and (file, function name, line) -> the function object and its cache.

Built from ``sys.modules`` once per doctor run (module globals, and the methods of classes a module defines),
so functions reachable only through closures or instances are not found; their frames are still named by file
and line. Everything here is read-only.
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from piecegraph.ops.modules import is_functools_cache

__all__ = ["CodeIndex", "Located"]



@dataclass(frozen=True)
class Located:
    """A function found for a frame: its object, qualified name, public alias, and the cache wrapping it."""

    fn: Callable
    qualname: str  # module.qualname where it is defined
    alias: str  # the shortest importable name (``jitlib.scaled_add`` rather than ``jitlib.kernels.scaled_add``)
    cache: Optional[Callable]  # the functools.cache / lru_cache wrapper whose __wrapped__ this is, if any
    firstline: int
    lastline: int = 0  # the last line its code spans (0: unknown)


def _real(path: str) -> str:
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):
        return path


class CodeIndex:
    """Maps of the loaded modules; see the module docstring. Functions are indexed per module, on first query."""

    def __init__(self) -> None:
        self.module_of_file: dict[str, str] = {}
        for name, module in list(sys.modules.items()):
            path = getattr(module, "__file__", None)
            if isinstance(path, str) and path.endswith(".py"):
                self.module_of_file.setdefault(os.path.abspath(path), name)
        self.functions: dict[tuple[str, str], list[Located]] = {}
        self._scanned: set[str] = set()
        self._by_real: Optional[dict[str, str]] = None

    # ------------------------------------------------------------------------------------------ building
    def _add(self, fn: Callable, cache: Optional[Callable], path: str) -> None:
        code = getattr(fn, "__code__", None)
        if code is None or os.path.abspath(code.co_filename) != path:
            return  # imported from elsewhere: indexed with its own module
        found = self.functions.setdefault((path, code.co_name), [])
        for i, f in enumerate(found):
            if f.fn is fn:
                if cache is not None:  # the cached wrapper was met after the bare function: record the cache
                    found[i] = Located(f.fn, f.qualname, f.alias, cache, f.firstline, f.lastline)
                return
        qual = f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', code.co_name)}"
        found.append(Located(fn, qual, self._alias(fn, qual), cache, code.co_firstlineno, _last_line(code)))

    def _scan(self, mod_name: str, path: str) -> None:
        if mod_name in self._scanned:
            return
        self._scanned.add(mod_name)
        namespace = getattr(sys.modules.get(mod_name), "__dict__", None) or {}
        for value in list(namespace.values()):
            if inspect.isclass(value) and getattr(value, "__module__", None) == mod_name:
                members = [getattr(m, "__func__", m) for m in vars(value).values()]  # static/class methods too
            else:
                members = [value]
            for m in members:
                if is_functools_cache(m) and inspect.isfunction(getattr(m, "__wrapped__", None)):
                    self._add(m.__wrapped__, m, path)
                elif inspect.isfunction(m):
                    self._add(m, None, path)
                    inner = getattr(m, "__wrapped__", None)  # a decorated function: its frames are the inner's
                    if inspect.isfunction(inner):
                        self._add(inner, None, path)

    def add_classes(self, classes: set[type]) -> None:
        """Index the methods of ``classes`` too (the model's own: a class defined inside a function is in no
        module's namespace)."""
        for cls in classes:
            path = getattr(sys.modules.get(getattr(cls, "__module__", "")), "__file__", None)
            if not isinstance(path, str):
                continue
            path = next((p for p, m in self.module_of_file.items() if m == cls.__module__), os.path.abspath(path))
            self._scan(cls.__module__, path)
            for member in vars(cls).values():
                member = getattr(member, "__func__", member)
                if inspect.isfunction(member):
                    self._add(member, None, path)

    @staticmethod
    def _alias(fn: Callable, qual: str) -> str:
        """``top.name`` when the top-level package re-exports the function (the public spelling), else qual."""
        module = getattr(fn, "__module__", None) or ""
        top = sys.modules.get(module.split(".")[0])
        name = getattr(fn, "__name__", "")
        if top is not None and module != top.__name__:
            exported = getattr(top, name, None)
            if exported is fn or getattr(exported, "__wrapped__", None) is fn:
                return f"{top.__name__}.{name}"
        return qual

    # ------------------------------------------------------------------------------------------- lookups
    def module(self, file: str) -> Optional[str]:
        """The module name of a source file, or None (``<string>``, a file never imported)."""
        found = self.module_of_file.get(os.path.abspath(file))
        if found is None and os.path.exists(file):  # a symlinked path: compare real paths (slow, so built once)
            if self._by_real is None:
                self._by_real = {_real(p): m for p, m in self.module_of_file.items()}
            found = self._by_real.get(_real(file))
        return found

    def function(self, file: str, name: str, line: int) -> Optional[Located]:
        """The function named ``name`` in ``file`` whose code spans ``line`` (the innermost, when several do), or
        None: a function the index cannot reach (a class defined inside a function) is never confused with
        another of the same name above it."""
        mod_name = self.module(file)
        if mod_name is None:
            return None
        path = next((p for p, m in self.module_of_file.items() if m == mod_name), os.path.abspath(file))
        self._scan(mod_name, path)
        candidates = [f for f in self.functions.get((path, name), [])
                      if f.firstline <= line <= (f.lastline or line)]
        return max(candidates, key=lambda f: f.firstline) if candidates else None


def _last_line(code: Any) -> int:
    return max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)


def top_level(module: Optional[str]) -> Optional[str]:
    return module.split(".")[0] if module else None


def is_stdlib(module: Optional[str]) -> bool:
    """Whether a module belongs to Python itself (``sys.stdlib_module_names``, Python 3.10+)."""
    top = top_level(module)
    return bool(top) and (top in getattr(sys, "stdlib_module_names", ()) or top in ("posix", "nt", "_io"))


def caller_of(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
