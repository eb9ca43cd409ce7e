"""A warm start without the compiler stack: the program built from AOTInductor packages kept in the cache.

A cold start with ``Config(aot_package=...)`` on exports each compiled unit (a piece; in ``mode="full"`` the whole
graph) with the token count dynamic and packages it with AOTInductor (:mod:`piecegraph.trace.aot_package`). What
the warm start needs besides the packages is a :class:`PackagedProgram`: for each piece which package runs it and
how it is called, the split module's top level (pickled FX code over the pieces and the split ops, no fake values),
and the :class:`~piecegraph.program.Program`'s plain fields. :func:`load_packaged` builds the program from it with
torch's C++ package loader: no Dynamo, no Inductor, no sympy is imported, nothing is compiled or traced.

The loader is torch's ``torch._C._aoti.AOTIModelPackageLoader`` (torch's public ``aoti_load_package`` wraps it but
imports Inductor). It runs a package on the caller's current CUDA stream; ``run_single_threaded`` skips its
runner pool's locking, which CUDA graph capture needs (piecegraph serializes a module's calls itself).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pickle
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import Config
from ..graphs.capture import GraphedPiece
from ..graphs.memory import GraphMemory
from ..program import CaptureState, Program

log = logging.getLogger("piecegraph")
FORMAT = 1  # bump when PackagedProgram changes: older records then read as unusable and the start compiles
PROGRAM_FIELDS = ("infos", "kinds", "token_outputs", "dynamic", "names", "caller_inputs", "token_mixing",
                  "mutated_inputs")


@dataclass
class UnitSpec:
    """One package: its file in the cache entry, which of the unit's inputs it takes (the token count, an int
    input of the traced unit, is read from a tensor's size inside the package instead), whether the unit returns
    one value rather than a tuple, and the device index its code runs on (-1: CPU)."""

    file: str
    tensor_inputs: tuple[int, ...]
    single: bool
    device_index: int


@dataclass
class PackagedProgram:
    """What a warm start builds a program from, besides the packages (see the module docstring)."""

    units: list[UnitSpec]
    pieces: dict[str, int]  # piece name ("graph" in mode full) -> its unit (identical pieces share one)
    skeleton: bytes | None  # the split module pickled, pieces as empty modules; None: the one unit is the call
    fields: dict[str, Any]  # the Program's PROGRAM_FIELDS
    memory: GraphMemory | None
    torch_version: str = field(default_factory=lambda: torch.__version__)
    format: int = FORMAT
    libraries: tuple[str, ...] = ()  # the start's torch libraries (torch_libraries), imported before a load


def torch_libraries() -> tuple[str, ...]:
    """The top-level packages this process has imported, in import order, whose distribution requires torch
    (FlashInfer, a kernel library, ...; torch and piecegraph aside): what a process that loads this start's
    packages imports first (:func:`import_libraries`).

    Why: on the H100 and H200 machines (torch 2.11), torch's package loader crashed (SIGSEGV in ``std::regex``,
    in the package's own ``parse_device_str``, as it built the model) in every fresh process that had not imported
    FlashInfer, packages made in a setup too, and loaded each one once FlashInfer was imported. The
    background worker, a fresh process, lacked it. A package is therefore made, checked and loaded only in
    processes that imported what the start had (the compiler stack, which torch's own requirements are, is not
    among them: a warm start does not import it)."""
    from importlib import metadata

    dists = metadata.packages_distributions()
    names = [name for name in list(sys.modules) if "." not in name and name not in ("torch", "piecegraph")]
    return tuple(name for name in dict.fromkeys(names) if any(_requires_torch(d) for d in dists.get(name, ())))


def _requires_torch(dist: str) -> bool:
    from importlib import metadata

    try:
        requires = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return False
    # "torch>=2.9" counts; "torch ; extra == 'gpu'" (an optional need) and "torchvision" do not
    return any(re.match(r"torch(?![\w.-])", r) and "extra" not in r.partition(";")[2] for r in requires)


def import_libraries(names: tuple[str, ...] | list[str]) -> None:
    """Import each of ``names`` not imported yet (see :func:`torch_libraries`); one that fails is logged and
    skipped (the load then runs as it would have without it)."""
    for name in names:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception as err:  # noqa: BLE001  (any import error: the load goes on without it)
                log.info("piecegraph: %s, imported by the start that made the packages, does not import here "
                         "(%s: %s)", name, type(err).__name__, err)


def can_load() -> bool:
    """Whether this torch has the C++ package loader (torch >= 2.6)."""
    return hasattr(torch._C, "_aoti") and hasattr(torch._C._aoti, "AOTIModelPackageLoader")


class PackagedUnit:
    """A package loaded and called as the compiled unit it replaces: positionally, with the unit's inputs (int
    inputs are dropped: the package reads the token count off its tensors); returns one tensor or a tuple."""

    def __init__(self, path: str | Path, spec: UnitSpec):
        self.spec = spec
        self.inputs = spec.tensor_inputs
        self.single = spec.single
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, spec.device_index)

    def __call__(self, *args: Any) -> Any:
        out = self.loader.run([args[i] for i in self.inputs])
        return out[0] if self.single else tuple(out)


def load_packaged(record: PackagedProgram, folder: Path, config: Config, device_index: int | None = None
                  ) -> tuple[Program, GraphMemory | None]:
    """The :class:`Program` of ``record`` with its packages (files in ``folder``) loaded, and the graph memory
    estimate the cold start made. ``device_index``: the CUDA device this start's tensors are on (the cache key
    names the GPU model, not which one: a package built on device 0 runs on device 1 so). ``LookupError`` when
    the record is of another format or torch; the loader's own error when a package cannot be loaded (the caller
    then compiles)."""
    if record.format != FORMAT or record.torch_version != torch.__version__:
        raise LookupError(f"packaged program of format {record.format}, torch {record.torch_version}")
    import_libraries(getattr(record, "libraries", ()))  # a record pickled before libraries were recorded has none
    specs = [dataclasses.replace(spec, device_index=device_index) if spec.device_index >= 0
             and device_index is not None else spec for spec in record.units]
    units = [PackagedUnit(folder / spec.file, spec) for spec in specs]
    state = CaptureState.for_config(config)
    infos = record.fields["infos"]
    graphed = {name: GraphedPiece(name, units[record.pieces[name]], state) for name in
               [info.name for info in infos if info.name in record.pieces]}
    if record.skeleton is None:
        call = graphed["graph"]
    else:
        call = bind_pieces(pickle.loads(record.skeleton), infos, graphed)
    program = Program(call=call, state=state, pieces=list(graphed.values()), **record.fields)
    return program, record.memory


def bind_pieces(split_gm: torch.fx.GraphModule, infos: list[Any], pieces: dict[str, Callable[..., Any]]
                ) -> Callable[..., Any]:
    """``split_gm``'s forward, bound, with ``pieces`` (name -> what runs it) in place of their submodules and each
    split op's submodule as its plain forward."""
    for info in infos:
        if info.name in pieces:
            split_gm.__dict__[info.name] = pieces[info.name]  # the generated forward looks submodules up by attribute
        elif info.is_split:  # runs eagerly every step, per layer: its forward, without nn.Module's call path
            split_gm.__dict__[info.name] = plain_forward(getattr(split_gm, info.name))
    return plain_forward(split_gm)  # not split_gm(...): nn.Module's call machinery costs every replay


def plain_forward(sub: torch.fx.GraphModule) -> Callable[..., Any]:
    """``sub``'s generated forward, bound: what calling ``sub`` runs, minus nn.Module's and GraphModule's call
    wrappers (~10 us per call under a profiler; the split module runs every step, a split op once per layer per
    step). Nothing registers hooks on these internal modules."""
    if hasattr(sub, "real_recompile"):  # a lazy GraphModule: generate its forward now, not on a call
        sub.real_recompile()
    return sub.forward
