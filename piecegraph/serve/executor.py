"""The model side of the engine: one compiled module per kind of step, graphs captured at start, one dispatch.

| engine mode | pure decode steps | every other step |
|---|---|---|
| eager | the model | the model |
| breakable | piecegraph ``mode="breakable"`` | the same module |
| piecewise | piecegraph ``mode="piecewise"`` | the same module |
| auto | piecegraph ``mode="full"`` (batch bucketed to its sizes) | piecegraph ``mode="full"`` at the piecewise sizes
(``full-mixed``) for steps of few sequences where the attention backend captures them, else ``mode="piecewise"`` |

In ``auto``, which of the two a pure decode step replays is measured at capture, per full size (on CUDA: a few
replays of each, timed with CUDA events; the faster wins; :meth:`Executor.report` records both times and the
choice). Without real graphs to time (CPU, emulated graphs) the rule is full for every size. Steps with prompt
tokens go to the ``full-mixed`` module (``EngineConfig.mixed_graphs``, a backend whose ``captures_mixed_steps``:
FlashInfer) when they have at most the backend's ``mixed_graph_seqs(size)`` sequences, and its graphs were timed
faster than the piecewise module's on a prompt beside decode rows (:func:`time_mixed`; the same rule off CUDA).
A decode step larger than the largest full size goes to the piecewise module; a step larger than the largest
piecewise size runs its compiled pieces without graphs (piecegraph's own fallback). In ``auto`` both modules share
one :class:`piecegraph.GraphPool`. What a step actually did is read from the modules' replay counters, not
assumed: ``"full"``, ``"piecewise"``, ``"breakable"``, ``"none"`` (compiled, no graph) or ``"eager"``.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

import piecegraph
from piecegraph.attention.metadata import AttentionMetadata
from piecegraph.context import forward_context
from piecegraph.graphs.capture import capture_batch, pipelined_ms, time_ms, timed_capture
from piecegraph.models.generate import dummy_inputs, dummy_mixed_inputs
from piecegraph.serve.config import EngineConfig

log = logging.getLogger("piecegraph")

GRAPH_KINDS = ("full", "full-mixed", "piecewise", "breakable")
Progress = Callable[[str, int, int, int], None]  # (module kind, size, sizes done, sizes in all), before each size


@dataclass
class Slot:
    """One compiled module and what the engine knows about it: its graph kind and capture sizes."""

    kind: str
    module: Any
    sizes: tuple[int, ...] = ()
    wall_s: dict[int, float] = field(default_factory=dict)

    def replays(self) -> int:
        """Graph replays so far (the runner's counter: cheap, unlike ``stats()``, which reads the pool)."""
        return 0 if self.kind == "eager" else self.module.runner.replays

    def bucket(self, n: int) -> int:
        """The size a call of ``n`` tokens is padded to (``n`` itself above the largest size)."""
        pos = bisect.bisect_left(self.sizes, n)
        return self.sizes[pos] if pos < len(self.sizes) else n


class Executor:
    """Builds the modules of ``config.mode`` for ``model`` and runs one step with the right one.

    ``model`` takes ``(input_ids [T], positions [T])`` inside a forward context and returns hidden states
    ``[T, ...]``; any such module works (the reference decoder, a Hugging Face wrapper). Nothing runs until
    :meth:`capture`, which traces, compiles and captures every size, largest first.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig, captures_mixed: bool = False) -> None:
        self.model, self.config = model, config
        self.pool = piecegraph.GraphPool()
        # auto: per full size, the module its decode steps replay and what was measured to choose it
        self.decode_choice: dict[int, dict[str, Any]] = {}
        # auto with mixed graphs: per size, whether steps with prompt tokens replay full-mixed or piecewise graphs
        self.mixed_choice: dict[int, dict[str, Any]] = {}
        self._timed_swaps = 0  # the full module's swaps when decode_choice was timed
        self.prefill: Slot | None = None  # auto's full-mixed module (``captures_mixed``: the cache's backend can)
        mode = config.mode
        if mode == "eager":
            self.mixed = Slot("eager", model)
            self.decode: Slot | None = None
            return
        common: dict[str, Any] = {"pool": self.pool, "emulate_graphs": config.emulate_graphs, "progress": False,
                                  "cache_dir": config.cache_dir, "graph_memory_limit": config.graph_memory_limit,
                                  "aot_package": config.aot_package, "aot_background": config.aot_background}
        if mode == "breakable":
            self.mixed = Slot("breakable", piecegraph.compile(
                model, mode="breakable", capture_sizes=config.piecewise_sizes, **common), config.piecewise_sizes)
        else:
            # the engine's auto is piecegraph's auto for kernels nobody adapted: its modules wrap them too
            common["auto_opaque"] = mode == "auto" if config.auto_opaque is None else config.auto_opaque
            self.mixed = Slot("piecewise", piecegraph.compile(
                model, mode="piecewise", compiler=config.compiler, capture_sizes=config.piecewise_sizes, **common),
                config.piecewise_sizes)
        self.decode = None
        if mode == "auto":
            self.decode = Slot("full", piecegraph.compile(
                model, mode="full", compiler=config.compiler, capture_sizes=config.full_sizes,
                full_compile=config.full_compile, compile_sizes=config.decode_compile_sizes, **common),
                config.full_sizes)
            if config.share_trace:  # one Dynamo trace for both modules: the full one builds from the piecewise one's
                self.decode.module.trace_from(self.mixed.module)
            sizes = tuple(s for s in config.piecewise_sizes if s >= 2)  # one token is a decode step
            if config.mixed_graphs and captures_mixed and sizes:
                self.prefill = Slot("full-mixed", piecegraph.compile(
                    model, mode="full", compiler=config.compiler, capture_sizes=sizes,
                    full_compile=config.full_compile, **common), sizes)
                if config.share_trace:
                    self.prefill.module.trace_from(self.mixed.module)

    @property
    def slots(self) -> list[Slot]:
        return [s for s in (self.mixed, self.decode, self.prefill) if s is not None]

    # -- start ------------------------------------------------------------------------------------------
    def capture(self, cache: Any, progress: Progress | None = None) -> None:
        """Trace, compile and capture every size of every module now, largest first, on pad-token dummy decode
        steps (scratch page only; full-mixed: pad-token prompts). The first size of each module also traces and
        compiles it. The full-mixed module is an optimization: if one of its sizes fails to capture, a warning
        names the error and every step with prompt tokens runs piecewise (the other modules' failures raise)."""
        done, total = 0, self.num_sizes()
        with capture_batch():  # one garbage collection for every size, not one per size
            for slot in self.slots:
                if slot.kind == "eager":
                    continue
                try:
                    done = self._capture_slot(slot, cache, progress, done, total)
                except Exception as err:
                    if slot is not self.prefill:
                        raise
                    log.warning("piecegraph engine: the full-mixed graphs did not capture (%s: %s); steps with "
                                "prompt tokens run piecewise", type(err).__name__, err)
                    self.prefill = None
        if progress and total:
            progress("done", 0, done, total)
        if self.decode is not None:
            self.choose_decode(self.decode_timer(cache))
        if self.prefill is not None:
            self.choose_mixed(cache)

    def _capture_slot(self, slot: Slot, cache: Any, progress: Progress | None, done: int, total: int) -> int:
        for n in sorted(slot.sizes, reverse=True):
            if progress:
                progress(slot.kind, n, done, total)
            make = self._dummy_maker(slot, cache)
            _, seconds = timed_capture(lambda m=slot.module, n=n, make=make: m.capture(make, [n]))
            slot.wall_s[n] = seconds  # the first size also traces and compiles
            done += 1
        return done

    def _dummy_maker(self, slot: Slot, cache: Any) -> Callable[[int], Any]:
        """What ``slot`` captures each size on: pad-token decode steps, or (full-mixed) pad-token prompts."""
        if slot is self.prefill:
            return lambda k: dummy_mixed_inputs(self.model, cache, k, cache.backend.mixed_graph_seqs(k))
        return lambda k: dummy_inputs(self.model, cache, k)

    def choose_mixed(self, cache: Any) -> None:
        """Per full-mixed size, full-mixed or piecewise for steps with prompt tokens: timed (:func:`time_mixed`)
        on CUDA with real graphs, the faster wins and ties go to full-mixed; elsewhere full-mixed."""
        measured = cache.device.type == "cuda" and not self.config.emulate_graphs
        for n in self.prefill.sizes:
            seqs = cache.backend.mixed_graph_seqs(n)
            times = {s.kind: time_mixed(s.module, self.model, cache, n, seqs, self.config.overlap) if measured
                     else None for s in (self.prefill, self.mixed)}
            full, piecewise = times["full-mixed"], times["piecewise"]
            pick = "piecewise" if full is not None and piecewise is not None and piecewise < full else "full-mixed"
            self.mixed_choice[n] = {"pick": pick, "full_mixed_ms": full, "piecewise_ms": piecewise, "seqs": seqs,
                                    "by": "rule" if full is None or piecewise is None else "measured"}

    def decode_timer(self, cache: Any) -> Callable[[Slot, int], float | None]:
        """``timer(slot, n)``: ms of one decode step of ``n`` rows through ``slot``'s graphs
        (:func:`time_replays`), or None where no real graphs run (CPU, emulated graphs)."""
        measured = cache.device.type == "cuda" and not self.config.emulate_graphs
        overlap = self.config.overlap
        return lambda slot, n: time_replays(slot.module, self.model, cache, n, overlap) if measured else None

    def choose_decode(self, timer: Callable[[Slot, int], float | None], when: str = "capture") -> None:
        """Pick full or piecewise per full size by ``timer(slot, n)`` (ms of one decode step of ``n`` rows;
        ``None``: not measurable, keep full). Ties go to full. ``when``: what the report says prompted it."""
        for n in self.decode.sizes:
            full, piecewise = timer(self.decode, n), timer(self.mixed, n)
            pick = "piecewise" if full is not None and piecewise is not None and piecewise < full else "full"
            self.decode_choice[n] = {"pick": pick, "full_ms": full, "piecewise_ms": piecewise, "when": when,
                                     "by": "rule" if full is None or piecewise is None else "measured"}
        self._timed_swaps = self.decode.module.swaps

    def refresh(self, cache: Any) -> None:
        """Between steps: let the full module swap in its background package (``full_compile="pieces"``) even
        while auto replays the piecewise module for every decode size, and time the choice again after a swap
        (it was measured against the program compiled by pieces). Cheap when nothing is pending: an attribute
        read and a clock read."""
        if self.decode is None:
            return
        if self.prefill is not None:  # its own background package, if any; its choice is not timed again
            self.prefill.module.poll_upgrade()
        self.decode.module.poll_upgrade()
        if self.decode.module.swaps == self._timed_swaps:
            return
        before = dict(self.decode_choice)
        try:
            self.choose_decode(self.decode_timer(cache), when="swap")
        except Exception as err:  # noqa: BLE001  (a serving step must not fail for a timing: both modules work)
            self.decode_choice, self._timed_swaps = before, self.decode.module.swaps
            log.warning("piecegraph engine: timing the decode choice again after the full module's swap failed "
                        "(%s: %s); keeping the choice timed before it", type(err).__name__, err)
            return
        log.info("piecegraph engine: decode choice timed again after the full module's swap: %s",
                 {n: c["pick"] for n, c in self.decode_choice.items()})

    def num_sizes(self) -> int:
        return sum(len(s.sizes) for s in self.slots if s.kind != "eager")

    def report(self) -> dict[str, Any]:
        """What was captured: per module its sizes and seconds, and the shared pool's MiB."""
        out: dict[str, Any] = {"mode": self.config.mode, "modules": {}, "pool_mib": 0.0}
        for slot in self.slots:
            if slot.kind == "eager":
                continue
            stats = slot.module.stats()
            out["modules"][slot.kind] = {
                "sizes": list(stats["sizes"]), "graph_mode": stats["mode"], "pieces": stats.get("pieces"),
                "compiled_pieces": stats.get("compiled_pieces"),
                "capture_s": round(sum(stats["capture_s"].values()), 3),  # warm-up + capture of every size
                "setup_s": round(sum(slot.wall_s.values()), 3),  # the same, plus prewarm, trace and compile
                "startup": stats.get("startup"), "graph_memory": stats.get("graph_memory"),
            }
            out["pool_mib"] = max(out["pool_mib"], stats["pool_bytes"] / 2**20)  # one pool, seen by each module
        if self.decode_choice:
            out["decode_choice"] = {n: dict(c) for n, c in self.decode_choice.items()}
        if self.mixed_choice:
            out["mixed_choice"] = {n: dict(c) for n, c in self.mixed_choice.items()}
        return out

    # -- one step ---------------------------------------------------------------------------------------
    def pick(self, meta: AttentionMetadata) -> Slot:
        """A pure decode step within the full sizes: the module measured faster for its size (full graphs by
        default); a step with prompt tokens within the full-mixed sizes and slots: the full-mixed module where it
        was measured faster (or by rule); every other step: the piecewise (mixed) module."""
        n = meta.num_tokens
        if self.decode is not None and meta.is_decode and n <= self.decode.sizes[-1]:
            choice = self.decode_choice.get(self.decode.bucket(n))
            return self.mixed if choice is not None and choice["pick"] == "piecewise" else self.decode
        if self.prefill is not None and not meta.is_decode and n <= self.prefill.sizes[-1]:
            size = self.prefill.bucket(n)
            choice = self.mixed_choice.get(size)
            if (choice is None or choice["pick"] == "full-mixed") and meta.layout is not None \
                    and meta.layout.num_seqs <= meta.cache.backend.mixed_graph_seqs(size):
                return self.prefill
        return self.mixed

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, str, int]:
        """``(hidden [T, ...], kind, padded size)`` of one step; ``kind`` is what actually ran."""
        slot = self.pick(meta)
        before = slot.replays()
        with forward_context(meta):
            hidden = slot.module(input_ids, meta.positions)
        if slot.kind == "eager":
            return hidden, "eager", meta.num_tokens
        if slot.replays() > before:
            return hidden, slot.kind, slot.bucket(meta.num_tokens)
        return hidden, "none", meta.num_tokens


def time_replays(module: Any, model: torch.nn.Module, cache: Any, n: int, overlap: bool = True,
                 repeats: int = 5) -> float:
    """Milliseconds of one decode step of ``n`` rows through ``module`` (its graphs, already captured), each step
    with its own metadata and attention plan, timed as the engine's loop runs it. ``overlap`` (the default loop):
    steps back to back (:func:`~piecegraph.graphs.capture.pipelined_ms`): the slower of host and device per step.
    ``overlap=False`` (the synchronous loop): each step alone, its host work, launches and device time in series
    (:func:`~piecegraph.graphs.capture.time_ms`). A step timed on metadata built beforehand hid the host work:
    measured 1.65 ms piecewise against full's 1.73 at 16 rows, auto replayed it at c=10 and served 2.7k tok/s where
    full graphs served 4.7k (H200); the synchronous auto replayed piecewise at every size of a c=1 run
    (260 tok/s).

    The rows differ as a served batch's do (:func:`timing_rows`): on pad rows, which all read the one scratch slot,
    every row of a mixture of experts routed alike, to 4 of 60 experts, and a 16-row step timed 4.8 ms where
    served steps of 10 rows took ~10 ms (FP8 Qwen1.5-MoE shape, H200). The pages it takes are freed."""
    with timing_rows(model, cache, n) as make:

        def step(_: int) -> None:
            args, meta = make()
            with forward_context(meta):
                module(*args)

        if not overlap:
            return time_ms(step, warmup=1, repeats=repeats)
        return pipelined_ms(step, repeats=2 * repeats)


@contextlib.contextmanager
def timing_rows(model: torch.nn.Module, cache: Any, n: int) -> Iterator[Callable[[], tuple[Any, Any]]]:
    """A maker of ``((input_ids, positions), meta)`` for a decode step of ``n`` distinct rows: each its own
    sequence (a token id drawn from the vocabulary, :func:`varied_ids`) with :func:`timing_context` cached tokens
    on pages of its own, so each attends over a served row's length of keys and values and a router sends the
    rows where their tokens lead. With fewer than ``n`` free pages: pad rows on the scratch page
    (:func:`~piecegraph.models.generate.dummy_inputs`). Each call builds new metadata (the host work of a step);
    the sequences are freed on exit. What the reserved pages hold is whatever an earlier sequence left there:
    only the time of the step is read, never its values."""
    context = timing_context(cache, n)
    names = [("auto-timing", i) for i in range(n)]
    if context < 0 or any(cache.capacity(s) for s in names):
        yield lambda: dummy_inputs(model, cache, n)
        return
    ids = varied_ids(n, model.config.vocab_size, cache.device)
    seqs = [(s, context, 1) for s in names]
    try:
        cache.reserve([(s, context + 1) for s in names])

        def make() -> tuple[Any, Any]:
            meta = AttentionMetadata.for_batch(cache, seqs)
            return (ids, meta.positions), meta

        yield make
    finally:
        for seq in names:
            cache.discard(seq)


def timing_context(cache: Any, n: int) -> int:
    """Cached tokens per row of an ``n``-row timing step: half of the cache's ``max_seq_len`` (a served row's
    mean length when requests fill it), fewer where the free pages cannot give ``n`` rows that many; -1 when
    they cannot give each row one page. A decode step's attention is not the same work at 1 token and at ~600:
    on one-token rows the FP8 MoE's 1024-row step timed 30.0 ms, served ones took 42.2; with this context it
    timed 42.9 (H200)."""
    pages_per_row = cache.num_free_pages // n
    if pages_per_row < 1:
        return -1
    return min(cache.max_seq_len // 2, pages_per_row * cache.page_size - 1)


def varied_ids(n: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """``n`` token ids drawn from the whole vocabulary (fixed seed)."""
    gen = torch.Generator().manual_seed(n)
    return torch.randint(vocab_size, (n,), generator=gen, dtype=torch.int64).to(device)


def time_mixed(module: Any, model: torch.nn.Module, cache: Any, n: int, seqs: int, overlap: bool = True,
               repeats: int = 5) -> float | None:
    """Milliseconds of one step of ``n`` tokens with a prompt in it through ``module``'s graphs, as
    :func:`time_replays` times a decode step: up to 8 decode rows (``seqs - 1`` at most, each with
    :func:`timing_context` cached tokens on pages of its own) beside prompt chunks of the rest, each step with its
    own metadata and plan. ``None`` when the free pages cannot hold those rows (the caller keeps its rule). The
    pages it takes are freed."""
    decode = max(0, min(seqs - 1, n - 2, 8))
    longest = max(1, cache.max_seq_len - 1)
    prompts = [min(longest, n - decode - i) for i in range(0, n - decode, longest)]
    if decode + len(prompts) > seqs:
        return None
    context = timing_context(cache, max(decode, 1))
    names = [("mixed-timing", i) for i in range(decode + len(prompts))]
    need = decode * (context + 1) + sum(prompts)
    if context < 1 or any(cache.capacity(s) for s in names) or \
            cache.num_free_pages * cache.page_size < need + len(names) * cache.page_size:
        return None
    seqs_of_step = [(s, context, 1) for s in names[:decode]] + [(s, 0, p) for s, p in zip(names[decode:], prompts)]
    ids = varied_ids(n, model.config.vocab_size, cache.device)
    try:
        cache.reserve([(s, context + 1) for s in names[:decode]])

        def step(_: int) -> None:
            meta = AttentionMetadata.for_batch(cache, seqs_of_step)
            with forward_context(meta):
                module(ids, meta.positions)

        return pipelined_ms(step, repeats=2 * repeats) if overlap else time_ms(step, warmup=1, repeats=repeats)
    finally:
        for seq in names:
            cache.discard(seq)
