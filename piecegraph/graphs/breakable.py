"""Dynamo-free capture: the eager forward under stream capture, cut into segments at split ops.

For models Dynamo cannot trace at all. The forward runs once per size under a dispatch mode that watches every
op: a split op (or a function marked :func:`no_graph`) ends the current CUDA graph segment, runs eagerly with
real values, and starts the next segment. Replay needs no Python model code: replay segment, call the recorded
op on its recorded arguments, replay the next segment, and so on. Graphs are kept; Inductor's fusion is not.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from ..ops.split import op_name
from ..program import CaptureState, InputKind, Phase, Program, kept_buffers, token_arguments
from .capture import copy_into, repair_rng_after_failed_capture, weak_alias

_RECORDER: contextvars.ContextVar["_Recorder | None"] = contextvars.ContextVar("piecegraph_breakable", default=None)


class BreakableCaptureError(RuntimeError):
    """A split op or no_graph function did something a breakable graph cannot replay."""


def no_graph(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` to run eagerly between captured segments in ``mode="breakable"`` (a no-op elsewhere).

    At replay ``fn`` is called again with the tensors it got at capture (now holding the new values); tensors it
    returns are copied into the ones it returned at capture, which is where the next segment reads them. So
    ``fn`` must not depend on anything but its arguments, and must return tensors of fixed shape per size.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        recorder = _RECORDER.get()
        if recorder is None or recorder.eager:
            return fn(*args, **kwargs)
        return recorder.call_eager(fn, args, kwargs, copy_outputs=True)

    wrapper.__piecegraph_no_graph__ = True  # type: ignore[attr-defined]
    return wrapper


@dataclass
class _Step:
    graph: Any = None  # a CUDA graph segment, or None for an eager call
    fn: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    outputs: Any = None
    copy_outputs: bool = False


class _Recorder:
    def __init__(self, state: CaptureState):
        self.state = state
        self.steps: list[_Step] = []
        self.graph: Any = None
        self.eager = False

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.state.pool)

    def end(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.graph.capture_end()
        graph, self.graph = self.graph, None
        if any("empty" in str(w.message) for w in caught):
            return  # two breaks in a row: nothing to replay (an empty graph refuses to replay)
        graph.replay()  # capture records without running: make the segment's values real
        self.steps.append(_Step(graph=graph))

    def abort(self) -> None:
        """Close a segment left open by an error, and repair the generator state a failed capture leaves."""
        if self.graph is not None:
            try:
                self.graph.capture_end()
            except Exception:  # the capture is already invalid: its own error is the one to report
                pass
            self.graph = None
        repair_rng_after_failed_capture()

    def call_eager(self, fn: Callable[..., Any], args: tuple, kwargs: dict, copy_outputs: bool) -> Any:
        self.end()
        self.eager = True
        try:
            out = fn(*args, **kwargs)
        finally:
            self.eager = False
        if not copy_outputs and any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
            raise BreakableCaptureError(
                f"split op {getattr(fn, '__name__', fn)} returned a new tensor while capturing mode='breakable'. "
                "The next segment would read it at a stale address: make the op write into an output buffer it is "
                "given (Tensor(a!) out), or wrap the call in a function marked piecegraph.no_graph."
            )
        self.steps.append(_Step(fn=fn, args=args, kwargs=kwargs, outputs=out, copy_outputs=copy_outputs))
        self.begin()
        return out


class _BreakAtSplitOps(TorchDispatchMode):
    def __init__(self, recorder: _Recorder, split_names: frozenset[str]):
        super().__init__()
        self.recorder = recorder
        self.split_names = split_names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if not self.recorder.eager and op_name(func) in self.split_names:
            return self.recorder.call_eager(func, args, kwargs, copy_outputs=False)
        return func(*args, **kwargs)


class BreakableProgram:
    """Runs the eager model per :class:`CaptureState` phase: eagerly, capturing segments, or replaying them.

    Returns the model's outputs as a tuple. ``flat`` are the model's positional arguments, already staged
    into static buffers by the runner.
    """

    name = "breakable"

    def __init__(self, model: torch.nn.Module, state: CaptureState, split_names: frozenset[str]):
        self.model = model
        self.state = state
        self.split_names = split_names
        self.captured: dict[int, tuple[list[_Step], Any]] = {}

    def __call__(self, *flat: Any) -> tuple[Any, ...]:
        phase = self.state.phase
        if phase is Phase.REPLAY:
            return self._replay(*self.captured[self.state.size], flat)
        if phase is Phase.CAPTURE:
            return self._capture(flat)
        return _as_tuple(self.model(*flat))

    def drop(self) -> None:
        self.captured.clear()

    def _capture(self, flat: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.state.emulate:  # no GPU: replay re-runs the whole eager forward on the captured buffers
            outputs = _as_tuple(self.model(*flat))
            steps = [_Step(fn=self.model, args=flat, outputs=outputs, copy_outputs=True)]
            self.captured[self.state.size] = (steps, outputs)
            return outputs
        recorder = _Recorder(self.state)
        token = _RECORDER.set(recorder)
        caller = torch.cuda.current_stream()
        self.state.stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self.state.stream):
                recorder.begin()
                try:
                    with _BreakAtSplitOps(recorder, self.split_names):
                        outputs = _as_tuple(self.model(*flat))
                except BaseException:
                    recorder.abort()
                    raise
                recorder.end()
        finally:
            _RECORDER.reset(token)
            caller.wait_stream(self.state.stream)
        steps = [_weak_step(step) for step in recorder.steps]
        self.captured[self.state.size] = (steps, tree_map_only(torch.Tensor, weak_alias, outputs))
        return outputs

    @staticmethod
    def _replay(steps: list[_Step], outputs: Any, flat: tuple[Any, ...]) -> tuple[Any, ...]:
        for step in steps:
            if step.graph is not None:
                step.graph.replay()
                continue
            fresh = step.fn(*step.args, **step.kwargs)
            if step.copy_outputs:
                copy_into(step.outputs, fresh)
        return outputs


def _weak_step(step: _Step) -> _Step:
    if step.graph is not None:
        return step
    alias = functools.partial(tree_map_only, torch.Tensor, weak_alias)
    return _Step(None, step.fn, alias(step.args), alias(step.kwargs), alias(step.outputs), step.copy_outputs)


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def build_breakable_program(model: torch.nn.Module, values: dict[str, Any], config: Any) -> Any:
    """A :class:`~piecegraph.program.Program` over the eager ``model`` for ``mode="breakable"``.

    ``values`` are one call's arguments by name (bound positionally at every call). Token inputs are chosen by
    :func:`~piecegraph.program.token_arguments`; the model runs once here, eagerly, to learn
    which outputs carry the token dimension.
    """
    from ..ops.split import split_op_names

    td = config.token_dim
    tokens = token_arguments(values, td, config.static_inputs)
    if not tokens:
        raise ValueError(f"mode='breakable' needs at least one tensor argument with a token dimension {td}")
    n = values[next(k for k in values if k in tokens)].shape[td]
    kinds = [InputKind.TOKENS if k in tokens else InputKind.STATIC for k in values]
    state = CaptureState.for_config(config)
    program = BreakableProgram(model, state, split_op_names(config.split_ops))
    with torch.no_grad():
        result = model(*values.values())
    outputs = _as_tuple(result)
    token_outputs = [isinstance(o, torch.Tensor) and o.dim() > td and o.shape[td] == n for o in outputs]
    return Program(
        call=program, state=state, pieces=[program], infos=[], kinds=kinds, token_outputs=token_outputs,
        dynamic=True, names=list(values), single_output=not isinstance(result, (tuple, list)),
        keep_state=lambda: kept_buffers(model),
    )
