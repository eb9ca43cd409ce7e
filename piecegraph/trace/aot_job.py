"""One compiled unit's AOTInductor package, in two steps that may run in two processes: :func:`describe_unit`
(in the start that traced: the unit's FX code and its inputs' shapes, no fake values) and :func:`package_unit`
(export, package, check; in that start, or in the background worker of :mod:`piecegraph.trace.aot_worker`).

A traced unit takes the token count as an int input too (Dynamo's SymInt), which ``torch.export`` cannot keep
symbolic: each such input is read as ``sym_size`` of a tensor input holding the same symbol instead, and the
package is called without it. Example inputs are made at the traced token count (:func:`traced_tokens`; random
floats, zero integers; the fakes' strides kept), which is also what the check runs on. A unit holding a split op
(a whole graph) is not run for the check, and is exported from fake examples: its inputs are every weight of the
model, which real examples would hold a second time.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from .aot_load import PackagedUnit, UnitSpec, torch_libraries
from .static import concrete_size, returns_one_value

EXAMPLE_TOKENS = 17  # examples' token count when the trace's is unknown: not 0 or 1 (export would specialise it)
# Namespaces whose ops every torch process has: a unit calling only these needs no module imported to be exported.
TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "_c10d_functional", "c10d_functional", "inductor",
                              "_c10d_functional_autograd", "_quantized", "quantized", "profiler"})
# Ops that talk to other ranks: a unit holding one is not packaged (its check, and the worker, run outside the
# process group: the check would wait for ranks that never come, or fail for want of a group).
COLLECTIVE_NAMESPACES = frozenset({"piecegraph_tp", "_c10d_functional", "c10d_functional",
                                   "_c10d_functional_autograd", "c10d"})


@dataclass
class InputSpec:
    """One tensor input of a unit at the traced token count, and which of its dims follow the token count
    (``dims``: dim -> the token symbol's name, or ``None`` for a size derived from it, such as 2 * tokens)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    dims: dict[int, str | None]


@dataclass
class UnitJob:
    """What packaging a unit needs, picklable: its FX code (int inputs already read as sizes), its tensor inputs,
    the package's :class:`UnitSpec`, whether it is checked against its code run eagerly (not a unit holding a
    split op), and the outputs left uninitialized (buffers a split op fills later) the check skips."""

    graph: torch.fx.GraphModule
    inputs: list[InputSpec]
    spec: UnitSpec
    checked: bool
    skip: set[int] = field(default_factory=set)


def describe_unit(sub: torch.fx.GraphModule, fakes: list[Any], has_split_op: bool, file: str) -> UnitJob:
    """The :class:`UnitJob` of ``sub`` traced with ``fakes`` (``sub`` is not changed). ``ValueError`` for an
    input that is neither a tensor nor a token count, a size that follows another symbol, or a collective op."""
    import sympy  # a start that traced has imported it with Dynamo; `import piecegraph` must not

    collectives = sorted({space for node in sub.graph.nodes if (space := _namespace(node.target))
                          in COLLECTIVE_NAMESPACES})
    if collectives:
        raise ValueError(f"the unit calls collective ops ({', '.join(c + '::*' for c in collectives)}): "
                         "tensor-parallel programs are not packaged")
    single = returns_one_value(sub)
    sub, kept = int_inputs_as_sizes(copy.deepcopy(sub), fakes)
    kept_fakes = [fakes[i] for i in kept]
    device = next(f.device for f in kept_fakes)
    index = (device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else -1
    subs = {s: sympy.Integer(traced_tokens(kept_fakes)) for s in size_symbols(kept_fakes)}
    inputs = [InputSpec(tuple(concrete_size(n, subs) for n in f.shape), tuple(concrete_size(n, subs)
                                                                              for n in f.stride()),
                        f.dtype, f.device, token_dims(f)) for f in kept_fakes]
    # A fresh module: no node metadata (fake values), no Dynamo's module meta; it pickles as code.
    graph = torch.fx.GraphModule(sub, sub.graph, class_name=type(sub).__name__)
    return UnitJob(graph, inputs, UnitSpec(file, tuple(kept), single, index), not has_split_op,
                   uninitialized_outputs(sub))


def package_unit(job: UnitJob, folder: Path, probe: bool = False) -> PackagedUnit:
    """``job``'s unit exported (token count dynamic), packaged into ``folder / job.spec.file`` by AOTInductor
    (:func:`build_package`), loaded, and (``job.checked``) checked against its code run eagerly on the same
    examples (:func:`check_unit`). ``probe``: first loaded in a fresh process (:func:`load_fails_elsewhere`), and
    ``RuntimeError`` if it fails there, so that a loader that crashes takes down that process, not this one.
    Raises what export, AOTInductor or the check raise."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    args = build_package(job, folder)
    if probe and (why := load_fails_elsewhere(folder / job.spec.file, job.spec.device_index,
                                              torch_libraries(), op_modules([job.graph]))):
        raise RuntimeError(f"the package fails torch's loader in a fresh process ({why}), so it is not loaded in "
                           "this one")
    with unset_fake_temporarily(), torch._guards.tracing(None):
        unit = PackagedUnit(folder / job.spec.file, job.spec)
        if job.checked:
            check_unit(unit, job.graph, args, job.skip)
    return unit


def build_package(job: UnitJob, folder: Path) -> list[Any]:
    """``job``'s unit exported (token count dynamic) and packaged into ``folder / job.spec.file``, not loaded;
    returns the examples it was exported with (real tensors for a checked unit, else fakes)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch._guards.tracing(None):  # the start's trace context is not export's
        args = [example_tensor(spec) for spec in job.inputs] if job.checked else fake_examples(job.inputs)
        dims = export_dims(job.inputs)
        varargs = any(p.kind is p.VAR_POSITIONAL
                      for p in inspect.signature(job.graph.forward).parameters.values())
        exported = torch.export.export(job.graph, tuple(args), dynamic_shapes=(dims,) if varargs else dims,
                                       strict=False)
        folder.mkdir(parents=True, exist_ok=True)
        torch._inductor.aoti_compile_and_package(exported, package_path=str(folder / job.spec.file))
    return args


_LOAD_IN_A_CHILD = """
import importlib, json, sys
import torch
from piecegraph.trace.aot_load import import_libraries
import_libraries(json.loads(sys.argv[3]))
for module in json.loads(sys.argv[4]):
    importlib.import_module(module)
torch._C._aoti.AOTIModelPackageLoader(sys.argv[1], "model", True, 1, int(sys.argv[2]))
"""


def load_fails_elsewhere(path: Path, device_index: int, libraries: Iterable[str], modules: Iterable[str]
                         ) -> str | None:
    """Why torch's loader fails on the package at ``path`` in a fresh process that imported torch, then
    ``libraries`` and ``modules`` (as a warm start and the worker have them): ``"ended by SIGSEGV"`` and the like,
    or the error's last line; ``None`` when it loads. Costs a process start (torch's import, seconds)."""
    ran = subprocess.run([sys.executable, "-c", _LOAD_IN_A_CHILD, str(path), str(device_index),
                          json.dumps(list(libraries)), json.dumps(list(modules))],
                         capture_output=True, text=True, env=child_environment(), timeout=600)
    if ran.returncode == 0:
        return None
    if ran.returncode < 0:
        return f"ended by {signal.Signals(-ran.returncode).name}"
    lines = ran.stderr.strip().splitlines()
    return lines[-1][:300] if lines else f"exit code {ran.returncode}"


def child_environment() -> dict[str, str]:
    """This process's environment with its import path (piecegraph and the ops' modules) as ``PYTHONPATH``: what
    a process of piecegraph's own (the worker, a load check) needs to import what this one did."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def op_modules(graphs: Iterable[torch.fx.GraphModule]) -> list[str]:
    """The imported modules that define the custom ops ``graphs`` call (outside torch's own namespaces): what a
    process must import before it can export them. Found by the ``torch.library.Library`` (or ``custom_op``)
    object a module holds at its top level. ``ValueError`` naming the namespace when no importable module does."""
    spaces = sorted({space for gm in graphs for node in gm.graph.nodes
                     if (space := _namespace(node.target)) and space not in TORCH_NAMESPACES})
    modules = []
    # torch's own modules last (a process has them anyway), and quietly: some warn when their attributes are read
    candidates = sorted((name.split(".")[0] == "torch", name) for name, module in list(sys.modules.items())
                        if module is not None and name != "__main__")
    for space in spaces:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = next((name for _, name in candidates if _holds_library(sys.modules[name], space)), None)
        if found is None:
            raise ValueError(f"the ops {space}::* are not defined at the top level of an importable module")
        modules.append(found)
    return modules


def _namespace(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[0]
    return None


def _holds_library(module: Any, namespace: str) -> bool:
    from torch._library.custom_ops import CustomOpDef

    for value in list(getattr(module, "__dict__", {}).values()):
        if isinstance(value, torch.library.Library) and value.ns == namespace:
            return True
        if isinstance(value, CustomOpDef) and value._namespace == namespace:
            return True
    return False


def int_inputs_as_sizes(sub: torch.fx.GraphModule, fakes: list[Any]) -> tuple[torch.fx.GraphModule, list[int]]:
    """``sub`` (changed in place) without its int inputs, each read as ``sym_size`` of the first tensor input
    holding its symbol; and the positions of the inputs kept. ``ValueError`` for an input that is neither a
    tensor nor a token count some tensor input holds."""
    nodes = [n for n in sub.graph.nodes if n.op == "placeholder"]
    first = next(n for n in sub.graph.nodes if n.op != "placeholder")
    kept = []
    for i, (node, fake) in enumerate(zip(nodes, fakes)):
        if isinstance(fake, torch.Tensor):
            kept.append(i)
            continue
        if not isinstance(fake, torch.SymInt):
            raise ValueError(f"input {node.name} is a {type(fake).__name__}, neither a tensor nor the token count")
        source = next(((other, d) for other, t in zip(nodes, fakes) if isinstance(t, torch.Tensor)
                       for d, n in enumerate(t.shape) if isinstance(n, torch.SymInt)
                       and n.node.expr == fake.node.expr), None)
        if source is None:
            raise ValueError(f"input {node.name} is a token count no tensor input holds")
        with sub.graph.inserting_before(first):
            size = sub.graph.call_function(torch.ops.aten.sym_size.int, source)
        node.replace_all_uses_with(size)
        sub.graph.erase_node(node)
    sub.recompile()
    return sub, kept


def traced_tokens(fakes: list[Any]) -> int:
    """The token count the unit was traced with (its first token symbol's hint), or 17 when that is unknown or
    below 2 (export would specialise 0 and 1). Examples at the traced count give Inductor the size hints the
    usual compile had, so both choose the same kernel configurations: on the H200, examples at 17 tokens gave a
    whole 0.5B decode graph whose bf16 tokens drifted from the usual compile's after 5-31 steps."""
    for fake in fakes:
        for n in getattr(fake, "shape", ()):
            if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
                hint = n.node.hint
                return int(hint) if hint is not None and int(hint) >= 2 else EXAMPLE_TOKENS
    return EXAMPLE_TOKENS


def size_symbols(fakes: list[Any]) -> set[Any]:
    """Every symbol in the sizes and strides of ``fakes``: the token symbols (the trace allows no other)."""
    return {symbol for fake in fakes for n in (*fake.shape, *fake.stride()) if isinstance(n, torch.SymInt)
            for symbol in n.node.expr.free_symbols}


def token_dims(fake: torch.Tensor) -> dict[int, str | None]:
    """``fake``'s dims that follow the token count: dim -> the symbol's name, or ``None`` for a derived size."""
    return {d: str(n.node.expr) if n.node.expr.is_Symbol else None
            for d, n in enumerate(fake.shape) if isinstance(n, torch.SymInt)}


def example_tensor(spec: InputSpec) -> torch.Tensor:
    """A real tensor as ``spec`` says (its strides too): random floats, zero integers (always valid indices)."""
    out = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=spec.device)
    return out.normal_() if out.is_floating_point() else out.zero_()


def fake_examples(specs: list[InputSpec]) -> list[torch.Tensor]:
    """Fake tensors as ``specs`` say, of one fresh fake mode: what export needs of a unit it does not run."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        return [torch.empty_strided(s.shape, s.stride, dtype=s.dtype, device=s.device) for s in specs]


def export_dims(specs: list[InputSpec]) -> tuple[Any, ...]:
    """export's ``dynamic_shapes`` for the inputs: each dim that is a token symbol one named ``Dim`` (shared by
    every input holding it, min 1: a decode step has one token); a derived size (2 * tokens) ``Dim.DYNAMIC``."""
    dims: dict[str, Any] = {}
    return tuple({d: dims.setdefault(name, torch.export.Dim(f"tokens_{name}", min=1)) if name is not None
                  else torch.export.Dim.DYNAMIC for d, name in spec.dims.items()} or None for spec in specs)


def uninitialized_outputs(sub: torch.fx.GraphModule) -> set[int]:
    """Positions of the outputs ``sub`` makes with ``empty`` / ``empty_like`` / ``new_empty`` and returns as they
    are: buffers a split op fills later (the attention output), whose values mean nothing yet."""
    (value,) = next(n for n in sub.graph.nodes if n.op == "output").args
    values = value if isinstance(value, (tuple, list)) else [value]
    return {i for i, v in enumerate(values) if isinstance(v, torch.fx.Node) and "empty" in str(v.target)}


def check_unit(unit: PackagedUnit, sub: torch.fx.GraphModule, args: list[torch.Tensor], skip: set[int]) -> None:
    """``ValueError`` unless the package's outputs on ``args`` equal ``sub`` run eagerly (relative to each
    output's largest value: 1e-3 for float32 / float64, 5e-2 for half precision; integers exactly), but for the
    outputs at ``skip`` (uninitialized buffers), whose shape and dtype only are compared."""
    want = sub(*args)
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    got = unit.loader.run(args)
    if len(got) != len(want) or not all(isinstance(w, torch.Tensor) for w in want):
        raise ValueError(f"the package returns {len(got)} tensors where the unit returns "
                         f"{[type(w).__name__ for w in want]}")
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != w.dtype:
            raise ValueError(f"output {i}: the package gives {g.dtype}{list(g.shape)}, eager {w.dtype}{list(w.shape)}")
        if i in skip:
            continue
        if not w.is_floating_point():
            if not torch.equal(g, w):
                raise ValueError(f"output {i} differs from the unit run eagerly")
            continue
        tol = 1e-3 if w.dtype in (torch.float32, torch.float64) else 5e-2
        g64, w64 = g.double(), w.double()
        if not torch.equal(g64.isnan(), w64.isnan()):
            raise ValueError(f"output {i}: NaNs where the unit run eagerly has none, or the reverse")
        finite = w64.isfinite()
        scale = w64[finite].abs().max().clamp_min(1e-30) if finite.any() else torch.tensor(1.0)
        err = float(((g64 - w64)[finite]).abs().max() / scale) if finite.any() else 0.0
        if err > tol:
            raise ValueError(f"output {i} is off by {err:.2e} (relative) from the unit run eagerly")
