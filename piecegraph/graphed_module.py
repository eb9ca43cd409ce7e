"""``GraphedModule``: the object :func:`piecegraph.compile` returns."""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch

from .auto import setup_auto
from .binding import Binding, fresh_entry, scratch_arguments, static_suspect, trace_copies
from .config import Config
from .graphs.breakable import build_breakable_program
from .graphs.fallback import Advisor, NoAdvice
from .ops.prewarm import prewarm
from .ops.split import split_op_names
from .program import TokenCountMismatch, kept_buffers
from .runner import FlatRunner
from .trace.backend import build_program

log = logging.getLogger("piecegraph")


class _RegistrationWatch:
    """The live GraphedModules and torch's one global hook on parameter and buffer registration: a re-registered
    parameter must reach the GraphedModule whose graphs read the old one. Weak: it keeps nothing alive. The hooks
    are installed when the first GraphedModule is built, not at import."""

    def __init__(self) -> None:
        self.live: weakref.WeakSet[GraphedModule] = weakref.WeakSet()
        self.installed = False

    def watch(self, graphed: "GraphedModule") -> None:
        if not self.installed:
            torch.nn.modules.module.register_module_parameter_registration_hook(self._on_registration)
            torch.nn.modules.module.register_module_buffer_registration_hook(self._on_registration)
            torch.nn.modules.module.register_module_module_registration_hook(self._on_registration)
            self.installed = True
        self.live.add(graphed)

    def _on_registration(self, module: torch.nn.Module, name: str, value: Any) -> None:
        for graphed in list(self.live):
            if graphed._binding is not None and id(module) in graphed._modules_seen:
                graphed._stale = True


_WATCH = _RegistrationWatch()  # with the op registry, the package's only registries


class _CallLock:
    """Serializes calls of one GraphedModule: they share static buffers, graphs and the runner's state.

    Re-entrant (a model whose forward calls itself again does not deadlock); copied or pickled as a new lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def __reduce__(self) -> tuple:
        return (_CallLock, ())


class GraphedModule(torch.nn.Module):
    """A model traced once by Dynamo, split at its split ops, compiled per piece, replayed as CUDA graphs.

    Inference only: calls run under ``torch.no_grad()``. Calls from several threads are serialized (one at a
    time: they share static buffers and graphs), so they are safe but do not run in parallel. The first call
    traces (with the token dimension of every tensor argument marked dynamic), compiles and builds the runner;
    each capture size is captured on its first use, or all at once with :meth:`capture`. After the trace, calls
    skip Dynamo: the arguments are bound to the graph's inputs directly, so non-tensor arguments must keep their
    traced values (checked), and parameters are read where they lived at capture (moved ones are detected; see
    :meth:`recapture`).
    """

    def __init__(self, model: torch.nn.Module, config: Config, advisor: Advisor | None = None):
        super().__init__()
        self.model = model
        self.config = config
        self._call_lock = _CallLock()
        self._traced_training = model.training
        self._slots: list[tuple[dict, str, Any]] = []
        self._modules_seen: set[int] = set()
        self._advisor = advisor or NoAdvice()  # auto mode's fixes and blocker names (the doctor's, from compile())
        self._signature = inspect.signature(model.forward)
        self._runners: list[FlatRunner] = []
        self._compiled: Callable[..., Any] | None = None
        self._binding: Binding | None = None  # None: calls go through Dynamo (or the eager model)
        self._traced_counts: dict[str, int] = {}  # each tensor argument's dim token_dim at the trace
        self._stale = False
        _WATCH.watch(self)

    def __deepcopy__(self, memo: dict) -> GraphedModule:
        """A copy of the model, compiled anew on its first call (compiled code and graphs are not copied)."""
        return GraphedModule(copy.deepcopy(self.model, memo), self.config, self._advisor)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self._compiled is not None:
            raise TypeError(
                "a GraphedModule that has run holds compiled code and CUDA graphs, which cannot be pickled; pickle "
                "its .model (or its state_dict) and call piecegraph.compile again after loading"
            )
        return super().__reduce_ex__(protocol)

    @property
    def runner(self) -> FlatRunner:
        if not self._runners:
            raise RuntimeError("the model has not been traced yet: call it once (or call .capture(...))")
        return self._runners[-1]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = self._arguments(args, kwargs)
        with self._call_lock.lock, torch.no_grad():
            if self._compiled is not None and self._model_changed():
                log.warning("piecegraph: the model changed since it was traced (structure or train/eval mode); "
                            "tracing it again")
                self._reset()
            if self._compiled is None:
                try:
                    self._setup(values)
                except BaseException:
                    self._reset()  # a failed setup leaves the module as if it had never been called
                    raise
            if self._binding is None:
                return self._compiled(**values)
            try:
                return self._binding.pack(self.runner(*self._binding.flatten(values)))
            except TokenCountMismatch as err:
                if not self._retrace_with_static(values, err):
                    raise
            return self._binding.pack(self.runner(*self._binding.flatten(values)))

    def _retrace_with_static(self, values: dict[str, Any], err: TokenCountMismatch) -> bool:
        """A tensor taken for a token input on the first call (its dim ``token_dim`` happened to equal the token
        count, a (1, D) row at one token) kept its size while the first token input's changed: it is static.
        Trace again with it in ``Config.static_inputs``. Returns False when nothing explains the mismatch so."""
        labels = self.runner.names
        order = {name: i for i, name in enumerate(values)}
        # The first token argument (in the signature) defines the token count, as token_arguments() decides.
        first, *others = sorted(err.sizes, key=lambda i: order.get(labels[i], len(order)))
        if err.sizes[first] == self._traced_counts.get(labels[first]):
            return False  # the tokens kept their count: the other input is wrong, not static
        kept = {labels[i] for i in others if err.sizes[i] == self._traced_counts.get(labels[i])}
        if not kept or not kept <= set(values):
            return False
        log.warning("piecegraph: %s kept its size while the token count changed: a static input, not a token "
                    "input; tracing again with Config(static_inputs=%r)", ", ".join(sorted(kept)),
                    tuple(sorted(kept)))
        self.config = self.config.replace(static_inputs=tuple(self.config.static_inputs) + tuple(sorted(kept)))
        self._reset()
        try:
            self._setup(values)
        except BaseException:
            self._reset()
            raise
        return True

    def _model_changed(self) -> bool:
        """A trace is stale when the model switched train/eval mode or its parameters' structure changed.

        Registration hooks flag re-registered parameters, buffers and submodules; ``module.bias = None`` fires no
        hook, so every call also checks that each traced parameter's slot still holds it (one dict lookup each).
        """
        if self.model.training != self._traced_training:
            return True
        if self._binding is None:
            return False
        if not self._stale:
            for slots, key, value in self._slots:
                if slots.get(key) is not value:
                    self._stale = True
                    break
        return self._stale and not self._refresh_statics()

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name; a ``**kwargs`` parameter's entries are arguments of their own (the
        model is called as ``model(**values)``), and ``*args`` is refused: it has no names to bind."""
        bound = self._signature.bind(*args, **kwargs)
        values = dict(bound.arguments)
        for name, param in self._signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in values:
                values.update(values.pop(name))
            elif param.kind is inspect.Parameter.VAR_POSITIONAL and values.pop(name, ()):
                raise TypeError(
                    f"{type(self.model).__name__}.forward takes *{name}, which piecegraph cannot bind by name; pass "
                    "those tensors as named arguments (wrap the model in a module whose forward names them)"
                )
        return values

    # -- setup ------------------------------------------------------------------------------------------
    def _setup(self, values: dict[str, Any]) -> None:
        """Prewarm, trace (or probe), bind. Every run here is piecegraph's own: it runs on copies of the caller's
        tensors, and the model's buffers are restored afterwards, so the call that follows is the only one the
        caller's data and the model's visible state see."""
        mode = self.config.mode
        self._traced_training = self.model.training
        td = self.config.token_dim
        self._traced_counts = {k: v.shape[td] for k, v in values.items()
                               if isinstance(v, torch.Tensor) and v.dim() > td}
        split_op_names(self.config.split_ops)  # a misspelt split op fails here, in plain words, not inside Dynamo
        with kept_buffers(self.model):
            if self.config.prewarm:
                prewarm(self.model, **scratch_arguments(values))
            if mode == "breakable":  # no trace to see token-mixing ops in: verify unless told otherwise
                verify = True if self.config.verify is None else self.config.verify
                self._setup_breakable(values, self.config.replace(verify=verify))
            elif mode == "auto":
                self._setup_auto(values)
            else:
                self._trace(values, self.config)

    def _trace(self, values: dict[str, Any], config: Config, verify_sizes: float | None = None) -> None:
        """Trace with Dynamo once, build the program, and bind the call's arguments to the graph's inputs.

        ``verify_sizes``: how many captured sizes each runner verifies (default: the config's ``verify``)."""
        trace_values = trace_copies(values, config.token_dim, config.static_inputs)
        examples: list[list[Any]] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
            # The trace call itself runs the pieces without graphs; a recompile's runner captures at once.
            runner = FlatRunner(build_program(gm, example_inputs, config), config, tracing=not examples,
                                verify_sizes=verify_sizes)
            examples.append(list(example_inputs))
            self._runners.append(runner)
            return runner

        compiled = torch.compile(fresh_entry(), backend=backend, fullgraph=True, dynamic=False)
        model = self.model
        self._compiled = lambda **kw: compiled(model, kw)
        try:
            result = self._compiled(**trace_values)
        except Exception as err:  # noqa: BLE001  (Dynamo wraps the backend's error)
            static = static_suspect(err, values, config.token_dim, config.static_inputs)
            if static is None:
                raise
            log.warning("piecegraph: %s was taken for a token input (its dim %d equals the token count) but the "
                        "trace shows it is not; tracing again with Config(static_inputs=(%r,))", static,
                        config.token_dim, static)
            self._runners.clear()
            self.config = self.config.replace(static_inputs=(*self.config.static_inputs, static))
            return self._trace(values, config.replace(static_inputs=(*config.static_inputs, static)), verify_sizes)
        self.runner.end_trace()
        self._bind(examples[0], trace_values, result)

    def _setup_breakable(self, values: dict[str, Any], config: Config, graphs: bool | None = None) -> None:
        """No Dynamo: the eager model, captured in segments cut at split ops (see graphs/breakable.py)."""
        program = build_breakable_program(self.model, scratch_arguments(values), config)
        runner = FlatRunner(program, config, graphs=graphs)
        runner.stage_caller_statics(range(len(values)))  # every input is the caller's: none is a parameter
        self._runners.append(runner)
        self._compiled = self.model
        self._binding = Binding.of_arguments(values, program.single_output)
        self._modules_seen = set()

    def _setup_auto(self, values: dict[str, Any]) -> None:
        setup_auto(self.model, values, self.config, self._advisor, self._try_trace, self._setup_breakable)

    def _try_trace(self, values: dict[str, Any], config: Config, verify_sizes: float | None) -> Exception | None:
        try:
            self._trace(values, config, verify_sizes)
            return None
        except Exception as error:  # Dynamo raises many types; each is a reason to fall back, not to crash
            self._reset()
            return error

    def _reset(self) -> None:
        self._runners.clear()
        self._compiled = None
        self._binding = None

    def _bind(self, example_inputs: list[Any], trace_values: dict[str, Any], result: Any) -> None:
        """Map the graph's inputs to the call's arguments, so later calls can skip Dynamo's guards."""
        runner = self.runner
        program = runner.program
        binding = Binding.from_trace(example_inputs, program.names, program.kinds, trace_values, result,
                                     runner.last_outputs, self.config.token_dim)
        if binding is None:
            return
        runner.label_inputs(binding.labels())
        runner.stage_caller_statics(binding.caller_indices())
        self._binding = binding
        self._modules_seen = {id(m) for m in self.model.modules()}
        self._slots = self._parameter_slots()

    # -- weights ----------------------------------------------------------------------------------------
    def _refresh_statics(self) -> bool:
        """Re-read parameters and buffers by their Dynamo source names after one (or a submodule) was
        re-registered. Returns False when the model's structure changed (a parameter gone, a submodule of another
        kind, a shape or dtype changed): the trace no longer describes the model and must be redone."""
        self._stale = False
        changed = []
        for bound in self._binding.module_inputs().values():
            name, old = bound.name, bound.value
            if not name.startswith("L['model']"):
                continue
            try:
                current = self._follow(name)
            except Exception:  # noqa: BLE001  (the path is gone: a submodule replaced by another kind)
                return False
            if current is old:
                continue
            if not isinstance(current, torch.Tensor) or (current.shape, current.dtype, current.device) != (
                    old.shape, old.dtype, old.device):
                return False
            bound.value = current
            changed.append(name)
        if changed:
            log.warning("piecegraph: %d parameters/buffers were replaced (%s...); capturing again", len(changed),
                        changed[0])
            for runner in self._runners:
                runner.drop_graphs()
        self._modules_seen = {id(m) for m in self.model.modules()}  # a new submodule is watched from now on
        self._slots = self._parameter_slots()
        return True

    def _follow(self, source: str) -> Any:
        """The object a Dynamo source name reaches from the model, e.g. ``L['model']._modules['x']._parameters``."""
        return eval(source, {"__builtins__": {}}, {"L": {"model": self.model}})

    def _parameter_slots(self) -> list[tuple[dict, str, Any]]:
        """``(module._parameters or _buffers, name, tensor)`` of every traced parameter and buffer."""
        slots = []
        for bound in self._binding.module_inputs().values():
            container, _, key = bound.name.rpartition("[")
            if not bound.name.startswith("L['model']") or not container.endswith(("._parameters", "._buffers")):
                continue
            try:
                slots.append((self._follow(container), key.strip("]'\""), bound.value))
            except Exception:  # noqa: BLE001  (a name we cannot follow is watched by the hooks alone)
                continue
        return slots

    def recapture(self) -> None:
        """Drop every captured graph (after replacing weights); sizes capture again on their next use."""
        if self._binding is not None:
            self._refresh_statics()
        for runner in self._runners:
            runner.drop_graphs()

    def capture(self, make_inputs: Callable[[int], tuple[tuple[Any, ...], Any]],
                sizes: Iterable[int] | None = None) -> dict[int, float]:
        """Capture ``sizes`` (default: all capture sizes), largest first, into the shared pool.

        ``make_inputs(n)`` returns ``(args, context)``: the forward's arguments for ``n`` tokens and the forward
        context metadata to run them with (``None`` for none). Dummy values are fine as long as the split ops
        accept them. Returns the seconds each size took.
        """
        from .context import forward_context

        sizes = sorted(sizes or self.config.sizes, reverse=True)
        for n in sizes:
            args, meta = make_inputs(n)
            with forward_context(meta) if meta is not None else contextlib.nullcontext():
                self(*args)
        return {s: self.runner.capture_s.get(s, 0.0) for s in sizes}

    @contextlib.contextmanager
    def without_graphs(self) -> Iterator[None]:
        """Run the same compiled pieces without graphs inside the block (debugging, references)."""
        with contextlib.ExitStack() as stack:
            for runner in self._runners:
                stack.enter_context(runner.graphs_off())
            yield

    def stats(self) -> dict[str, Any]:
        """``sizes``, ``pieces``, ``capture_s`` per size, ``pool_bytes``, ``replays``, ``fallbacks`` and more."""
        stats = self.runner.stats()
        stats["recompiles"] = len(self._runners) - 1
        return stats
