"""A cold start's AOTInductor packages (``Config(aot_package=...)``): each compiled unit exported with the token
count dynamic, packaged, checked against the unit run eagerly, and run from the package from then on, so the cold
start and every warm start run the very same code (see :mod:`piecegraph.trace.aot_load` for the warm side).

A traced unit takes the token count as an int input too (Dynamo's SymInt), which ``torch.export`` cannot keep
symbolic: each such input is read as ``sym_size`` of a tensor input holding the same symbol instead, and the
package is called without it. Example inputs are made from the trace's fake values at the traced token count
(:func:`traced_tokens`; random floats, zero integers; the fakes' strides kept), which is also what the check runs
on. Anything the recorder cannot do
(export, packaging, a check off by more than the tolerance, a unit returning a non-tensor) leaves that unit and
every later one on Inductor's usual code, with the reason logged and reported, and the entry without packages.
"""

from __future__ import annotations

import copy
import inspect
import logging
import pickle
import time
from pathlib import Path
from typing import Any

import torch

from ..program import Program
from .aot_load import PROGRAM_FIELDS, PackagedProgram, PackagedUnit, UnitSpec
from .static import concrete_size, returns_one_value, static_fakes

log = logging.getLogger("piecegraph")
PROGRAM_FILE = "packaged.pkl"
EXAMPLE_TOKENS = 17  # examples' token count when the trace's is unknown: not 0 or 1 (export would specialise it)


class PackageRecorder:
    """Packages the units of one program as :func:`~piecegraph.trace.backend.build_program` compiles them, into
    ``folder``; :meth:`finish` hands the cache the record and the files. ``why_not`` says why it stopped."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.loaded: list[PackagedUnit] = []
        self.skeleton: bytes | None = None
        self.why_not: str | None = None
        self.closed = False
        self.seconds = 0.0

    @property
    def active(self) -> bool:
        return not self.closed and self.why_not is None

    def reset(self) -> None:
        """Forget what was packaged (a program traced again is packaged anew)."""
        if not self.closed:
            self.loaded, self.skeleton, self.why_not = [], None, None

    def refuse(self, why: str) -> None:
        """Stop packaging this program (the units compile as usual), saying why once."""
        if self.active:
            self.why_not = why
            log.info("piecegraph: not packaging the compiled pieces with AOTInductor: %s", why)

    def compile(self, sub: torch.fx.GraphModule, fakes: list[Any], has_split_op: bool) -> PackagedUnit | None:
        """``sub`` packaged and loaded (called as the compiled unit would be), or ``None`` when it cannot be (the
        reason kept): the caller then compiles it as usual. A unit holding a split op is not run for the check
        (its op may plan or write state only the program's own runs may touch)."""
        if not self.active:
            return None
        start = time.perf_counter()
        try:
            return self._package(sub, fakes, has_split_op)
        except Exception as err:  # noqa: BLE001  (export and AOTInductor raise many types; each means: compile)
            self.refuse(f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err) else ''}")
            return None
        finally:
            self.seconds += time.perf_counter() - start

    def keep_skeleton(self, split_gm: torch.fx.GraphModule, infos: list[Any]) -> None:
        """Keep ``split_gm``'s top level (before its pieces are bound) for the warm start: the split module with
        every piece that has ops replaced by an empty module, pickled as FX code (no node metadata)."""
        if not self.active:
            return
        root = {info.name: torch.nn.Module() if not info.is_split and info.num_ops > 0
                else getattr(split_gm, info.name) for info in infos}
        self.skeleton = pickle.dumps(torch.fx.GraphModule(root, split_gm.graph))

    def finish(self, program: Program, memory: Any) -> tuple[PackagedProgram, dict[str, bytes]] | None:
        """The record of ``program`` and its files (name -> bytes), or ``None`` when one of its pieces does not
        run from a package. Ends the recording: a later recompile compiles as usual."""
        active, self.closed = self.active, True
        if not active or not self.loaded:
            return None
        pieces: dict[str, int] = {}
        for piece in program.pieces:
            index = next((i for i, unit in enumerate(self.loaded) if unit is getattr(piece, "fn", None)), None)
            if index is None:
                return None
            pieces[piece.name] = index
        whole = program.call is program.pieces[0] if program.pieces else False
        record = PackagedProgram(
            units=[unit.spec for unit in self.loaded], pieces=pieces, skeleton=None if whole else self.skeleton,
            fields={name: getattr(program, name) for name in PROGRAM_FIELDS}, memory=memory)
        if not whole and record.skeleton is None:
            return None
        files = {unit.spec.file: (self.folder / unit.spec.file).read_bytes() for unit in self.loaded}
        files[PROGRAM_FILE] = pickle.dumps(record)
        return record, files

    def _package(self, sub: torch.fx.GraphModule, fakes: list[Any], has_split_op: bool) -> PackagedUnit:
        single = returns_one_value(sub)
        sub, kept = int_inputs_as_sizes(copy.deepcopy(sub), fakes)
        kept_fakes = [fakes[i] for i in kept]
        device = next(f.device for f in kept_fakes if isinstance(f, torch.Tensor))
        index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else -1
        import sympy  # a cold start has imported it with Dynamo; `import piecegraph` must not
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily(), torch._guards.tracing(None):
            symbols, tokens = size_symbols(kept_fakes), traced_tokens(kept_fakes)
            # A unit not run for the check is exported from fake examples: a whole graph's inputs are every weight
            # of the model, which real examples would hold a second time (1 GB for the 0.5B shape).
            args = static_fakes(kept_fakes, symbols, tokens) if has_split_op else [
                example_tensor(f, {s: sympy.Integer(tokens) for s in symbols}) for f in kept_fakes]
            dims = dynamic_dims(kept_fakes)
            varargs = any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(sub.forward).parameters.values())
            exported = torch.export.export(sub, tuple(args), dynamic_shapes=(dims,) if varargs else dims,
                                           strict=False)
            spec = UnitSpec(f"unit{len(self.loaded)}.pt2", tuple(kept), single, index)
            self.folder.mkdir(parents=True, exist_ok=True)
            torch._inductor.aoti_compile_and_package(exported, package_path=str(self.folder / spec.file))
            unit = PackagedUnit(self.folder / spec.file, spec)
            if not has_split_op:
                check_unit(unit, sub, args, uninitialized_outputs(sub))
        self.loaded.append(unit)
        return unit


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


def example_tensor(fake: torch.Tensor, subs: dict[Any, Any]) -> torch.Tensor:
    """A real tensor like ``fake`` (its strides too) with ``subs`` (symbol -> ``sympy.Integer``) fixing its token
    symbols: random floats, zero integers (always valid indices)."""
    shape = [concrete_size(n, subs) for n in fake.shape]
    stride = [concrete_size(n, subs) for n in fake.stride()]
    out = torch.empty_strided(shape, stride, dtype=fake.dtype, device=fake.device)
    return out.normal_() if out.is_floating_point() else out.zero_()


def dynamic_dims(fakes: list[torch.Tensor]) -> tuple[Any, ...]:
    """export's ``dynamic_shapes`` for the inputs: each dim that is a token symbol one named ``Dim`` (shared by
    every input holding it, min 1: a decode step has one token); a derived size (2 * tokens) ``Dim.DYNAMIC``."""
    dims: dict[Any, Any] = {}
    specs = []
    for fake in fakes:
        spec = {}
        for d, n in enumerate(fake.shape):
            if isinstance(n, torch.SymInt):
                expr = n.node.expr
                if expr.is_Symbol:
                    spec[d] = dims.setdefault(expr, torch.export.Dim(f"tokens_{expr}", min=1))
                else:
                    spec[d] = torch.export.Dim.DYNAMIC
        specs.append(spec or None)
    return tuple(specs)


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
