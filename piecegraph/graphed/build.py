"""A GraphedModule's first call builds its runners: a Dynamo trace split into a program and bound to the call's
arguments, or (``mode="breakable"``) the eager model captured in segments. Also: which tensor a failed trace or a
token-count mismatch shows to be static, not a token input."""

from __future__ import annotations

import contextlib
import logging
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..adapters.jit_clock import JitBuild
from ..cache.packaging import worker_refusal
from ..cache.session import CacheEntry
from ..config import Config
from ..graphs.breakable import build_breakable_program
from ..graphs.memory import GraphMemory
from ..program import Program, TokenCountMismatch
from ..runner.flat import FlatRunner
from ..trace.aot_load import PackagedProgram, can_load, load_packaged
from ..trace.aot_package import PROGRAM_FILE, PackageRecorder
from ..trace.backend import build_program, graph_memory
from ..trace.inputs import placeholder_facts
from ..trace.snapshot import (
    GraphSnapshot,
    attribute_digest,
    check_fresh,
    op_writes_count,
    restore_graph,
    snapshot_graph,
)
from .binding import Binding, fresh_entry, scratch_arguments, trace_copies
from .binding_snapshot import BindingSnapshot, restore_binding, snapshot_binding

log = logging.getLogger("piecegraph")


@dataclass
class Startup:
    """Where a GraphedModule's setup went (``stats()["startup"]``): seconds of importing torch's compiler stack
    (Dynamo, Inductor: the first setup in a process pays it, a warm start too), prewarm (the first eager call,
    where JIT kernels such as FlashInfer's build), trace (Dynamo and the trace call's run), compile (splitting
    and Inductor, static compiles included), diagnose (the advisor's work when a trace fails: the doctor's own
    traces and automatic opaque's probe runs, none of it in trace or compile) and the whole setup; and what the
    artifact cache did (``cache``: filled by :func:`piecegraph.cache.compile_cache`); and FlashInfer's JIT builds
    (``jit``: :func:`piecegraph.adapters.jit_clock.jit_builds`, whose seconds are also inside the stage that
    ran them, mostly prewarm); and torch's own timers of its compile regions (``compile_regions``). Accumulates
    over retraces and recompiles."""

    compiler_import_s: float = 0.0  # importing Dynamo and Inductor, the first setup in a process pays it
    prewarm_s: float = 0.0
    trace_s: float = 0.0
    compile_s: float = 0.0
    diagnose_s: float = 0.0  # finding what stops Dynamo and fixing it (doctor rounds, automatic opaque's probes)
    setup_s: float = 0.0
    cache: dict[str, Any] = field(default_factory=lambda: {"cache": "off"})
    jit: list[JitBuild] = field(default_factory=list)  # FlashInfer's ninja runs in setup and capture, each stage's too
    # torch's own timed compile regions inside the setup, the longest (trace/compile_clock.py): name -> seconds
    compile_regions: dict[str, float] = field(default_factory=dict)


@dataclass
class TraceSnapshot:
    """What a warm start needs instead of Dynamo: the traced graph, the binding, and the config's static inputs
    as the trace left them (a tensor found static is added to them)."""

    graph: GraphSnapshot
    binding: BindingSnapshot
    static_inputs: tuple[str, ...]
    attributes: str = ""  # trace/snapshot.py's attribute_digest of the model it was traced from


def trace_model(model: torch.nn.Module, values: dict[str, Any], config: Config, runners: list[FlatRunner],
                verify_sizes: float | None = None, startup: Startup | None = None,
                snapshots: list[GraphSnapshot | None] | None = None, packages: PackageRecorder | None = None
                ) -> tuple[Callable[..., Any], Binding | None]:
    """Trace ``model`` with Dynamo once, on copies of the call's arguments (its tensors are never written).

    Every compile appends its runner to ``runners``, a recompile on a later call too; the trace call itself runs
    the pieces without graphs. Returns the compiled call (``compiled(**values)``) and the binding that lets later
    calls skip Dynamo (``None``: they go through it). ``verify_sizes``: how many captured sizes each runner
    verifies (default: the config's ``verify``). ``startup``: where the seconds go (a recompile's too).
    ``snapshots``: when given, the first graph is snapshotted (appended, ``None`` if it cannot be) and the program
    built from the restored snapshot, so a warm start loading it compiles the very same code. ``packages``: the
    first program's units are packaged by AOTInductor where they can be (trace/aot_package.py). Dynamo's errors
    propagate."""
    trace_values = trace_copies(values, config.token_dim, config.static_inputs)
    examples: list[list[Any]] = []
    startup = startup or Startup()

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        # A recompile's runner is not tracing: it captures at once.
        inputs, restored = example_inputs, False
        if snapshots is not None and not examples:
            gm, inputs = _through_snapshot(gm, example_inputs, snapshots)
            restored = snapshots[-1] is not None
        # A restored graph has fakes of its own shape env: compile it outside Dynamo's tracing context, whose
        # fake mode (the one compilers look up first) knows only Dynamo's symbols. A warm start compiles it so.
        with torch._guards.tracing(None) if restored else contextlib.nullcontext():
            memory = graph_memory(gm, config)  # before compiling: Inductor rewrites the graph it is given
            start = time.perf_counter()
            program = build_program(gm, inputs, config, packages if not examples else None)
            startup.compile_s += time.perf_counter() - start
        runner = FlatRunner(program, config, tracing=not examples, verify_sizes=verify_sizes, memory=memory)
        examples.append(list(example_inputs))
        runners.append(runner)
        return runner

    compiled = torch.compile(fresh_entry(), backend=backend, fullgraph=True, dynamic=False)

    def call(**kw: Any) -> Any:
        return compiled(model, kw)

    start, compile_before = time.perf_counter(), startup.compile_s
    result = call(**trace_values)
    startup.trace_s += time.perf_counter() - start - (startup.compile_s - compile_before)
    runner = runners[-1]
    runner.end_trace()
    return call, bind_trace(runner, examples[0], trace_values, result, config.token_dim)


def _through_snapshot(gm: torch.fx.GraphModule, example_inputs: list[Any], snapshots: list[GraphSnapshot | None]
                      ) -> tuple[torch.fx.GraphModule, list[Any]]:
    """``gm`` snapshotted and restored (appending the snapshot), or as it is when it cannot be (appending None)."""
    snapshot = snapshot_graph(gm, *placeholder_facts(gm))
    if snapshot is not None:
        try:
            restored, restored_fakes = restore_graph(snapshot)
        except Exception as err:  # noqa: BLE001  (a graph FX cannot rebuild: keep Dynamo's, without a snapshot)
            log.info("piecegraph: the traced graph cannot be snapshotted (%s: %s); warm starts will trace",
                     type(err).__name__, err)
            snapshot = None
        else:
            kept, traced = op_writes_count(restored), op_writes_count(gm)
            if kept != traced:  # a lost write (attention, a KV-cache update) would be a wrong program: refuse it
                log.warning("piecegraph: the traced graph's snapshot calls %s where Dynamo's graph calls %s; "
                            "warm starts will trace (please report this)", kept, traced)
                snapshot = None
            else:
                gm, example_inputs = restored, restored_fakes
    snapshots.append(snapshot)
    return gm, example_inputs


def trace_snapshot(graph: GraphSnapshot | None, binding: Binding | None, model: torch.nn.Module, config: Config
                   ) -> TraceSnapshot | None:
    """The warm start's snapshot of a trace, or ``None`` when its graph or binding cannot be snapshotted."""
    if graph is None or binding is None:
        return None
    bound = snapshot_binding(binding, model)
    return None if bound is None else TraceSnapshot(graph, bound, tuple(config.static_inputs),
                                                    attribute_digest(model))


def load_trace(model: torch.nn.Module, snapshot: TraceSnapshot, config: Config, runners: list[FlatRunner],
               verify_sizes: float | None = None, startup: Startup | None = None,
               packages: PackageRecorder | None = None, offered: Any = None) -> Binding:
    """The program of ``snapshot`` built without Dynamo (its graph restored, split and compiled as a trace
    would be) and bound to ``model``; its runner is appended to ``runners`` and captures at once (no trace
    call). ``LookupError`` when the model's tensors are not those snapshotted, its plain attributes or a source
    file the trace came from changed (what Dynamo's guards would have caught); the caller traces anew then.
    ``packages``: as :func:`trace_model`'s. ``offered``: another program's compiled pieces, taken where they are
    this program's (see trace/handover.py and :func:`~piecegraph.trace.backend.build_program`)."""
    startup = startup or Startup()
    start = time.perf_counter()
    binding = _check_and_bind(model, snapshot)
    gm, fakes = restore_graph(snapshot.graph)
    memory = graph_memory(gm, config)  # in trace_s, as a traced start counts it
    startup.trace_s += time.perf_counter() - start
    start = time.perf_counter()
    program = build_program(gm, fakes, config, packages, offered)
    startup.compile_s += time.perf_counter() - start
    return _bound_runner(program, config, verify_sizes, memory, binding, runners)


def load_packaged_trace(model: torch.nn.Module, snapshot: TraceSnapshot, record: PackagedProgram, folder: Path,
                        config: Config, runners: list[FlatRunner], verify_sizes: float | None = None,
                        startup: Startup | None = None, device_index: int | None = None) -> Binding:
    """As :func:`load_trace`, but the program is built from the AOTInductor packages of ``record`` (files in
    ``folder``), run on CUDA device ``device_index`` (the call's): neither Dynamo nor Inductor is imported,
    nothing traced or compiled (trace/aot_load.py). The same ``LookupError`` when the model does not fit the
    snapshot; the loader's error when a package does not load."""
    startup = startup or Startup()
    start = time.perf_counter()
    binding = _check_and_bind(model, snapshot)
    program, memory = load_packaged(record, folder, config, device_index)
    startup.compile_s += time.perf_counter() - start
    return _bound_runner(program, config, verify_sizes, memory, binding, runners)


def _check_and_bind(model: torch.nn.Module, snapshot: TraceSnapshot) -> Binding:
    """The snapshot's binding on ``model``, after checking the model is what was traced (see load_trace)."""
    if attribute_digest(model) != snapshot.attributes:
        raise LookupError("the model's attributes (numbers, flags, strings) changed since it was traced")
    check_fresh(snapshot.graph)
    return restore_binding(snapshot.binding, model)


def _bound_runner(program: Program, config: Config, verify_sizes: float | None, memory: GraphMemory | None,
                  binding: Binding, runners: list[FlatRunner]) -> Binding:
    runner = FlatRunner(program, config, verify_sizes=verify_sizes, memory=memory)
    runner.label_inputs(binding.labels())
    runner.stage_caller_statics(binding.caller_indices())
    runners.append(runner)
    return binding


def bind_trace(runner: FlatRunner, example_inputs: list[Any], trace_values: dict[str, Any], result: Any,
               token_dim: int) -> Binding | None:
    """Map the graph's inputs to the call's arguments, so later calls skip Dynamo's guards; the runner's inputs
    are then labelled by argument name, and the caller's static tensors staged."""
    program = runner.program
    binding = Binding.from_trace(example_inputs, program.names, program.kinds, trace_values, result,
                                 runner.last_outputs, token_dim)
    if binding is not None:
        runner.label_inputs(binding.labels())
        runner.stage_caller_statics(binding.caller_indices())
    return binding


def breakable_model(model: torch.nn.Module, values: dict[str, Any], config: Config,
                    graphs: bool | None = None) -> tuple[FlatRunner, Binding]:
    """No Dynamo: the eager model, captured in segments cut at split ops (see graphs/breakable.py), probed on
    copies of the call's arguments. Every input is the caller's (none is a parameter), so every one is staged."""
    program = build_breakable_program(model, scratch_arguments(values), config)
    runner = FlatRunner(program, config, graphs=graphs)
    runner.stage_caller_statics(range(len(values)))
    return runner, Binding.of_arguments(values, program.single_output)


def static_from_mismatch(err: TokenCountMismatch, values: dict[str, Any], labels: list[str],
                         traced_counts: dict[str, int]) -> set[str]:
    """The arguments a token-count mismatch shows to be static: taken for token inputs on the first call (their
    dim ``token_dim`` happened to equal the token count, a (1, D) row at one token), they kept their size while
    the first token input's changed. Empty when nothing explains the mismatch so."""
    order = {name: i for i, name in enumerate(values)}
    # The first token argument (in the signature) defines the token count, as token_arguments() decides.
    first, *others = sorted(err.sizes, key=lambda i: order.get(labels[i], len(order)))
    if err.sizes[first] == traced_counts.get(labels[first]):
        return set()  # the tokens kept their count: the other input is wrong, not static
    kept = {labels[i] for i in others if err.sizes[i] == traced_counts.get(labels[i])}
    return kept if kept <= set(values) else set()


class TimedAdvisor:
    """An advisor (``fix_trace``, ``apply_fixes``, ``summarize``, ``explain``) whose calls add their seconds to
    ``startup.diagnose_s``, less what the module's own traces inside them (``fix_trace``'s ``retrace``) added to
    ``trace_s`` and ``compile_s``."""

    def __init__(self, advisor: Any, startup: Startup) -> None:
        self.advisor, self.startup = advisor, startup

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.advisor, name)
        if not callable(method):
            return method

        def timed(*args: Any, **kwargs: Any) -> Any:
            startup = self.startup
            start, own = time.perf_counter(), startup.trace_s + startup.compile_s
            try:
                return method(*args, **kwargs)
            finally:
                startup.diagnose_s += time.perf_counter() - start - (startup.trace_s + startup.compile_s - own)

        return timed


def wants_packages(config: Config, values: dict[str, Any]) -> bool:
    """Whether this start packages its units with AOTInductor, or loads such packages (``Config.aot_package``:
    ``None`` means when the call's tensors are on CUDA and graphs are real); a cache is needed as well."""
    if config.aot_package is False or config.mode not in ("piecewise", "full", "auto") or not can_load():
        return False
    if config.aot_package:
        return True
    return not config.emulate_graphs and any(
        isinstance(v, torch.Tensor) and v.is_cuda for v in values.values())


def cuda_index(values: dict[str, Any]) -> int | None:
    """The CUDA device index of the call's first CUDA tensor, or ``None``."""
    return next((v.device.index for v in values.values() if isinstance(v, torch.Tensor) and v.is_cuda), None)


def package_recorder(config: Config, values: dict[str, Any], entry: CacheEntry) -> PackageRecorder | None:
    """A recorder for a start that compiles and should leave packages in the cache entry, else ``None``."""
    if not entry.enabled or entry.scratch is None or not wants_packages(config, values):
        return None
    # A setup loads its packages in the caller's process: on CUDA, where torch's loader crashed processes without
    # FlashInfer (SIGSEGV, H100 and H200), the first is loaded in a fresh process first (the worker is one itself)
    probe = not config.aot_background and cuda_index(values) is not None
    recorder = PackageRecorder(entry.scratch / "aot", background=config.aot_background, probe_loads=probe)
    # Read by Config(full_compile="auto") only: the worker's state files are not read for other programs
    if config.aot_background and config.mode == "full" and config.full_compile == "auto" \
            and entry.root is not None and entry.key is not None:
        recorder.worker_expected = worker_refusal(entry.root, entry.key, torch.__version__) is None
    return recorder


def packaged_record(config: Config, values: dict[str, Any], entry: CacheEntry) -> PackagedProgram | None:
    """The cache entry's packaged program when this start should load it, else ``None`` (none there, or not
    wanted: ``Config.aot_package``)."""
    if not entry.enabled or entry.trace is None or PROGRAM_FILE not in entry.files or not wants_packages(
            config, values):
        return None
    return pickle.loads(entry.files[PROGRAM_FILE])


def publish_packages(recorder: PackageRecorder | None, runners: list[FlatRunner], plain: bool, entry: CacheEntry,
                     report: dict[str, Any]) -> None:
    """Hand the cache entry the packages of a start's one program (``plain``: nothing wrapped by automatic
    opaque, whose ops a later process would not have), or, in the background, the units to package once the
    entry is published (:func:`start_background_packaging`); say in ``report["aot"]`` what was packaged."""
    if recorder is None:
        return
    kept = entry.new_trace is not None or entry.trace is not None  # a warm start loads packages with the trace
    plan = recorder.finish(runners[0].program, runners[0].memory) if plain and len(runners) == 1 else None
    if plan is None or not kept:
        why = recorder.why_not or ("the trace could not be kept" if plan is not None
                                   else "the program is not one packaged trace")
        report["aot"] = f"not packaged: {why}"
        return
    if plan.jobs:
        entry.background = plan
        return
    entry.new_files.update(plan.files)
    report["aot"] = f"packaged {len(plan.record.units)} units in {recorder.seconds:.1f} s"


def start_background_packaging(entry: CacheEntry, report: dict[str, Any]) -> bool:
    """After the cache block published the entry: start the worker that packages the units
    :func:`publish_packages` left for it (trace/aot_worker.py), and say so in ``report["aot"]``. True when a
    worker is packaging the entry now (this start's or another's)."""
    plan, entry.background = entry.background, None
    trace = entry.new_trace or entry.trace
    if plan is None or entry.root is None or entry.key is None or trace is None:
        return False
    from ..trace.aot_worker import start_worker

    try:
        report["aot"], packaging = start_worker(entry.root, entry.key, trace, plan)
    except Exception as err:  # noqa: BLE001  (ops no worker can import, a worker that does not start: the
        report["aot"] = f"not packaged: {err}"  # start is ready all the same, on Inductor's code)
        log.warning("piecegraph: not packaging the compiled pieces in the background: %s", err)
        return False
    return packaging
