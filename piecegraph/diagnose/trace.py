"""Trace stage of the doctor: run Dynamo once with graph breaks allowed and collect every break with its user stack.

How: Dynamo logs each graph break on its ``graph_breaks`` artifact logger ("Graph break in user code at ...",
the reason, and the user code traceback); that text has kept its shape from torch 2.1 to 2.13, unlike the
internal objects behind it. While :func:`trace` runs, a handler on that logger collects the records (nothing
reaches the terminal), ``torch._dynamo.config.verbose`` separates the frames above Dynamo from the traced ones,
and a plain backend keeps every FX graph Dynamo produced. ``fullgraph=False`` lets Dynamo go on after each
break, so one run sees all of them; an exception that escapes Dynamo (a hard failure) is recorded too.

Constraint: :func:`trace` calls ``torch._dynamo.reset()`` before and after (compiled code cached earlier would
hide its breaks), so it must not run while another ``torch.compile`` is tracing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["Frame", "BreakRecord", "TraceResult", "trace", "run_under", "torch_dir", "error_record",
           "quiet_recompile_limit"]

# A diagnosis run with breaks recompiles a resume function once per layer when it reads a per-layer constant
# (``self.layer_idx``): at Dynamo's recompile limit (8) it warns and runs that frame eagerly in the later layers.
# Expected here: those layers are the same code (the breaks are counted by running the model, not by Dynamo), and
# raising the limit to see them cost 38% more diagnosis time on a 24-layer MoE (CPU). So the limit stays and that
# one warning, which reads like a failure, is held back while piecegraph diagnoses.
_DYNAMO_FRAME_LOG = "torch._dynamo.convert_frame"


class _RecompileLimitWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "hit config.recompile_limit" not in record.getMessage()


@contextlib.contextmanager
def quiet_recompile_limit() -> Iterator[None]:
    """Hold back Dynamo's "hit config.recompile_limit" warning (see above) for one diagnosis run."""
    logger, quiet = logging.getLogger(_DYNAMO_FRAME_LOG), _RecompileLimitWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


_MARKER = "most recent `torch.compile` tracing attempt started here"
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$')
_SUPPRESSED = re.compile(r"in user code at (?P<file>.+):(?P<line>\d+)\s*$")
_PREAMBLES = ("Encountered graph break when attempting to trace", "Failed to handle graph break gracefully")
_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<name>.+)_at_\d+$")


@dataclass(frozen=True)
class Frame:
    """One user frame: file, line, function name (resume functions renamed back) and its source line."""

    file: str
    line: int
    name: str
    code: str = ""

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class BreakRecord:
    """One graph break (or hard failure) as Dynamo reported it; ``stack`` runs outermost first."""

    reason: str
    stack: list[Frame]
    hard: bool = False  # the frame was skipped (runs eagerly whole) or tracing raised
    seen: int = 1  # how many times Dynamo reported it while tracing (nested frames re-report a break)
    others: list[list[Frame]] = field(default_factory=list)  # other stacks that reached the same place


@dataclass
class TraceResult:
    """What one traced forward produced: breaks in report order, the FX graphs, and an escaped error."""

    breaks: list[BreakRecord] = field(default_factory=list)
    graphs: list[torch.fx.GraphModule] = field(default_factory=list)
    error: Optional[BaseException] = None
    seconds: float = 0.0


def torch_dir() -> str:
    return os.path.dirname(os.path.abspath(torch.__file__))


_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
_ENTRY_FILE = os.path.join(os.path.dirname(_OWN_DIR), "binding.py")  # GraphedModule traces the model through it


# ------------------------------------------------------------------------------------------- log parsing
def _frames(text: str) -> list[Frame]:
    lines = text.splitlines()
    frames = []
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m is None:
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
        name = m["name"].strip()
        resumed = _RESUME.match(name)
        frames.append(Frame(m["file"], int(m["line"]), resumed["name"] if resumed else name, code))
    return frames


def _user_frames(frames: list[Frame]) -> list[Frame]:
    """Drop everything up to the doctor's own call into the model, then torch's frames (eval_frame, polyfills),
    then the leading frames of the entry a GraphedModule traces the model through."""
    own = [i for i, f in enumerate(frames) if f.file.startswith(_OWN_DIR)]
    frames = frames[own[-1] + 1:] if own else frames
    tdir = torch_dir()
    frames = [f for f in frames if not f.file.startswith(tdir) and not f.file.startswith("<frozen")]
    lead = next((i for i, f in enumerate(frames) if f.file != _ENTRY_FILE), len(frames))
    return frames[lead:]


def _clean_reason(reason: str) -> tuple[str, bool]:
    """The reason without Dynamo's preamble line; True when Dynamo gave up on the whole frame."""
    reason = reason.strip()
    hard = reason.startswith(_PREAMBLES[1])
    if reason.startswith(_PREAMBLES):
        reason = reason.split("\n", 1)[1].strip() if "\n" in reason else reason
    return reason, hard


def parse_record(message: str) -> Optional[BreakRecord]:
    """A :class:`BreakRecord` from one ``graph_breaks`` log message, or None for unrelated messages."""
    if "Graph Break Reason:" not in message:
        return None
    head, _, rest = message.partition("Graph Break Reason:")
    reason, _, stack_text = rest.partition("User code traceback:")
    reason = reason.split("\nStack variable source attribution:")[0]
    reason, hard = _clean_reason(reason)
    if stack_text:
        stack_text = stack_text.split("\nNOTE: the most recent")[0].split("\nMost recent bytecode")[0]
        above, _, below = stack_text.partition(_MARKER)
        stack = _user_frames(_frames(above) + _frames(below))
    else:  # "user stack suppressed due to duplicate graph break": only the location is given
        m = _SUPPRESSED.search(head.strip())
        stack = [Frame(m["file"], int(m["line"]), "?")] if m else []
    return BreakRecord(reason=reason, stack=stack, hard=hard)


class _Collector(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[BreakRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            parsed = parse_record(record.getMessage())
        except Exception:  # a message we cannot parse must not break the model's trace
            return
        if parsed is not None:
            self.records.append(parsed)


def _break_loggers() -> list[logging.Logger]:
    names = {"torch._dynamo.symbolic_convert.__graph_breaks"}
    try:
        from torch._logging._internal import log_registry

        names |= {n for n in log_registry.get_artifact_log_qnames() if n.endswith(".__graph_breaks")}
    except Exception:  # the registry moved: the known name still works
        pass
    return [logging.getLogger(n) for n in sorted(names)]


@contextlib.contextmanager
def collect_breaks() -> Iterator[_Collector]:
    """Collect graph-break log records in the block; the loggers' own settings are restored afterwards."""
    handler = _Collector()
    loggers = _break_loggers()
    saved = [(lg, lg.level, lg.propagate, lg.disabled) for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.propagate = False  # the doctor reports breaks itself; no duplicate wall of text on stderr
        lg.disabled = False
        lg.addHandler(handler)
    try:
        with torch._dynamo.config.patch(verbose=True):
            yield handler
    finally:
        for lg, level, propagate, disabled in saved:
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.propagate = propagate
            lg.disabled = disabled


# ------------------------------------------------------------------------------------------------ tracing
def run_under(context: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` under ``torch.no_grad()`` and, when ``context`` is not None, ``piecegraph.forward_context``;
    a context that is already the active one (the doctor or auto mode called from inside the caller's ``with
    forward_context(meta):``) is used as it is: contexts do not nest."""
    from piecegraph.context import current_forward_context, forward_context

    enter = context is not None and current_forward_context() is not context
    with torch.no_grad(), (forward_context(context) if enter else contextlib.nullcontext()):
        return fn()


def _mark_token_dim(args: tuple) -> None:
    # piecegraph marks dim 0 dynamic; the doctor traces the same way so shape-dependent breaks show up too
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(a, 0)


def error_record(err: BaseException) -> BreakRecord:
    """A hard failure: Dynamo's user stack when it kept one, else the traceback's non-torch frames."""
    real = getattr(err, "real_stack", None)
    if real:
        stack = [Frame(f.filename, f.lineno or 0, f.name, (f.line or "").strip()) for f in real]
    else:
        stack = [Frame(f.filename, f.lineno or 0, f.name, (f.line or "").strip())
                 for f in traceback.extract_tb(err.__traceback__)]
    text = str(err).strip() or type(err).__name__
    reason, _ = _clean_reason(text.split("\n\nfrom user code:")[0])
    return BreakRecord(reason=f"{type(err).__name__}: {reason}", stack=_user_frames(stack), hard=True)


def _merge(records: list[BreakRecord]) -> list[BreakRecord]:
    """One record per innermost location: a nested frame re-reports its caller's break, and one statement can
    stop Dynamo twice (``open`` then the file's ``__enter__``); the first reason is the one to fix."""
    merged: dict[str, BreakRecord] = {}
    for r in records:
        key = r.stack[-1].location if r.stack else r.reason.split("\n")[0]
        old = merged.get(key)
        if old is None:
            merged[key] = r
            continue
        old.seen += 1
        old.hard = old.hard or r.hard
        if len(old.stack) <= 1 < len(r.stack):  # a suppressed duplicate came first: keep the full stack
            old.stack, r.stack = r.stack, old.stack
        known = {_path(s) for s in [old.stack, *old.others]}
        if r.stack and _path(r.stack) not in known:  # another caller (another library entry) reached it
            old.others.append(r.stack)
    return list(merged.values())


def _path(stack: list[Frame]) -> tuple:
    return tuple((f.file, f.line) for f in stack)


def _break_counts() -> dict[str, int]:
    return dict(torch._dynamo.utils.counters.get("graph_break", {}))


def _unlogged(before: dict[str, int], records: list[BreakRecord]) -> list[BreakRecord]:
    """Breaks Dynamo counted but did not log (a torch that logs some kinds elsewhere): reason only, no stack."""
    known = [r.reason.split("\n")[0].strip() for r in records]
    extra = []
    for reason, n in _break_counts().items():
        if n > before.get(reason, 0) and not any(k and k in reason for k in known):
            text, hard = _clean_reason(str(reason))
            extra.append(BreakRecord(reason=text, stack=[], hard=hard))
    return extra


def trace(model: Callable, args: tuple, kwargs: Optional[dict] = None, context: Any = None) -> TraceResult:
    """Run ``torch.compile(model, fullgraph=False)`` once on ``args`` and collect every break and failure.

    The token dimension (dim 0) of tensor arguments is marked dynamic, as piecegraph does. Graphs are not
    compiled (the backend runs them as traced), so this costs one trace. See the module docstring.
    """
    import time

    kwargs = kwargs or {}
    result = TraceResult()

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        result.graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=False)
    _mark_token_dim(args)
    start = time.perf_counter()
    counted = _break_counts()
    with collect_breaks() as collector, warnings.catch_warnings(), quiet_recompile_limit():
        warnings.simplefilter("ignore", UserWarning)  # Dynamo's per-break warnings: the report says it better
        try:
            run_under(context, lambda: compiled(*args, **kwargs))
        except Exception as err:  # a hard failure: keep what was collected and say where it stopped
            result.error = err
            collector.records.append(error_record(err))
    result.seconds = time.perf_counter() - start
    result.breaks = _merge(collector.records + _unlogged(counted, collector.records))
    torch._dynamo.reset()
    return result
