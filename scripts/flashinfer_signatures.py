"""Which public FlashInfer functions can piecegraph.opaque() give a schema, and why not the rest; writes JSON.

Usage: python scripts/flashinfer_signatures.py [--versions 0.5.3 0.7.4] [--wheels DIR] [--before OLD_SIGNATURE_PY]
                                               [--out benchmarks/results/DATE_flashinfer_signatures.json]

Runs on CPU without installing FlashInfer: each version's wheel is fetched with ``pip download --no-deps`` (or
taken from ``--wheels``), unpacked to a temporary folder and imported there in a child process, with every
third-party module it cannot find (tvm_ffi, cuda-python, cutlass, ...) replaced by a permissive stub; signatures
and type hints are then the real ones (a hint naming a stubbed type is flagged ``stub_hints``). Each public function
(``dir(flashinfer)``: what its ``__init__`` imports, lazy exports included) and each public method of its public
classes is classified by piecegraph's own rules (:mod:`piecegraph.ops.arguments`) without registering anything:
``typed`` (a schema at ``opaque()`` time), ``at_first_call`` (a constant or a parameter typed by the first call:
the schema is made then), or ``refused`` with the reasons. ``--before`` names the previous ``signature.py`` (e.g.
``git show HEAD:piecegraph/ops/signature.py > /tmp/old_signature.py``) to count what it accepted.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import re
import subprocess
import sys
import tempfile
import types
import typing
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_PLAIN = re.compile(r"(Tensor|SymInt|float|bool|str|ScalarType|Device)(\[\])?\??")  # a schema type as is
_REAL_DUNDERS = {"__wrapped__", "__signature__", "__text_signature__", "__origin__", "__args__", "__parameters__",
                 "__mro_entries__", "__set_name__", "__get__", "__set__", "__delete__", "__path__", "__file__",
                 "__spec__", "__loader__", "__all__", "__annotations__", "__dict__", "__class_getitem__", "__func__",
                 "__self__", "__code__", "__defaults__", "__kwdefaults__", "__globals__", "__closure__",
                 "__isabstractmethod__", "__length_hint__", "__getstate__", "__reduce_ex__", "__copy__",
                 "__deepcopy__", "__fspath__", "__torch_function__", "__dataclass_fields__", "__enter__", "__exit__",
                 "__await__", "__aiter__", "__iter__", "__next__", "__version__"}


# ------------------------------------------------------------------------------------- stubs for missing modules
class _Stub(type):
    """A stand-in for anything a missing module exports: a class (so it can be subclassed and used in hints)
    whose attributes, items, calls and arithmetic give more stubs; called on a function, it returns it (a
    decorator), so the library's own functions survive."""

    def __getattr__(cls, name):
        if name in _REAL_DUNDERS:
            raise AttributeError(name)
        return _stub(f"{cls.__stub__}.{name}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and hasattr(args[0], "__name__"):
            return args[0]
        return _stub(f"{cls.__stub__}()")

    def __getitem__(cls, item):
        return cls

    def __add__(cls, other):
        return cls

    __or__ = __ror__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __and__ = __add__

    def __bool__(cls):
        return False

    def __int__(cls):
        return 0

    __index__ = __len__ = __int__

    def __lt__(cls, other):
        return False

    __gt__ = __le__ = __ge__ = __lt__

    def __eq__(cls, other):
        return cls is other

    def __hash__(cls):
        return id(cls)

    def __float__(cls):
        return 0.0

    def __iter__(cls):
        return iter(())


def _stub(name: str) -> type:
    return _Stub(name.rsplit(".", 1)[-1], (), {"__stub__": name, "__module__": "stub"})


class _StubModule(types.ModuleType):
    __version__ = "0.0.0"

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub(f"{self.__name__}.{name}")


class _MissingModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: a stub for each third-party module that FlashInfer imports and nothing else found
    (never stdlib, never flashinfer's own optional packages, whose absence FlashInfer handles itself)."""

    def __init__(self) -> None:
        self.stubbed: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        root = fullname.split(".")[0]
        if root.startswith("flashinfer") or root in sys.stdlib_module_names or not self._from_flashinfer():
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    @staticmethod
    def _from_flashinfer() -> bool:
        """Whether the import statement is FlashInfer's (others' optional imports keep failing as they expect)."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
            frame = frame.f_back
        return frame is not None and str(frame.f_globals.get("__name__", "")).startswith(("flashinfer", "stub"))

    def create_module(self, spec):
        self.stubbed.add(spec.name.split(".")[0])
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


# --------------------------------------------------------------------------------------------- classification
def _stub_hints(tp) -> list[str]:
    if getattr(tp, "__stub__", None):
        return [tp.__stub__]
    return [s for a in typing.get_args(tp) for s in _stub_hints(a)]


def _label(arg, hinted: bool) -> str:
    if arg.const:
        return "constant"
    if arg.union is not None:
        return f"Union[{', '.join(arg.union)}] (first call)"
    if arg.base is None:
        return "first call"
    label = f"{arg.base}{'?' if arg.optional else ''}"
    if arg.allowed is not None:
        label = f"Literal -> {label}"
    elif arg.enum is not None:
        label = f"Enum {arg.enum.__name__} -> {label}"
    return label + (" (tuple)" if arg.as_tuple else "") + ("" if hinted else " (from default)")


def _return_reason(tp) -> str:
    """Why a return type has no schema, in a few words."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        return "return: optional (X | None)" if type(None) in args and len(args) == 2 else \
            "return: one of several shapes (Union)"
    if origin is tuple and Ellipsis in args:
        return "return: tuple of variable length"
    if origin is tuple and any(type(None) in typing.get_args(a) for a in args):
        return "return: tuple with an optional tensor"
    return "return: an object or a dict"


def _needs(labels: dict[str, str], returns: str) -> list[str]:
    needs = set()
    for label in labels.values():
        for key, feature in (("Literal", "Literal"), ("Enum", "Enum"), ("Tensor[]", "tensor list"),
                             ("Tensor?[]", "tensor list"), ("Union", "Union"), ("constant", "constant"),
                             ("from default", "typed by default")):
            if key in label:
                needs.add(feature)
        if label == "first call":
            needs.add("first-call typing (no hint)")
    if returns == "from the fake spec":
        needs.add("no return hint")
    return sorted(needs)


def classify_function(fn, skip_self: bool = False, before=None) -> dict:
    """``{"status": typed | at_first_call | refused, "params": {name: label}, "returns", "reasons", ...}``."""
    from piecegraph.ops.arguments import OpaqueError, classify, hints_of, parameters
    from piecegraph.ops.signature import _return_schema

    result: dict = {"status": "refused", "params": {}, "reasons": [], "needs": []}  # params: the not plain ones
    try:
        params = parameters(fn)[1 if skip_self else 0:]
        hints = hints_of(fn)
    except (OpaqueError, TypeError, ValueError) as err:
        result["reasons"].append(("*args/**kwargs" if "*" in str(err) else "unreadable signature", str(err)[:300]))
        return result
    lazy = False
    for p in params:
        try:
            arg = classify(p, hints)
        except OpaqueError as err:
            kind = "Literal of mixed types" if "one type" in str(err) else "holds tensors the schema cannot say"
            result["reasons"].append((kind, f"{p.name}: {hints.get(p.name)!r}"[:300]))
            continue
        lazy = lazy or arg.base is None
        result["params"][p.name] = _label(arg, p.name in hints)
    if "return" in hints:
        try:
            result["returns"] = _return_schema(hints["return"])
        except OpaqueError:
            result["reasons"].append((_return_reason(hints["return"]), repr(hints["return"])[:300]))
    else:
        result["returns"] = "from the fake spec"
    stubs = sorted({s for tp in hints.values() for s in _stub_hints(tp)})
    if stubs:
        result["stub_hints"] = stubs
    if not result["reasons"]:
        result["status"] = "at_first_call" if lazy else "typed"
    result["needs"] = _needs(result["params"], result.get("returns", ""))
    result["params"] = {n: lab for n, lab in result["params"].items() if not _PLAIN.fullmatch(lab)}  # the telling
    if before is not None and not skip_self:
        try:
            before.infer_schema(fn)
            result["before"] = True
        except Exception:
            result["before"] = False
    return result


def _public(flashinfer) -> tuple[dict, dict, dict]:
    """Public functions, public classes and names that failed to load, of ``flashinfer``."""
    functions, classes, failed = {}, {}, {}
    for name in sorted(dir(flashinfer)):
        if name.startswith("_"):
            continue
        try:
            value = getattr(flashinfer, name)
        except Exception as err:  # a lazy export whose module does not import here
            failed[name] = f"{type(err).__name__}: {err}"[:200]
            continue
        if isinstance(value, types.ModuleType) or getattr(value, "__stub__", None):
            continue
        if inspect.isclass(value):
            classes[name] = value
        elif callable(value):
            functions[name] = value
    return functions, classes, failed


def _methods(classes: dict) -> dict:
    import enum

    methods = {}
    for cname, cls in classes.items():
        if issubclass(cls, (enum.Enum, BaseException)):
            continue
        for name, fn in inspect.getmembers(cls, inspect.isfunction):
            if name.startswith("_") and name != "__call__" or not getattr(fn, "__module__", "").startswith("flash"):
                continue
            static = isinstance(inspect.getattr_static(cls, name, None), staticmethod)
            methods[f"{cname}.{name}"] = (fn, not static)
    return methods


def _summary(entries: dict) -> dict:
    by_status = collections.Counter(e["status"] for e in entries.values())
    reasons = collections.defaultdict(list)
    for name, e in entries.items():
        for kind in sorted({k for k, _ in e["reasons"]}):
            reasons[kind].append(name)
    needs = collections.Counter(n for e in entries.values() if e["status"] != "refused" for n in e["needs"])
    summary = {"total": len(entries), "typed": by_status["typed"], "at_first_call": by_status["at_first_call"],
               "schema": by_status["typed"] + by_status["at_first_call"], "refused": by_status["refused"],
               "refused_by_reason": {k: sorted(v) for k, v in sorted(reasons.items())},
               "schema_needs": dict(sorted(needs.items())),
               "with_stub_hints": sorted(n for n, e in entries.items() if "stub_hints" in e)}
    if any("before" in e for e in entries.values()):
        summary["schema_before"] = sum(bool(e.get("before")) for e in entries.values())
    return summary


def survey(src: str, before_path: str | None) -> dict:
    """Import the unpacked FlashInfer in ``src`` (missing modules stubbed) and classify its public API."""
    sys.path.insert(0, str(ROOT))
    import piecegraph.ops.signature  # noqa: F401 - imported before any stub can stand in for its imports

    before = None
    if before_path:
        spec = importlib.util.spec_from_file_location("piecegraph_signature_before", before_path)
        before = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(before)
    finder = _MissingModules()
    sys.path.insert(0, src)
    sys.meta_path.append(finder)
    import flashinfer

    functions, classes, failed = _public(flashinfer)
    entries = {name: classify_function(fn, before=before) for name, fn in functions.items()}
    methods = {name: classify_function(fn, skip_self=bound) for name, (fn, bound) in _methods(classes).items()}
    return {"version": flashinfer.__version__, "stubbed_modules": sorted(finder.stubbed),
            "summary": _summary(entries), "methods_summary": _summary(methods), "failed_to_load": failed,
            "classes": sorted(classes), "functions": entries, "methods": methods}


# ------------------------------------------------------------------------------------------------------- main
def _wheel(version: str, wheels: Path) -> Path:
    found = sorted(wheels.glob(f"flashinfer_python-{version}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", f"flashinfer-python=={version}", "--no-deps",
                        "-q", "-d", str(wheels)], check=True)
        found = sorted(wheels.glob(f"flashinfer_python-{version}-*.whl"))
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=["0.5.3", "0.7.4"])
    parser.add_argument("--wheels", type=Path, default=Path(tempfile.gettempdir()) / "flashinfer-wheels")
    parser.add_argument("--before", help="the previous piecegraph/ops/signature.py, to count what it accepted")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" /
                        f"{datetime.date.today()}_flashinfer_signatures.json")
    parser.add_argument("--survey", help=argparse.SUPPRESS)  # child process: an unpacked wheel's folder
    a = parser.parse_args()
    if a.survey:
        print(json.dumps(survey(a.survey, a.before), default=repr))
        return
    import torch

    a.wheels.mkdir(parents=True, exist_ok=True)
    result = {"generated_by": "scripts/flashinfer_signatures.py", "date": str(datetime.date.today()),
              "torch": torch.__version__, "python": sys.version.split()[0],
              "how": "each wheel unpacked and imported on CPU with its missing third-party modules stubbed; every "
                     "public function (dir(flashinfer)) and public method classified by piecegraph.ops.arguments "
                     "without registering: typed = a schema at opaque(), at_first_call = a constant or a parameter "
                     "typed by the first call, refused = reasons; schema_before = accepted by the previous "
                     "signature.py (--before)", "versions": {}}
    for version in a.versions:
        wheel = _wheel(version, a.wheels)
        with tempfile.TemporaryDirectory() as src:
            zipfile.ZipFile(wheel).extractall(src)
            cmd = [sys.executable, __file__, "--survey", src] + (["--before", a.before] if a.before else [])
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT).stdout
        entry = json.loads(out.strip().splitlines()[-1])
        entry["wheel"] = wheel.name
        result["versions"][version] = entry
        s = entry["summary"]
        print(f"{version}: {s['total']} public functions: {s['schema']} get a schema ({s['typed']} at opaque(), "
              f"{s['at_first_call']} at the first call), {s['refused']} refused"
              + (f"; before this change {s['schema_before']}" if "schema_before" in s else ""))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=repr) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
