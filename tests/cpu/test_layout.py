"""The package's layout: every module imports only its own stage or stages below it, and no import cycle exists
(lazy imports inside functions count too; imports under ``if TYPE_CHECKING:`` never run and do not). The stage
order is docs/architecture.md's."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "piecegraph"
# Bottom to top; a module may import its own stage and any stage before it.
STAGES = [
    ("_import_clock", "program", "config", "context"),  # the types and the one config every stage shares
    ("results",),  # the one benchmark result schema, its loader and report: imports nothing else of piecegraph
    ("ops",),  # JIT safety: opaque, freeze, prewarm, split ops, module editing
    ("cache",),  # the artifact cache: key, store (lock, atomic writes), torch's and FlashInfer's caches pointed at it
    ("adapters", "graphs"),  # library adapters (on ops); capture, replay, static context, breakable capture
    ("trace",),  # Dynamo graph -> split -> compiled pieces (a Program)
    ("runner",),  # a Program run per call: stage, bucket, replay, cut
    ("graphed", "dynamo_backend"),  # GraphedModule: build, binding, cached start, auto policy; the Dynamo backend
    ("attention",),  # paged KV cache, per-step metadata, attention backends, the attention split op
    ("models",),  # the reference decoder (config, presets, loader, generation)
    ("hf",),  # Hugging Face decoders through piecegraph's attention (on models and the engine)
    ("parallel",),  # tensor parallel over torch.distributed: apply_tp, the all-reduce ops
    ("cli_common",),  # what the commands share: device, attention, model and output-file checks
    ("diagnose",),  # the doctor
    ("api",),  # piecegraph.compile (engine + the doctor's advice)
    ("__init__",),  # the package's public names
    ("serve",),  # continuous batching: scheduler, pages, per-step dispatch of full/piecewise graphs; serve-bench
    ("server",),  # the OpenAI-compatible HTTP server on the engine; serve-bench --url's client
    ("bench", "cli"),  # benchmark and command line
]
RANK = {name: i for i, names in enumerate(STAGES) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str], type_only_too: bool = False) -> set[str]:
    """Every piecegraph module ``name`` imports, anywhere in the file (functions included; imports under ``if
    TYPE_CHECKING:`` only with ``type_only_too``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                 for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in type_only and not type_only_too:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:  # "pkg.mod.name" -> the module that defines it
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:``: imports for annotations only, never run."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _stage(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


MODULES = _modules()
GRAPH = {name: _imports(name, path, set(MODULES)) for name, path in MODULES.items()}
# For cycles, annotation-only imports count too: a type-level circle is still two modules that need each other.
GRAPH_WITH_TYPES = {name: _imports(name, path, set(MODULES), True) for name, path in MODULES.items()}


def test_every_module_belongs_to_a_stage():
    assert {_stage(m) for m in MODULES} <= set(RANK), {_stage(m) for m in MODULES} - set(RANK)


def test_no_module_imports_a_higher_stage():
    upward = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                    if RANK[_stage(t)] > RANK[_stage(m)])
    assert not upward, upward


def test_no_import_cycle():
    done, path = set(), []

    def visit(node: str) -> None:
        if node in path:
            cycle = path[path.index(node):] + [node]
            # A package's __init__ importing its own modules, which import the package name back, is how Python
            # packages work; any other loop is a cycle.
            if not all(c == cycle[0] or c.startswith(cycle[0] + ".") for c in cycle):
                pytest.fail(" -> ".join(cycle))
            return
        if node in done:
            return
        path.append(node)
        for target in sorted(GRAPH_WITH_TYPES[node]):
            visit(target)
        path.pop()
        done.add(node)

    for module in sorted(GRAPH_WITH_TYPES):
        visit(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_imports(module):
    importlib.import_module(module)
