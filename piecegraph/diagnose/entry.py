"""The public function behind a graph break: the object the model's code called, not a decorator's wrapper.

A break's stack runs model code ▸ the library's outermost frame ▸ ... ▸ the primitive. The outermost frame of the
package is often a decorator's closure (FlashInfer's ``backend_requirement`` ``wrapper``, an API logger), one code
object shared by every function it decorates, so its name says nothing. The entry is found as the object that

  1. the calling line looked up (``flashinfer.bmm_fp8(...)``, ``bmm_fp8(...)`` after ``from flashinfer import
     bmm_fp8``, ``self.fn(...)`` on one of the model's modules, ``self.gemm.run(...)`` a method of an object one of
     them holds), resolved in the caller's module globals or on the model's submodules, and whose code is the
     outermost frame's (a ``functools.cache`` object: its wrapped code);
  2. else the one callable in the package's modules whose code is the outermost frame's and, when it is a
     decorator's wrapper, whose ``__wrapped__`` chain holds the code of a deeper frame of the package.

Its name is the one the package exports it under (``flashinfer.bmm_fp8`` rather than ``flashinfer.gemm.bmm_fp8``).
Attribute lookups run ``getattr`` on modules and the model's submodules only; nothing is called.
"""

from __future__ import annotations

import builtins
import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from piecegraph.diagnose.index import CodeIndex
from piecegraph.diagnose.trace import Frame
from piecegraph.ops.modules import identity, in_package, is_bound_method, module_namespaces

__all__ = ["Entry", "find_entry", "public_name", "code_of"]

_CALLED = re.compile(r"([A-Za-z_]\w*(?:\s*\.\s*[A-Za-z_]\w*)*)\s*\(")
_MISSING = object()


@dataclass(frozen=True)
class Entry:
    """The callable the model's code called (decorators included), its public name, and for a method of an object
    (``self.gemm.run``) the expression that names that object's method (``model.get_submodule("mlp").gemm.run``),
    which the ``opaque`` line assigns."""

    fn: Callable
    alias: str
    target: Optional[str] = None


def code_of(fn: Any) -> Any:
    """The code object that runs when ``fn`` is called: a function's, or a ``functools.cache`` object's wrapped
    function's (the C wrapper has no frame); None for other callables."""
    code = getattr(fn, "__code__", None)
    if code is None and type(fn).__name__ == "_lru_cache_wrapper":
        code = getattr(getattr(fn, "__wrapped__", None), "__code__", None)
    return code if inspect.iscode(code) else None


def _same_file(a: str, b: str) -> bool:
    return a == b or os.path.realpath(a) == os.path.realpath(b)


def _runs(code: Any, frame: Frame) -> bool:
    if code is None or code.co_name != frame.name or not _same_file(code.co_filename, frame.file):
        return False
    last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return code.co_firstlineno <= frame.line <= last


def _chain(fn: Any) -> list[Any]:
    """The functions under ``fn`` along ``__wrapped__`` (the decorated ones), outermost first."""
    chain, seen = [], {id(fn)}
    inner = getattr(fn, "__wrapped__", None)
    while inner is not None and id(inner) not in seen:
        chain.append(inner)
        seen.add(id(inner))
        inner = getattr(inner, "__wrapped__", None)
    return chain


def _matches(fn: Any, entry: Frame, inner: list[Frame], named: bool) -> bool:
    """``fn``'s code is the entry frame's; a decorator's wrapper must also lead to a deeper frame of the package,
    unless the model's code named it (``named``): then the lookup itself says which function it was."""
    if not _runs(code_of(fn), entry):
        return False
    chain = [code_of(g) for g in _chain(fn)]
    if named or not any(chain):
        return True
    return any(_runs(code, f) for code in chain for f in inner)


def _method_of(obj: Any, attr: str) -> Any:
    """``obj.attr`` when it is a method of ``obj``'s class (looked up statically first: a property of another object
    could run code) or a callable its instance dict holds; else ``_MISSING``."""
    try:
        static = inspect.getattr_static(obj, attr)
    except AttributeError:
        return _MISSING
    if inspect.isfunction(static) or callable(vars(obj).get(attr) if hasattr(obj, "__dict__") else None):
        return getattr(obj, attr, _MISSING)
    return _MISSING


def _roots(head: str, namespace: dict, model: Any) -> list[tuple[Any, str]]:
    """What the first name of a lookup is, with an expression a user can write for it."""
    if head == "self" and isinstance(model, torch.nn.Module):
        return [(m, f'model.get_submodule("{name}")' if name else "model") for name, m in model.named_modules()]
    if head in namespace:
        return [(namespace[head], f"{namespace.get('__name__', '?')}.{head}")]
    return [(getattr(builtins, head, _MISSING), head)]


def _resolve(dotted: str, namespace: dict, model: Any) -> list[tuple[Any, str]]:
    """``(callable, expression)`` for each object ``dotted`` may name; ``getattr`` runs on modules and the model's
    submodules only, plus one last method lookup on another object (``self.gemm.run``)."""
    parts = [p.strip() for p in dotted.split(".")]
    found = []
    for value, expr in _roots(parts[0], namespace, model):
        for i, attr in enumerate(parts[1:], start=1):
            if value is _MISSING:
                break
            if not (inspect.ismodule(value) or isinstance(value, torch.nn.Module)):
                value = _method_of(value, attr) if i == len(parts) - 1 else _MISSING
            else:
                try:
                    value = getattr(value, attr, _MISSING)
                except Exception:  # noqa: BLE001  (a module __getattr__ that raises)
                    value = _MISSING
            expr = f"{expr}.{attr}"
        if value is not _MISSING and callable(value):
            found.append((value, expr))
    return found


def _looked_up(caller: Frame, index: CodeIndex, model: Any) -> list[tuple[Any, str]]:
    """The callables the caller's source line names, resolved where that code looks them up."""
    module = index.module(caller.file)
    namespace = getattr(sys.modules.get(module or ""), "__dict__", {}) if module else {}
    found = []
    for dotted in _CALLED.findall(caller.code or ""):
        found += _resolve(dotted, namespace, model)
    return found


def _package_callables(package: str) -> Iterable[Any]:
    for name, namespace in module_namespaces():
        if in_package(name, package):
            for value in list(namespace.values()):
                if callable(value) and code_of(value) is not None:
                    yield value


def _unique(values: Iterable[Any]) -> list[Any]:
    return list({identity(v): v for v in values}.values())


def public_name(fn: Any, package: str) -> str:
    """``package.name`` when the package's top module exports ``fn`` under its own name, else the shortest
    ``module.attribute`` of the package that holds it, else its qualified name."""
    name = getattr(fn, "__name__", None)
    top = sys.modules.get(package)
    if name and top is not None and getattr(top, name, None) is fn:
        return f"{package}.{name}"
    spots = [f"{mod}.{attr}" for mod, namespace in module_namespaces() if in_package(mod, package)
             for attr, value in list(namespace.items()) if value is fn]
    if spots:
        return min(spots, key=lambda s: (len(s), s))
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', name or '?')}"


def find_entry(stack: list[Frame], packages: list[str], package: str, index: CodeIndex,
               model: Any = None) -> Optional[Entry]:
    """The :class:`Entry` of ``package`` on ``stack`` (see the module docstring), or None when no single object
    can be named (a closure no module holds, two candidates)."""
    start = next((i for i, p in enumerate(packages) if p == package), None)
    if start is None:
        return None
    entry, inner = stack[start], [f for f, p in zip(stack[start + 1:], packages[start + 1:]) if p == package]
    named = _looked_up(stack[start - 1], index, model) if start > 0 else []
    targets: dict = {}
    for fn, expr in named:  # the first module that holds the object names it
        targets.setdefault(identity(fn), expr)
    found = _unique(fn for fn, _ in named if _matches(fn, entry, inner, named=True))
    if not found:
        found = _unique(fn for fn in _package_callables(package) if _matches(fn, entry, inner, named=False))
    if len(found) != 1:
        return None
    fn = found[0]
    if is_bound_method(fn):  # obj.run(...): named by its class, made permanent on that one object
        return Entry(fn, f"{public_name(type(fn.__self__), package)}.{fn.__name__}", targets.get(identity(fn)))
    return Entry(fn, public_name(fn, package))
