"""Capture and replay of a program's capture sizes: a size captured on first use (after its warm-up runs),
verified if asked (and dropped when its replay disagrees with the program run without graphs), replayed after."""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any, Sequence

import torch

from ..config import Config
from ..context import current_forward_context, override_forward_context
from ..graphs.capture import GraphPool, capture_session, timed_capture
from ..graphs.memory import GraphMemory, measured_pool_bytes
from ..graphs.static_context import StaticContext
from ..graphs.verify import dropped_warning, rel_error, rolled_token_inputs, verify_tolerance
from ..program import Phase, Program
from .sizes import SizeTable
from .staging import Staging

log = logging.getLogger("piecegraph")


class Replayer:
    """Runs a program's graphs for one size at a time; the runner picks the size (:class:`SizeTable`).

    ``verify_sizes``: how many captured sizes to verify (default every one when ``config.verify``, else none).
    Every run but the call's one replay is piecegraph's own (warm-up, capture, verification): the inputs the
    program writes and, for an eager model, its buffers are restored after them. ``mode="full"`` graphs also
    capture the forward context, kept in a :class:`StaticContext` refilled before each replay.
    """

    def __init__(self, program: Program, config: Config, staging: Staging, table: SizeTable,
                 verify_sizes: float | None = None, memory: GraphMemory | None = None):
        self.program = program
        self.config = config
        self.state = program.state
        self.staging = staging
        self.table = table
        self.replays = 0
        self.verify_left = (float("inf") if config.verify else 0) if verify_sizes is None else verify_sizes
        # Verifying every size also checks each size's first padded call (a size first met exactly was not).
        self.verify_padded = self.verify_left == float("inf")
        self.static_context = StaticContext(max(table.sizes, default=1)) if config.mode == "full" else None
        self.memory = memory  # the estimate before compiling (its cuBLAS workspace is added to the measurement)
        self.measured: tuple[int, int] | None = None  # (size, graph pool bytes) measured before its capture

    def set_static(self, n: int) -> None:
        """A static trace's one size is ``n`` (the first graphed call's token count)."""
        self.table.set_static(n)
        if self.static_context is not None:
            self.static_context = StaticContext(n)

    def run(self, flat: Sequence[Any]) -> Any:
        """The program without graphs, on ``flat`` as it is (unpadded)."""
        self.state.phase = Phase.RUN
        return self.program.call(*flat)

    def call(self, flat: Sequence[Any], n: int, size: int) -> Any | None:
        """The outputs of ``size``'s graphs for a call of ``n`` tokens (captured first on its first use), the
        model's in-place writes copied back to the caller; ``None`` when verifying ``size`` just dropped it, or
        its measured graph pool is over ``graph_memory_limit`` (the call then runs without a graph)."""
        padded = self._stage(flat, n, size)
        if self.table.is_captured(size):
            if n < size and self.verify_padded and size not in self.table.padded_checked:
                self._verify_padded(flat, padded, n, size)
                if size in self.table.dropped:
                    return None
                padded = self._stage(flat, n, size)
            outputs = self.replay(padded, n, size)
        else:
            self._first_use(flat, padded, n, size)
            if self.table.without_graph(size):
                return None
            outputs = self.replay(self._stage(flat, n, size), n, size, count=False)  # the capturing call
        self.staging.write_back(flat, padded, n)
        return outputs

    def _stage(self, flat: Sequence[Any], n: int, size: int) -> list[Any]:
        return self.staging.stage(flat, n, size, self.table.largest)

    # -- capture ----------------------------------------------------------------------------------------
    def _first_use(self, flat: Sequence[Any], padded: list[Any], n: int, size: int) -> None:
        """Capture ``size`` (after its warm-up runs) and verify it if asked; the replay that follows is the
        call's only run."""
        saved = self.staging.save_written(padded)
        with self.staging.extra_runs():
            self._capture(padded, n, size, saved)
            self.staging.restore(padded, saved)
            if self.verify_left > 0 and size not in self.table.over_limit:
                self.verify_left -= 1
                self._verify(flat, n, size, saved)
                self.staging.restore(padded, saved)
                if n < size:
                    self.table.padded_checked.add(size)

    def _capture(self, padded: list[Any], n: int, size: int, saved: dict[int, torch.Tensor]) -> None:
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
                if not self._measure_pool(padded, size):
                    self.state.phase = Phase.RUN
                    return None
                with self.staging.recording_writes(padded, saved):
                    self.state.phase = Phase.CAPTURE
                    try:
                        return self.program.call(*padded)
                    finally:
                        self.state.phase = Phase.RUN

        _, seconds = timed_capture(capture)
        if size in self.table.over_limit:
            return
        self.table.record_capture(size, seconds)
        log.info("piecegraph: captured size %d in %.3f s", size, seconds)

    def _measure_pool(self, padded: list[Any], size: int) -> bool:
        """Before the first capture into this program's graphs (the largest size, as captured largest first), one
        more warm-up run in a pool of its own measures what the capture will take (graphs/memory.py:
        :func:`measured_pool_bytes`), plus the estimate's cuBLAS workspace. Over ``graph_memory_limit`` the size
        is refused with a warning (``False``): its calls run without graphs, and the next size is measured."""
        if self.measured is not None or not self.config.warmup_runs:
            return True  # after warm-ups only: a first warm-up may time a static compile in a graph of its own
        self.state.phase = Phase.WARMUP
        got = measured_pool_bytes(lambda: self.program.call(*padded))
        if got is None:
            return True
        need = got + (self.memory.workspace_bytes if self.memory is not None else 0)
        limit = self.config.graph_memory_limit
        if limit is not None and need > limit:
            self.table.refuse(size, need)
            warnings.warn(f"piecegraph: capture size {size} needs {need / 2**20:.1f} MiB of graph pool, measured "
                          f"before its capture (an eager run in a pool of its own, plus the cuBLAS workspace), over "
                          f"Config(graph_memory_limit={limit / 2**20:.1f} MiB); calls of that size run without "
                          "graphs. Raise graph_memory_limit, or capture smaller sizes.", stacklevel=8)
            return False
        self.measured = (size, need)
        return True

    # -- replay -----------------------------------------------------------------------------------------
    def replay(self, padded: list[Any], n: int, size: int, count: bool = True) -> Any:
        """Replay ``size`` on staged inputs (``count``: a replay the stats count; piecegraph's own are not)."""
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
            if meta is current_forward_context():  # piecewise: the caller's own context (no swap to pay for)
                outputs = self.program.call(*padded)
            else:
                with override_forward_context(meta):
                    outputs = self.program.call(*padded)
        finally:
            self.state.phase = Phase.RUN
        if count:
            self.replays += 1
        return outputs

    # -- verify and drop --------------------------------------------------------------------------------
    def _verify_padded(self, flat: Sequence[Any], padded: list[Any], n: int, size: int) -> None:
        """The first padded call of a size that was captured (and verified) at exactly its size."""
        self.table.padded_checked.add(size)
        saved = self.staging.save_written(padded)
        with self.staging.extra_runs():
            self._verify(flat, n, size, saved)
            self.staging.restore(padded, saved)

    def _verify(self, flat: Sequence[Any], n: int, size: int, saved: dict[int, torch.Tensor]) -> None:
        """Replay ``size`` on token inputs rolled by one row and compare with the same program without graphs,
        unpadded (``n`` rows), both from the same state. On a mismatch beyond ``config.verify_tol`` the size is
        dropped (its graphs freed, later calls run without a graph) and a warning names it."""
        td = self.config.token_dim
        rolled = rolled_token_inputs(flat, self.staging.token_idx, n, td)
        staged = self._stage(rolled, n, size)
        with self.staging.extra_runs():
            replayed = [o.clone() if isinstance(o, torch.Tensor) else o
                        for o in self.replay(staged, n, size, count=False)]
        self.staging.restore(staged, saved)
        # Against the unpadded run: a padded reference would hide an op that mixes pad rows into real ones.
        with self.staging.extra_runs():
            reference = self.run(rolled)
            error = rel_error(replayed, reference, n, td, self.program.token_outputs)
        if n < size and self.config.mode == "breakable":
            error = max(error, self._pad_dependence(rolled, reference, n, size, saved))
        tol = verify_tolerance(self.config.verify_tol, replayed)
        if error <= tol:
            log.info("piecegraph: verified size %d (rel. error %.2e)", size, error)
            return
        self.table.drop(size, error)
        for piece in self.program.pieces:
            piece.captured.pop(size, None)
        warnings.warn(dropped_warning(size, error, tol), stacklevel=7)  # out through the runner to the module call

    def _pad_dependence(self, rolled: list[Any], reference: Any, n: int, size: int,
                        saved: dict[int, torch.Tensor]) -> float:
        """How far the real rows' outputs move, run without graphs at ``size`` rows, when the pad rows of the
        floating-point token inputs hold large random values (two patterns, each of either sign) instead of zeros.
        A breakable program has no trace in which to see an op that mixes rows over tokens, and with zero pads its
        effect can hide in the values (a tanh of a sum over tokens, saturated at the verified call, not at the
        next): this shows it. 0.0 when no token input is floating point."""
        td = self.config.token_dim
        floats = [i for i in self.staging.token_idx
                  if isinstance(rolled[i], torch.Tensor) and rolled[i].is_floating_point()]
        worst = 0.0
        # Random patterns, not one value: a pad row holding one value in every feature is invisible to weights that
        # sum to (near) zero, and one small draw can leave a saturated sum saturated (CI's property test found
        # sizes verified so and wrong at their next call). Two seeded patterns, each with both signs (whatever the
        # pads feed moves both ways), large against the real rows (_pad_magnitude).
        noise = torch.Generator().manual_seed(size)
        bigs = {i: _pad_magnitude(rolled[i]) for i in floats}  # the real rows: an extra run may read them
        shapes = {i: rolled[i].shape[:td] + (size - n,) + rolled[i].shape[td + 1:] for i in floats}
        patterns = [{i: torch.randn(shapes[i], generator=noise) * bigs[i] for i in floats}
                    for _ in range(2 if floats else 0)]
        for pattern, sign in [(p, sign) for p in patterns for sign in (1.0, -1.0)]:
            staged = self._stage(rolled, n, size)
            for i in floats:
                staged[i].narrow(td, n, size - n).copy_(pattern[i] * sign)
            try:
                with self.staging.extra_runs():
                    moved = self.run(staged)
                worst = max(worst, rel_error(moved, reference, n, td, self.program.token_outputs))
            except Exception:  # noqa: BLE001  (pads this large broke the program: take it as mixing, drop)
                worst = float("inf")
            finally:
                self.staging.restore(staged, saved)
        return worst

    def drop_all(self) -> None:
        """Forget every captured size; the next call of each size captures again."""
        for piece in self.program.pieces:
            piece.drop()
        self.table.forget_captures()
        if self.static_context is not None:
            self.static_context.captured.clear()


def _pad_magnitude(real: torch.Tensor) -> float:
    """How large the pad check's pads are for the real rows ``real``: 1000 times their largest value (10 in half
    precision, whose range the pads' products would overflow), plus one; 1.0 when there are none."""
    if not real.numel():
        return 1.0
    scale = 10.0 if torch.finfo(real.dtype).max < 1e5 else 1000.0
    return scale * float(real.abs().max()) + 1.0
