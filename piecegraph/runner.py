"""Run a compiled program at any token count: buckets, static buffers, padding, capture, replay, fallback."""

from __future__ import annotations

import bisect
import contextlib
import logging
import warnings
from typing import Any, Iterator, Sequence

import torch

from .config import Config
from .context import current_forward_context, override_forward_context
from .graphs.capture import GraphPool, capture_session, pool_bytes, timed_capture
from .graphs.static_context import StaticContext
from .graphs.verify import dropped_warning, rel_error, rolled_token_inputs, verify_tolerance
from .program import ArgSpec, InputKind, Phase, Program, TokenCountMismatch

log = logging.getLogger("piecegraph")


class FlatRunner:
    """Calls a :class:`Program` with Dynamo's flat inputs, choosing a captured size per call.

    A call with ``n`` tokens uses the smallest capture size ``s >= n``: token inputs are copied into static
    buffers (allocated once, at the largest size), rows ``n..s`` are zeroed, the size's graphs are captured on
    first use (after ``config.warmup_runs`` eager runs) or replayed, and outputs are cut back to ``n`` rows
    (copied unless ``config.copy_outputs`` is False). Above the largest size the compiled pieces run without
    graphs, unpadded.

    Built with everything it decides by: ``tracing`` (the first call is the trace itself: no graphs, until
    :meth:`end_trace`), ``graphs`` (default: the mode captures graphs), ``verify_sizes`` (how many captured sizes
    to verify, default every one when ``config.verify``, else none) and ``names`` (inputs' labels in errors,
    refined by :meth:`label_inputs`).
    """

    def __init__(self, program: Program, config: Config, names: Sequence[str] | None = None, *,
                 tracing: bool = False, graphs: bool | None = None, verify_sizes: float | None = None):
        self.program = program
        self.config = config
        self.names = list(names or program.names)
        self.state = program.state
        self.token_idx = [i for i, k in enumerate(program.kinds) if k is InputKind.TOKENS]
        self.count_idx = [i for i, k in enumerate(program.kinds) if k is InputKind.COUNT]
        self.sizes: tuple[int, ...] = config.sizes if program.dynamic else ()
        self.buffers: list[torch.Tensor] | None = None
        self.capture_s: dict[int, float] = {}
        self.replays = 0
        self.fallbacks = 0
        self.caller_static_idx: list[int] = []  # static inputs the caller passes (not parameters): staged too
        self.stage_caller_statics(program.caller_inputs)
        self.caller_statics: dict[int, torch.Tensor] = {}
        self.caller_static_specs: dict[int, ArgSpec] = {}
        self.buffer_specs: list[ArgSpec] = []
        self.tracing = tracing
        self.graphs = config.mode in ("piecewise", "full", "breakable") if graphs is None else graphs
        self.verify_left = (float("inf") if config.verify else 0) if verify_sizes is None else verify_sizes
        # Verifying every size also checks each size's first padded call (a size first met exactly was not).
        self.verify_padded = self.verify_left == float("inf")
        self.padded_checked: set[int] = set()
        self.dropped: dict[int, float] = {}  # sizes whose replay disagreed with the no-graph run
        self.static_context = StaticContext(max(self.sizes, default=1)) if config.mode == "full" else None
        self.last_outputs: tuple[Any, ...] | None = None
        self.written: set[int] = set(program.mutated_inputs)  # inputs seen written: copied back to the caller
        # Padding would change an op's result: only exact capture sizes replay (trace/mixing.py says which op).
        self.exact_sizes = bool(program.token_mixing)
        if self.exact_sizes and self.graphs and not tracing:
            self._warn_exact()

    # -- the call ---------------------------------------------------------------------------------------
    def __call__(self, *flat: Any) -> Any:
        if not self.token_idx:
            return self._run(flat)
        n = self._num_tokens(flat)
        if self.count_idx:
            flat = list(flat)
            for i in self.count_idx:
                flat[i] = n
        if self.tracing or not self.graphs or (self.buffers is None and not self._graphs_possible(flat)):
            return self._run(flat)
        if not self.sizes:  # a static graph: its one size is the traced one
            self.sizes = (n,)
            self.static_context = StaticContext(n) if self.static_context is not None else None
        pos = bisect.bisect_left(self.sizes, n)
        if pos == len(self.sizes):
            self.fallbacks += 1
            return self._run(flat)
        size = self.sizes[pos]
        if size in self.dropped or (self.exact_sizes and size != n):
            self.fallbacks += 1
            return self._run(flat)
        padded = self._stage(flat, n, size)
        if size in self.capture_s:
            if n < size and self.verify_padded and size not in self.padded_checked:
                self._verify_padded(flat, padded, n, size)
                if size in self.dropped:
                    return self._finish(self._run(flat), n)
                padded = self._stage(flat, n, size)
            outputs = self._replay(padded, n, size)
        else:
            self._first_use(flat, padded, n, size)
            if size in self.dropped:  # verification failed: unpadded, on the caller's tensors
                return self._finish(self._run(flat), n)
            replays = self.replays
            outputs = self._replay(self._stage(flat, n, size), n, size)
            self.replays = replays  # the capturing call is not counted as a replay
        self._write_back(flat, padded, n)
        return self._finish(outputs, n)

    def _run(self, flat: Sequence[Any]) -> Any:
        self.state.phase = Phase.RUN
        outputs = self.program.call(*flat)
        self.last_outputs = tuple(outputs)
        return outputs

    def _num_tokens(self, flat: Sequence[Any]) -> int:
        td = self.config.token_dim
        first = self.token_idx[0]
        counts = []
        for i in self.token_idx:
            x = flat[i]
            if not isinstance(x, torch.Tensor) or x.dim() <= td:
                raise ValueError(f"input {self.names[i]} must be a tensor with a token dimension {td}")
            counts.append(x.shape[td])
        n = counts[0]
        for i, c in zip(self.token_idx, counts):
            if c != n:
                raise TokenCountMismatch(
                    f"inputs {self.names[first]} and {self.names[i]} disagree on the token count "
                    f"(dim {td}: {n} vs {c}); every token input needs the same number of rows. If "
                    f"{self.names[i]} is not token-aligned (a memory, a table), name it in "
                    f"Config(static_inputs=({self.names[i]!r},))",
                    dict(zip(self.token_idx, counts)),
                )
        if n == 0:
            raise ValueError(f"input {self.names[first]} has no tokens (dim {td} is 0)")
        return n

    def _graphs_possible(self, flat: Sequence[Any]) -> bool:
        """Checked once, before the static buffers exist: they then pin the device (``buffer_specs``)."""
        x = flat[self.token_idx[0]]
        if x.is_cuda or self.config.emulate_graphs:
            return True
        warnings.warn(
            f"piecegraph: mode={self.config.mode!r} captures CUDA graphs, but input {self.names[self.token_idx[0]]}"
            f" is on {x.device}; running the compiled pieces without graphs (mode='none').",
            stacklevel=3,
        )
        self.graphs = False
        return False

    # -- staging ----------------------------------------------------------------------------------------
    def _stage(self, flat: Sequence[Any], n: int, size: int) -> list[Any]:
        td = self.config.token_dim
        if self.buffers is None:
            largest = self.sizes[-1]
            self.buffers = [_buffer_like(flat[i], td, largest) for i in self.token_idx]
            # The buffers pin dtype, device and every size but the token count from now on.
            self.buffer_specs = [ArgSpec.of(self.names[i], buf, td) for i, buf in zip(self.token_idx, self.buffers)]
        padded = list(flat)
        for i, buf, spec in zip(self.token_idx, self.buffers, self.buffer_specs):
            x = flat[i]
            spec.check(x)
            buf.narrow(td, 0, n).copy_(x)
            if size > n:
                buf.narrow(td, n, size - n).zero_()  # garbage in pad rows can leak NaN into real rows
            padded[i] = buf.narrow(td, 0, size)
        for i in self.count_idx:
            padded[i] = size
        for i in self.caller_static_idx:  # graphs read our copy: a new tensor next call is copied in, not theirs
            x = flat[i]
            if isinstance(x, torch.Tensor):
                if i not in self.caller_statics:  # once: graphs bake this buffer's address in
                    self.caller_statics[i] = torch.empty_like(x, memory_format=torch.contiguous_format)
                    self.caller_static_specs[i] = ArgSpec.of(self.names[i], x, None)
                self.caller_static_specs[i].check(x)
                self.caller_statics[i].copy_(x)
                padded[i] = self.caller_statics[i]
        return padded

    def _save_written(self, padded: Sequence[Any]) -> dict[int, torch.Tensor]:
        """Copies of the inputs the program may write in place, before a size's extra runs: those the trace
        shows written (trace/mutation.py); for a program over an eager model, every staged input (its module
        state is kept by ``program.keep_state``)."""
        idx = set(self.program.mutated_inputs)
        if self.program.keep_state is not None:
            idx |= set(self.token_idx) | set(self.caller_static_idx)
        return {i: padded[i].clone() for i in sorted(idx) if isinstance(padded[i], torch.Tensor)}

    def _extra_runs(self) -> contextlib.AbstractContextManager[None]:
        keep = self.program.keep_state
        return keep() if keep is not None else contextlib.nullcontext()

    @staticmethod
    def _restore(padded: Sequence[Any], saved: dict[int, torch.Tensor]) -> None:
        for i, value in saved.items():
            padded[i].copy_(value)

    def _write_back(self, flat: Sequence[Any], padded: Sequence[Any], n: int) -> None:
        """The model wrote a token input or a caller static in place: so does this call, into the caller's
        tensor, as eager would (the graphs wrote piecegraph's staged copy)."""
        td = self.config.token_dim
        for i in self.written:
            if i in self.token_idx:
                flat[i].narrow(td, 0, n).copy_(padded[i].narrow(td, 0, n))
            elif i in self.caller_static_idx and isinstance(flat[i], torch.Tensor):
                flat[i].copy_(padded[i])

    # -- capture and replay -----------------------------------------------------------------------------
    def _capture(self, padded: list[Any], n: int, size: int, saved: dict[int, torch.Tensor]) -> Any:
        if not self.config.emulate_graphs and self.state.stream is None:
            # One pool and one side stream for every size: captured largest first, sizes share memory.
            self.state.pool, self.state.stream = (self.config.pool or GraphPool()).acquire()
        meta = current_forward_context()
        if self.static_context is not None and meta is not None:
            meta = self.static_context.for_capture(meta, n, size)

        def capture() -> Any:
            with override_forward_context(meta), (
                capture_session() if torch.cuda.is_available() else contextlib.nullcontext()
            ):
                self.state.size = size
                for _ in range(self.config.warmup_runs):
                    self.state.phase = Phase.WARMUP
                    self.program.call(*padded)
                versions = _versions(padded, saved)
                self.state.phase = Phase.CAPTURE
                try:
                    return self.program.call(*padded)
                finally:
                    self.state.phase = Phase.RUN
                    self.written |= {i for i, v in versions.items() if padded[i]._version != v}

        outputs, seconds = timed_capture(capture)
        self.capture_s[size] = seconds
        log.info("piecegraph: captured size %d in %.3f s", size, seconds)
        return outputs

    def _replay(self, padded: list[Any], n: int, size: int) -> Any:
        meta = current_forward_context()
        if self.static_context is not None:
            if size not in self.static_context.captured:
                meta = None  # captured without a context: the graph reads none, so there is nothing to refill
            elif meta is None:
                raise ValueError(
                    f"mode='full': size {size} was captured with a forward context and is now called without one; "
                    "the graph would replay the captured metadata. Call it inside "
                    "`with piecegraph.forward_context(meta):`, or call recapture() to capture it anew."
                )
        if self.static_context is not None and meta is not None:
            self.static_context.for_replay(meta, n, size)
            meta = self.static_context.captured[size][0]  # what an emulated replay's split ops must read
        self.state.size = size
        self.state.phase = Phase.REPLAY
        try:
            with override_forward_context(meta):
                outputs = self.program.call(*padded)
        finally:
            self.state.phase = Phase.RUN
        self.replays += 1
        return outputs

    def _finish(self, outputs: Sequence[Any], n: int) -> tuple[Any, ...]:
        td = self.config.token_dim
        result = []
        for out, is_token in zip(outputs, self.program.token_outputs):
            if isinstance(out, torch.Tensor):
                if is_token:
                    out = out.narrow(td, 0, n)
                if self.config.copy_outputs:
                    out = out.clone()
            result.append(out)
        self.last_outputs = tuple(result)
        return self.last_outputs

    def _first_use(self, flat: Sequence[Any], padded: list[Any], n: int, size: int) -> None:
        """Capture ``size`` (after its warm-up runs) and verify it if asked. Every run here is piecegraph's own:
        inputs the program writes and, for an eager model, its buffers are restored afterwards, so the replay
        that follows is the call's only run."""
        saved = self._save_written(padded)
        with self._extra_runs():
            self._capture(padded, n, size, saved)
            self._restore(padded, saved)
            if self.verify_left > 0:
                self.verify_left -= 1
                self._verify(flat, n, size, saved)
                self._restore(padded, saved)
                if n < size:
                    self.padded_checked.add(size)

    def _verify_padded(self, flat: Sequence[Any], padded: list[Any], n: int, size: int) -> None:
        """The first padded call of a size that was captured (and verified) at exactly its size."""
        self.padded_checked.add(size)
        saved = self._save_written(padded)
        with self._extra_runs():
            self._verify(flat, n, size, saved)
            self._restore(padded, saved)

    def _verify(self, flat: Sequence[Any], n: int, size: int, saved: dict[int, torch.Tensor]) -> None:
        """Replay ``size`` on token inputs rolled by one row and compare with the same program without graphs,
        unpadded (``n`` rows), both from the same state. On a mismatch beyond ``config.verify_tol`` the size is
        dropped (its graphs freed, later calls run without a graph) and a warning names it. Verification
        replays are not counted."""
        td = self.config.token_dim
        replays = self.replays
        rolled = rolled_token_inputs(flat, self.token_idx, n, td)
        staged = self._stage(rolled, n, size)
        with self._extra_runs():
            replayed = [o.clone() if isinstance(o, torch.Tensor) else o for o in self._replay(staged, n, size)]
        self._restore(staged, saved)
        self.replays = replays
        # Against the unpadded run: a padded reference would hide an op that mixes pad rows into real ones.
        with self._extra_runs():
            error = rel_error(replayed, self._run(rolled), n, td, self.program.token_outputs)
        tol = verify_tolerance(self.config.verify_tol, replayed)
        if error <= tol:
            log.info("piecegraph: verified size %d (rel. error %.2e)", size, error)
            return
        self.dropped[size] = error
        self.capture_s.pop(size, None)
        for piece in self.program.pieces:
            piece.captured.pop(size, None)
        warnings.warn(dropped_warning(size, error, tol), stacklevel=6)

    # -- management -------------------------------------------------------------------------------------
    def end_trace(self) -> None:
        """The trace call is over: later calls capture and replay."""
        self.tracing = False
        if self.exact_sizes and self.graphs:
            self._warn_exact()

    def _warn_exact(self) -> None:
        ops = self.program.token_mixing
        more = f" and {len(ops) - 1} more" if len(ops) > 1 else ""
        warnings.warn(
            f"piecegraph: an op outside the split ops mixes rows over the token dimension, so padding a call to a "
            f"capture size would change its result: {ops[0]}{more}. Only calls of exactly "
            f"{list(self.sizes) or 'the traced'} tokens use graphs; other token counts run the compiled pieces "
            "unpadded. Config(token_mixing='error') refuses such models instead.",
            stacklevel=2,
        )

    def label_inputs(self, names: Sequence[str]) -> None:
        """Name the inputs after the caller's arguments (error messages say ``input_ids``, not ``L['x']``)."""
        self.names = list(names)

    def stage_caller_statics(self, indices: Sequence[int]) -> None:
        """Static inputs at ``indices`` come from the caller (a temperature, a table): graphs capture piecegraph's
        copy of them, refilled every call, so a fresh tensor per call is read and the caller's is never written."""
        self.caller_static_idx = [i for i in indices if i not in self.token_idx and i not in self.count_idx]

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
        for piece in self.program.pieces:
            piece.drop()
        self.capture_s.clear()
        if self.static_context is not None:
            self.static_context.captured.clear()

    def stats(self) -> dict[str, Any]:
        pool = 0 if self.config.emulate_graphs else pool_bytes(self.state.pool)
        return {
            "mode": self.config.mode if self.graphs else "none",
            "sizes": sorted(self.capture_s),
            "pieces": self.program.num_pieces,
            "split_ops": sum(1 for info in self.program.infos if info.is_split),
            "capture_s": dict(sorted(self.capture_s.items())),
            "pool_bytes": pool,
            "replays": self.replays,
            "fallbacks": self.fallbacks,
            "moved_inputs": self.state.moved_inputs,
            "dropped_sizes": dict(self.dropped),
            "token_mixing": [str(op) for op in self.program.token_mixing],
        }


def _versions(padded: Sequence[Any], saved: dict[int, torch.Tensor]) -> dict[int, int]:
    """Version counters of the saved inputs: an in-place write bumps them, even when it is only recorded."""
    return {i: padded[i]._version for i in saved}


def _buffer_like(x: torch.Tensor, td: int, largest: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[td] = largest
    return torch.zeros(shape, dtype=x.dtype, device=x.device)

