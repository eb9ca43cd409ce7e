"""Attribute each graph break: package ▸ entry ▸ cached loader ▸ primitive, its category, location and fix.

Definitions:
  * ``package``: top-level package of the innermost frame outside Python's standard library and torch (the
    code that called the primitive), or ``"user"`` for the model's own code (its modules are ``user_tops``)
    and code never imported as a module;
  * ``entry``: the public function the model's code called: the object behind the outermost frame of that
    package, decorators seen through (``flashinfer.bmm_fp8``, never ``flashinfer.utils.wrapper``; see
    :mod:`piecegraph.diagnose.entry`), else that frame's function;
  * ``loader``: the nearest ``functools.cache``/``lru_cache`` function on the stack, warm when its cache holds
    entries (warming up cannot help: Dynamo traces through the cache);
  * ``primitive``: what Dynamo could not trace, read from its reason (``posix.stat``), prefixed by the first
    standard-library function on the stack when there is one (``subprocess.check_output (posix.stat)``);
  * ``location``: file:line of the primitive's caller (the innermost frame of ``package``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from piecegraph.diagnose.entry import Entry, find_entry
from piecegraph.diagnose.index import CodeIndex, Located, is_stdlib, top_level
from piecegraph.diagnose.trace import BreakRecord, Frame

__all__ = ["CATEGORIES", "Finding", "attribute", "categorize", "primitive_of"]

CATEGORIES = ("filesystem", "subprocess", "lock", "file_io", "clock", "ffi_call", "data_dependent",
              "print_logging", "numpy", "unsupported_builtin", "other")


@dataclass
class Finding:
    """One thing that blocks a full-graph trace or a capture; the JSON report's ``findings`` entries."""

    kind: str  # "trace" | "capture"
    category: str
    package: str
    entry: Optional[str]
    loader: Optional[str]
    loader_warm: Optional[bool]
    primitive: str
    location: str
    count: int = 1  # times it runs per forward
    fix: str = ""
    reason: str = ""
    stack: list[str] = field(default_factory=list)
    hard: bool = False
    group: int = 0
    # not in the JSON: what the fixer needs
    entry_ref: Optional[Entry] = field(default=None, repr=False)  # a library entry: the object the model called
    more_entries: list = field(default_factory=list, repr=False)  # entries of other stacks that broke here too
    entry_fn: Optional[Located] = field(default=None, repr=False)  # a user finding: the function holding it
    loader_fn: Optional[object] = field(default=None, repr=False)
    frame: Optional[Frame] = field(default=None, repr=False)  # where the entry is called (or the location)

    def json(self) -> dict:
        keys = ("kind", "category", "package", "entry", "loader", "loader_warm", "primitive", "location", "count",
                "fix", "reason", "stack", "hard", "group")
        return {k: getattr(self, k) for k in keys}


# --------------------------------------------------------------------------------------------- primitive
_PRIMITIVE_PATTERNS = (
    (r"builtin `([\w\.]+?)\.?`", "{0}"),
    (r"method `(\w+)` of class `(\w+)`", "{1}.{0}"),
    (r"builtin operator `(\w+)`", "{0}"),
    (r"numpy function <\w+ (\w+)", "numpy.{0}"),
    (r"(Tensor\.\w+)\(\)", "{0}"),
    (r"Operator `(aten\.[\w\.]+)`", "{0}"),
    (r"enter a `(\w+)` context manager", "{0}.__enter__"),
    (r"Call to `(torch\._dynamo\.graph_break)\(\)`", "{0}"),
    (r"(logging\.Logger) method", "{0}"),
    (r"Data-dependent branching", "bool(tensor)"),
)


def primitive_of(reason: str) -> str:
    """The callable Dynamo stopped at, from its reason text (first line of the reason when none is named)."""
    for pattern, fmt in _PRIMITIVE_PATTERNS:
        m = re.search(pattern, reason)
        if m:
            return fmt.format(*m.groups())
    return reason.strip().split("\n")[0][:120]


# ---------------------------------------------------------------------------------------------- category
_RULES = (  # (category, words in the primitive, reason or standard-library modules on the stack), in order
    ("subprocess", ("subprocess", "_posixsubprocess", "fork_exec", "popen")),
    ("ffi_call", ("ctypes", "_funcptr", "cfuncptr", "tvm_ffi", "pybind", "cdll", "pycsimpletype", "pycfunctiontype",
                  "pycpointertype", "pycstructtype", "pycarraytype")),
    ("data_dependent", ("tensor.item", "_local_scalar_dense", "data-dependent", "data dependent", "dynamic shape",
                        "bool(tensor)", "nonzero", "tensor.tolist")),
    ("numpy", ("numpy",)),
    ("print_logging", ("print", "logging", "warnings.warn", "_warnings")),
    ("file_io", ("open", "_io.", "io.", "tofile", "fromfile", "textiowrapper", "bufferedreader", "bufferedwriter",
                 "fileio")),
    ("lock", ("lock", "_thread", "threading", "semaphore", "condition")),
    ("clock", ("time.", "datetime")),
    ("filesystem", ("posix.", "nt.", "os.", "pathlib", "shutil", "tempfile", "glob", "genericpath")),
)


def _mentions(word: str, texts: list[str]) -> bool:
    if word in ("open", "print"):  # short words: the primitive's own name only, never any text containing them
        return texts[0] == word or texts[0].endswith("." + word)
    return any(word in t for t in texts)


_FROM_REASON = ("data_dependent", "numpy")  # the only rules read from Dynamo's prose (its hints name other things)


def categorize(primitive: str, reason: str, stdlib_modules: list[str], builtin_module: Optional[str]) -> str:
    """One of :data:`CATEGORIES` from the primitive, Dynamo's reason and the standard-library frames on the stack.

    A builtin of a module outside the standard library (a pybind or tvm-ffi extension) is an ``ffi_call``;
    one inside it with no more specific rule (``sys.getsizeof``, ``gc.collect``) is an ``unsupported_builtin``.
    """
    texts = [primitive.lower(), *[m.lower() + "." for m in stdlib_modules]]
    prose = reason.lower().split("\n  hint")[0]
    for category, words in _RULES:
        scope = texts + [prose] if category in _FROM_REASON else texts
        if any(_mentions(w, scope) for w in words):
            return category
    if primitive.endswith(".__call__"):  # Dynamo traces Python __call__s: one it cannot is a C extension's
        return "ffi_call"
    if builtin_module is not None:
        return "unsupported_builtin" if is_stdlib(builtin_module) else "ffi_call"
    return "other"


def _builtin_module(reason: str) -> Optional[str]:
    m = re.search(r"builtin `([\w\.]+?)\.\w+\.?`", reason)
    return m.group(1) if m else None


# ------------------------------------------------------------------------------------------- attribution
@dataclass
class _Frames:
    """A break's stack split into what attribution needs."""

    frames: list[Frame]
    modules: list[Optional[str]]
    packages: list[str]  # "stdlib", "user" or a top-level package name, per frame


def _split(record: BreakRecord, index: CodeIndex, user_tops: set[str]) -> _Frames:
    modules, packages = [], []
    for f in record.stack:
        module = index.module(f.file)
        modules.append(module)
        if is_stdlib(module):
            packages.append("stdlib")
        elif module is None or top_level(module) in user_tops or module == "__main__":
            packages.append("user")
        else:
            packages.append(top_level(module) or "user")
    return _Frames(record.stack, modules, packages)


def _innermost_own(fr: _Frames) -> int:
    """Index of the innermost frame that is not the standard library (the primitive's caller)."""
    for i in range(len(fr.frames) - 1, -1, -1):
        if fr.packages[i] != "stdlib":
            return i
    return len(fr.frames) - 1


def _outermost(fr: _Frames, package: str) -> int:
    """Index of the outermost frame of ``package`` (the entry: where the model's code called into it)."""
    return next(i for i, p in enumerate(fr.packages) if p == package)


def _public_index(fr: _Frames, start: int, at: int) -> int:
    """Without an entry object: the first frame in ``start..at`` whose function is public (a private decorator
    wrapper shared by many functions, FlashInfer 0.7's ``_auto_dump_wrapper``, cannot name the function)."""
    for i in range(start, at + 1):
        if not fr.frames[i].name.startswith("_"):
            return i
    return start


def _loader(fr: _Frames, index: CodeIndex) -> Optional[Located]:
    for f in reversed(fr.frames):
        found = index.function(f.file, f.name, f.line)
        if found is not None and found.cache is not None:
            return found
    return None


def _primitive(record: BreakRecord, fr: _Frames, at: int) -> str:
    inner = primitive_of(record.reason)
    std = [i for i in range(at + 1, len(fr.frames)) if fr.packages[i] == "stdlib"]
    if not std:
        return inner
    outer = f"{fr.modules[std[0]]}.{fr.frames[std[0]].name}"
    return outer if inner == outer else f"{outer} ({inner})"


def _entries(record: BreakRecord, index: CodeIndex, user_tops: set[str], package: str, model: Any) -> list[Entry]:
    """The entries of ``package`` on the record's other stacks (other callers that broke at the same place)."""
    found = []
    for stack in record.others:
        fr = _split(BreakRecord(record.reason, stack), index, user_tops)
        entry = find_entry(fr.frames, fr.packages, package, index, model) if package in fr.packages else None
        if entry is not None and all(e.fn is not entry.fn for e in found):
            found.append(entry)
    return found


def attribute_one(record: BreakRecord, index: CodeIndex, user_tops: set[str], kind: str = "trace",
                  model: Any = None) -> Finding:
    """A :class:`Finding` (without count, fix and group) for one break record; ``model`` resolves ``self.x``
    lookups of the calling line."""
    fr = _split(record, index, user_tops)
    if not fr.frames:
        return Finding(kind, categorize(primitive_of(record.reason), record.reason, [], None), "user", None, None,
                       None, primitive_of(record.reason), "?", reason=record.reason, hard=record.hard)
    at = _innermost_own(fr)
    package = fr.packages[at] if fr.packages[at] != "stdlib" else "user"
    frame = fr.frames[at]
    library = package != "user"
    start = _outermost(fr, package) if library else at
    ref = find_entry(fr.frames, fr.packages, package, index, model) if library else None
    pi = _public_index(fr, start, at) if library else at
    named = index.function(fr.frames[pi].file, fr.frames[pi].name, fr.frames[pi].line)
    loader = _loader(fr, index)
    primitive = _primitive(record, fr, at)
    stdlib_modules = [m or "" for m, p in zip(fr.modules, fr.packages) if p == "stdlib"]
    where = fr.frames[pi]
    entry = ref.alias if ref else named.alias if named else f"{fr.modules[pi] or where.file}.{where.name}"
    more = [e for e in _entries(record, index, user_tops, package, model) if ref is None or e.fn is not ref.fn] \
        if library else []
    return Finding(
        kind=kind,
        category=categorize(primitive, record.reason, stdlib_modules, _builtin_module(record.reason)),
        package=package, entry=entry,
        loader=loader.alias if loader else None,
        loader_warm=(loader.cache.cache_info().currsize > 0) if loader else None,
        primitive=primitive, location=frame.location, reason=record.reason,
        stack=[f"{f.location} in {f.name}" for f in fr.frames], hard=record.hard,
        entry_ref=ref, more_entries=more, entry_fn=None if library else named,
        loader_fn=loader.cache if loader else None,
        frame=fr.frames[start - 1] if library and start > 0 else frame,
    )


def attribute(records: list[BreakRecord], index: CodeIndex, user_tops: set[str], model: Any = None
              ) -> list[Finding]:
    """Findings for ``records``, in the order Dynamo met them."""
    return [attribute_one(r, index, user_tops, model=model) for r in records]
