"""A start's AOTInductor packages (``Config(aot_package=...)``): each compiled unit described as the program is
built (:mod:`piecegraph.trace.aot_job`), then exported with the token count dynamic, packaged, and checked against
the unit run eagerly, either at once (``Config(aot_background=False)``: the start then runs the packages itself,
so it and every warm start run the very same code) or after the start, by a worker process
(:mod:`piecegraph.trace.aot_worker`; the start runs Inductor's usual code meanwhile and is ready as soon as
without packages). :mod:`piecegraph.trace.aot_load` is the warm side.

Anything the recorder cannot do (describe, export, package, a check off by more than the tolerance, a unit
returning a non-tensor) leaves that unit and every later one on Inductor's usual code, with the reason logged and
reported, and the entry without packages.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..program import Program
from .aot_job import UnitJob, describe_unit, op_modules, package_unit
from .aot_load import PROGRAM_FIELDS, PackagedProgram, PackagedUnit, torch_libraries

log = logging.getLogger("piecegraph")
PROGRAM_FILE = "packaged.pkl"


@dataclass
class PackagedPlan:
    """What :meth:`PackageRecorder.finish` hands on: the program's record, and either the packaged files (name ->
    bytes, the record's too) or, in the background, the units still to package (``jobs``)."""

    record: PackagedProgram
    files: dict[str, bytes] = field(default_factory=dict)
    jobs: list[UnitJob] = field(default_factory=list)


class PackageRecorder:
    """Packages (``background``: describes) the units of one program as
    :func:`~piecegraph.trace.backend.build_program` compiles them, into ``folder``; :meth:`finish` hands the cache
    the plan. ``why_not`` says why it stopped."""

    def __init__(self, folder: str | Path, background: bool = False, probe_loads: bool = False):
        self.folder = Path(folder)
        self.background = background
        self.probe_loads = probe_loads  # load the first package in a fresh process before this one (a crash there)
        # a background worker is expected to package the program (none failed or crashed before): a full graph
        # then compiles by pieces under Config(full_compile="auto"), its whole graph swapped in once packaged
        self.worker_expected = False
        self.units: list[tuple[UnitJob, Callable[..., Any]]] = []  # each unit's job and what runs it here
        self.pending: UnitJob | None = None  # described in the background, waiting for its compiled code
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
            self.units, self.pending, self.skeleton, self.why_not = [], None, None, None

    def refuse(self, why: str) -> None:
        """Stop packaging this program (the units compile as usual), saying why once."""
        if self.active:
            self.why_not = why
            log.info("piecegraph: not packaging the compiled pieces with AOTInductor: %s", why)

    def compile(self, sub: torch.fx.GraphModule, fakes: list[Any], has_split_op: bool) -> PackagedUnit | None:
        """``sub`` packaged and loaded (called as the compiled unit would be), or ``None``: in the background (the
        unit is described, and the caller hands its compiled code to :meth:`compiled`), or when it cannot be (the
        reason kept). On ``None`` the caller compiles it as usual. A unit holding a split op is not run for the
        check (its op may plan or write state only the program's own runs may touch)."""
        if not self.active:
            return None
        start = time.perf_counter()
        try:
            job = describe_unit(sub, fakes, has_split_op, f"unit{len(self.units)}.pt2")
            if self.background:
                op_modules([sub])  # the worker imports the ops' modules: none (a ValueError) refuses now
                self.pending = job
                return None
            unit = package_unit(job, self.folder, probe=self.probe_loads and not self.units)  # one loader: once
            self.units.append((job, unit))
            return unit
        except Exception as err:  # noqa: BLE001  (export and AOTInductor raise many types; each means: compile)
            self.refuse(f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err) else ''}")
            return None
        finally:
            self.seconds += time.perf_counter() - start

    def compiled(self, fn: Callable[..., Any]) -> None:
        """The usual compiled code of the unit :meth:`compile` just described in the background."""
        if self.pending is not None and self.active:
            self.units.append((self.pending, fn))
        self.pending = None

    def keep_skeleton(self, split_gm: torch.fx.GraphModule, infos: list[Any]) -> None:
        """Keep ``split_gm``'s top level (before its pieces are bound) for the warm start: the split module with
        every piece that has ops replaced by an empty module, pickled as FX code (no node metadata)."""
        if not self.active:
            return
        root = {info.name: torch.nn.Module() if info.compiled
                else getattr(split_gm, info.name) for info in infos}
        self.skeleton = pickle.dumps(torch.fx.GraphModule(root, split_gm.graph))

    def finish(self, program: Program, memory: Any) -> PackagedPlan | None:
        """The plan of ``program``, or ``None`` when one of its pieces has no unit here. Ends the recording: a
        later recompile compiles as usual."""
        active, self.closed = self.active, True
        if not active or not self.units:
            return None
        pieces: dict[str, int] = {}
        for piece in program.pieces:
            index = next((i for i, (_, fn) in enumerate(self.units) if fn is getattr(piece, "fn", None)), None)
            if index is None:
                return None
            pieces[piece.name] = index
        whole = program.call is program.pieces[0] if program.pieces else False
        record = PackagedProgram(
            units=[job.spec for job, _ in self.units], pieces=pieces, skeleton=None if whole else self.skeleton,
            fields={name: getattr(program, name) for name in PROGRAM_FIELDS}, memory=memory,
            libraries=torch_libraries())
        if not whole and record.skeleton is None:
            return None
        if self.background:
            return PackagedPlan(record, jobs=[job for job, _ in self.units])
        files = {job.spec.file: (self.folder / job.spec.file).read_bytes() for job, _ in self.units}
        files[PROGRAM_FILE] = pickle.dumps(record)
        return PackagedPlan(record, files)
