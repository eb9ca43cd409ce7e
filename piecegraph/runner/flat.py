"""Run a compiled program at any token count: each call staged (staging.py), given a capture size (sizes.py),
replayed (replay.py) and its outputs cut back to the call's tokens (outputs.py), or run without a graph."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Sequence

import torch

from ..config import Config
from ..graphs.capture import pool_bytes
from ..graphs.memory import GraphMemory, GraphMemoryError, fit_sizes
from ..program import Program
from .outputs import cut_to_tokens
from .replay import Replayer
from .sizes import SizeTable
from .staging import Staging


class FlatRunner:
    """Calls a :class:`Program` with Dynamo's flat inputs, choosing a captured size per call.

    A call with ``n`` tokens uses the smallest capture size ``s >= n``: token inputs are copied into static
    buffers (allocated once, at the largest size), rows ``n..s`` are zeroed, the size's graphs are captured on
    first use (after ``config.warmup_runs`` eager runs) or replayed, and outputs are cut back to ``n`` rows
    (copied unless ``config.copy_outputs`` is False). Above the largest size the compiled pieces run without
    graphs, unpadded.

    Built with everything it decides by: ``tracing`` (the first call is the trace itself: no graphs, until
    :meth:`end_trace`), ``graphs`` (default: the mode captures graphs), ``verify_sizes`` (how many captured sizes
    to verify, default every one when ``config.verify``, else none), ``names`` (inputs' labels in errors,
    refined by :meth:`label_inputs`) and ``memory`` (the graphs' estimated memory per size: sizes over
    ``config.graph_memory_limit`` are left out, and none fitting is refused at the first graphed call).
    """

    def __init__(self, program: Program, config: Config, names: Sequence[str] | None = None, *,
                 tracing: bool = False, graphs: bool | None = None, verify_sizes: float | None = None,
                 memory: GraphMemory | None = None):
        self.program = program
        self.config = config
        self.state = program.state
        self.staging = Staging(program, config.token_dim, names or program.names)
        self.graphs = config.mode in ("piecewise", "full", "breakable") if graphs is None else graphs
        self.memory = memory
        sizes, self.refusal = config.sizes if program.dynamic else (), None
        if memory is not None and config.graph_memory_limit is not None and sizes and self.graphs:
            sizes, self.refusal = fit_sizes(memory, sizes, config.graph_memory_limit)
        # Padding would change an op's result: only exact capture sizes replay (trace/mixing.py says which op).
        self.table = SizeTable(sizes, exact=bool(program.token_mixing))
        self.replayer = Replayer(program, config, self.staging, self.table, verify_sizes, memory)
        self.fallbacks = 0
        self.tracing = tracing
        self.last_outputs: tuple[Any, ...] | None = None
        if self.table.exact and self.graphs and not tracing:
            self._warn_exact()

    # -- what callers read (the parts own it) -----------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Each input's label in messages."""
        return self.staging.names

    @property
    def buffers(self) -> list[torch.Tensor] | None:
        """The token inputs' static buffers (``None`` until the first graphed call)."""
        return self.staging.buffers

    @property
    def capture_s(self) -> dict[int, float]:
        """Captured sizes: the seconds each capture took."""
        return self.table.capture_s

    @property
    def replays(self) -> int:
        return self.replayer.replays

    @property
    def verify_left(self) -> float:
        """How many more captured sizes will be verified."""
        return self.replayer.verify_left

    # -- the call ---------------------------------------------------------------------------------------
    def __call__(self, *flat: Any) -> Any:
        if not self.staging.token_idx:
            return self._run(flat)
        n = self.staging.num_tokens(flat)
        flat = self.staging.with_count(flat, n)
        if self.tracing or not self.graphs or (self.staging.buffers is None and not self._graphs_possible(flat)):
            return self._run(flat)
        if self.refusal is not None:
            raise GraphMemoryError(self.refusal)
        if not self.table.sizes:  # a static graph: its one size is the traced one
            self.replayer.set_static(n)
        size = self.table.bucket(n)
        if size is None:
            self.fallbacks += 1
            return self._run(flat)
        outputs = self.replayer.call(flat, n, size)
        if outputs is None:  # verification dropped the size: unpadded, on the caller's tensors
            outputs = self._run(flat)
        return self._finish(outputs, n)

    def _run(self, flat: Sequence[Any]) -> Any:
        outputs = self.replayer.run(flat)
        self.last_outputs = tuple(outputs)
        return outputs

    def _finish(self, outputs: Sequence[Any], n: int) -> tuple[Any, ...]:
        self.last_outputs = cut_to_tokens(outputs, n, self.config.token_dim, self.program.token_outputs,
                                          self.config.copy_outputs)
        return self.last_outputs

    def _graphs_possible(self, flat: Sequence[Any]) -> bool:
        """Checked once, before the static buffers exist: they then pin the device (``buffer_specs``)."""
        first = self.staging.token_idx[0]
        x = flat[first]
        if x.is_cuda or self.config.emulate_graphs:
            return True
        warnings.warn(
            f"piecegraph: mode={self.config.mode!r} captures CUDA graphs, but input {self.names[first]}"
            f" is on {x.device}; running the compiled pieces without graphs (mode='none').",
            stacklevel=3,
        )
        self.graphs = False
        return False

    # -- management -------------------------------------------------------------------------------------
    def end_trace(self) -> None:
        """The trace call is over: later calls capture and replay."""
        self.tracing = False
        if self.table.exact and self.graphs:
            self._warn_exact()

    def _warn_exact(self) -> None:
        ops = self.program.token_mixing
        more = f" and {len(ops) - 1} more" if len(ops) > 1 else ""
        warnings.warn(
            f"piecegraph: an op outside the split ops mixes rows over the token dimension, so padding a call to a "
            f"capture size would change its result: {ops[0]}{more}. Only calls of exactly "
            f"{list(self.table.sizes) or 'the traced'} tokens use graphs; other token counts run the compiled "
            "pieces unpadded. Config(token_mixing='error') refuses such models instead.",
            stacklevel=2,
        )

    def label_inputs(self, names: Sequence[str]) -> None:
        """Name the inputs after the caller's arguments (error messages say ``input_ids``, not ``L['x']``)."""
        self.staging.names = list(names)

    def stage_caller_statics(self, indices: Sequence[int]) -> None:
        """Static inputs at ``indices`` come from the caller (a temperature, a table): graphs capture piecegraph's
        copy of them, refilled every call, so a fresh tensor per call is read and the caller's is never written."""
        self.staging.set_caller_statics(indices)

    def disable_graphs(self) -> None:
        """Run the compiled pieces without graphs from now on (no CUDA here, say)."""
        self.graphs = False

    @contextlib.contextmanager
    def graphs_off(self) -> Iterator[None]:
        """Inside the block, the same compiled pieces without graphs (a reference for debugging)."""
        saved, self.graphs = self.graphs, False
        try:
            yield
        finally:
            self.graphs = saved

    def drop_graphs(self) -> None:
        """Forget every captured size; the next call of each size captures again."""
        self.replayer.drop_all()

    def stats(self) -> dict[str, Any]:
        pool = 0 if self.config.emulate_graphs else pool_bytes(self.state.pool)
        return {
            "mode": self.config.mode if self.graphs else "none",
            "sizes": sorted(self.capture_s),
            "pieces": self.program.num_pieces,
            # pieces with code of their own: the same program twice is compiled once (trace/same_pieces.py)
            "compiled_pieces": len({id(getattr(p, "fn", p)) for p in self.program.pieces}),
            "split_ops": sum(1 for info in self.program.infos if info.is_split),
            "capture_s": dict(sorted(self.capture_s.items())),
            "pool_bytes": pool,
            "replays": self.replays,
            "fallbacks": self.fallbacks,
            "moved_inputs": self.state.moved_inputs,
            "dropped_sizes": dict(self.table.dropped),
            "token_mixing": [str(op) for op in self.program.token_mixing],
            "static_compile_s": self.program.static_compile_s,
            "static_sizes": _static_choices(self.program.pieces),
            "graph_memory": self._memory_stats(),
        }

    def _memory_stats(self) -> dict[str, Any]:
        """The estimate before compiling (per size, and the pool: the largest kept size's) and the pool measured
        before the first capture (``pool_measured_bytes``, at ``measured_size``), for comparison with
        ``pool_bytes``, what capture used; sizes refused by the measurement (``over_limit``)."""
        measured = self.replayer.measured
        out: dict[str, Any] = {} if measured is None else {"pool_measured_bytes": measured[1],
                                                           "measured_size": measured[0]}
        if self.table.over_limit:
            out["over_limit"] = dict(self.table.over_limit)
        if self.memory is None:
            return out
        kept = [s for s in self.table.sizes if s in self.memory.pool and s not in self.table.over_limit]
        return {"estimate_bytes": dict(self.memory.pool), "live_bytes": dict(self.memory.live),
                "pool_estimate_bytes": max((self.memory.pool[s] for s in kept), default=0),
                "workspace_bytes": self.memory.workspace_bytes,
                "left_out": sorted(set(self.memory.pool) - set(self.table.sizes)),
                "limit": self.config.graph_memory_limit, **out}


def _static_choices(pieces: Sequence[Any]) -> dict[int, dict[str, Any]]:
    """Per size with static code (Config.compile_sizes): how many pieces captured it, and the timings."""
    out: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        for size, choice in getattr(piece, "choice", {}).items():
            entry = out.setdefault(size, {"static": 0, "dynamic": 0, "ms": {}})
            entry[choice] += 1
            if size in piece.timings:
                entry["ms"][piece.name] = piece.timings[size]
    return dict(sorted(out.items()))

