"""The engine: requests in, one step at a time (schedule, one forward, sample), tokens out.

Overlapped by default (``EngineConfig.overlap``, as vLLM's async scheduling and SGLang's overlap scheduler): a
step schedules and launches its batch, then reads the previous step's tokens, which the device computed meanwhile.
Sampled tokens stay on the device and become the next step's input ids there (``inputs.py``); the host learns
them one step later (a non-blocking copy into pinned memory and an event), for stops, EOS and streaming. A
request that stopped has already been given one more decode row: its token is discarded, never emitted, and its
pages are freed when the stop is known (the device runs the freed pages' next owner after that row). Requests
that stop by length are not scheduled past their last token. ``overlap=False`` reads each step's tokens in the step
(the synchronous loop); tokens are the same either way, greedy or seeded.

Prefix caching is on by default (``EngineConfig.prefix_cache``, ``prefix_cache.py``): a prompt whose first full
pages are cached shares them and prefills after them (``Request.cached_tokens``). A prefill chunk's full pages are
entered when its step is launched (a later step, which the device runs after it, may read them); a decode row's
when its request ends.

Example::

    engine = Engine(Decoder.random(TINY), EngineConfig(mode="auto", max_num_seqs=8, max_num_batched_tokens=64,
                                                       max_seq_len=128))
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=8))
    engine.stats()   # steps by kind (full / piecewise / ...), graph share, padding, preemptions
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from piecegraph.attention.kv_cache import KVCache
from piecegraph.attention.metadata import AttentionMetadata
from piecegraph.attention.pages import pages_for
from piecegraph.graphs.capture import timed_capture
from piecegraph.models import model_facts
from piecegraph.models.generate import start_host_copy
from piecegraph.program import describe
from piecegraph.serve.config import EngineConfig
from piecegraph.serve.executor import Executor, Progress
from piecegraph.serve.gc_pauses import frozen_heap
from piecegraph.serve.inputs import StepInputs, build_inputs
from piecegraph.serve.kv_budget import KVBudget, cpu_kv_bytes, free_device_bytes, kv_budget
from piecegraph.serve.request import Request, SamplingParams, Status
from piecegraph.serve.sampling import sample_on_device
from piecegraph.serve.scheduler import Batch, Scheduler
from piecegraph.serve.stats import StepStats, summarize

log = logging.getLogger("piecegraph")


@dataclass
class InFlight:
    """A launched step whose tokens the host has not read: its batch, the requests of its sampling rows and each
    one's row in ``tokens`` (device int64), their pinned host copy and the event recorded after that copy (``None``
    on a CPU), and what :class:`StepStats` records of it so far."""

    batch: Batch
    sampled: list[Request]
    index: dict[Request, int]
    tokens: torch.Tensor
    host: torch.Tensor
    ready: Any
    kind: str
    padded: int
    phases: tuple[float, float, float]
    plan_s: float
    plans: int


def _plan_clock(backend: Any) -> tuple[float, int]:
    """The attention backend's plan counters (seconds, calls) so far; zeros for a backend without them."""
    return getattr(backend, "plan_s", 0.0), getattr(backend, "plans", 0)


class Engine:
    """Continuous batching over a flat-token model, with graphs chosen per step (see ``executor.py``).

    ``model``: ``forward(input_ids [T], positions [T]) -> hidden [T, ...]`` inside a forward context,
    ``logits(hidden) -> [rows, vocab]``, and ``.config``, a :class:`~piecegraph.models.ModelConfig` of the
    KV-cache shape: the reference decoder, or a Hugging Face wrapper with that interface. Its device, dtype, cache
    shape and vocabulary are read once, as :attr:`facts` (``piecegraph.models.model_facts``). ``cache``: a KV
    cache to use (default: one built from ``config``); the engine owns its sequences. Graphs are captured here,
    before the first request (``progress`` is told each size), so ``setup_s`` and :meth:`capture_report` say what
    start cost. One thread at a time.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None, *, cache: KVCache | None = None,
                 progress: Progress | None = None) -> None:
        self.model, self.config = model, config or EngineConfig()
        self.facts = model_facts(model)  # device, dtype, cache shape, vocabulary: read once, here
        self.cache_budget: KVBudget | None = None  # how a default cache was sized (serve/kv_budget.py)
        self.cache = cache or self._build_cache()
        self.scheduler = Scheduler(self.cache, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                   prefix_cache=self.config.prefix_cache)
        self.executor = Executor(model, self.config,
                                 captures_mixed=getattr(self.cache.backend, "captures_mixed_steps", False))
        self.steps: list[StepStats] = []
        self._ids: set[Hashable] = set()  # every id accepted, for uniqueness and abort's KeyError
        self._live: dict[Hashable, Request] = {}  # waiting or running requests by id
        self._counter = itertools.count()
        self._inflight: InFlight | None = None  # the launched step whose tokens the host has not read yet
        # What the last step() emitted, as parallel lists (request, token): one token per request per step. A
        # server publishes these as they are instead of scanning every live request for new output.
        self.emitted: tuple[list[Request], list[int]] = ([], [])
        self.device = self.cache.device
        try:
            _, self.setup_s = timed_capture(lambda: (self.executor.capture(self.cache, progress),
                                                     self._warm_small_batch_logits()))
        except torch.OutOfMemoryError as err:
            raise torch.OutOfMemoryError(f"{err}\n\npiecegraph: graph capture ran out of device memory after the "
                                         f"KV cache took {self._cache_room(built=cache is None)}") from err

    @torch.no_grad()
    def _warm_small_batch_logits(self) -> None:
        """The LM head at each row bucket a small-batch linear measures (1, 2, 4, 8, 16 rows, up to
        ``max_num_seqs``) once now: its kernel choice is measured at start, not in the first requests' steps
        (``piecegraph.models.gemv``; a model without small-batch linears skips this)."""
        from piecegraph.models.gemv import MAX_ROWS, SmallBatchLinear

        if not any(isinstance(m, SmallBatchLinear) for m in self.model.modules()):
            return
        hidden = self.facts.config.hidden_size
        rows = 1
        while rows <= min(MAX_ROWS, self.config.max_num_seqs):
            self.model.logits(torch.zeros(rows, hidden, dtype=self.facts.dtype, device=self.device))
            rows *= 2

    def _cache_room(self, built: bool) -> str:
        """What the KV cache holds and what sized it (``built``: the engine did, from its config; else the caller's
        ``cache``): the capture OOM's hint."""
        gib = sum(t.numel() * t.element_size() for t in (*self.cache.k, *self.cache.v)) / 2**30
        size = f"{self.cache.num_pages} pages ({gib:.1f} GiB)"
        if not built:
            return f"{size}, the cache passed as Engine(cache=...); pass a smaller one to leave capture room"
        if self.config.num_pages is not None:
            return f"{size}, as EngineConfig.num_pages asked; lower num_pages to leave capture room"
        return (f"{size}, {self.config.kv_cache_memory} of the free memory (EngineConfig.kv_cache_memory); lower "
                "kv_cache_memory or set num_pages to leave capture room (breakable graphs keep every eager op's "
                "outputs per size: they need the most)")

    def _build_cache(self) -> KVCache:
        cfg, facts = self.config, self.facts
        max_len = cfg.max_seq_len or facts.config.max_seq_len
        pages = cfg.num_pages
        if pages is None:
            free, fraction = free_device_bytes(facts.device), cfg.kv_cache_memory
            cpu = free is None and facts.device.type == "cpu"
            if cpu:  # no free-memory query there: a share of the available memory (serve/kv_budget.py)
                one = (pages_for(max_len, cfg.page_size) + 1) * cfg.page_size * facts.kv_bytes_per_token()
                free, fraction = max(cpu_kv_bytes(), one), 1.0  # one sequence at its longest at least
            budget = kv_budget(
                max_num_seqs=cfg.max_num_seqs, max_seq_len=max_len, page_size=cfg.page_size,
                page_bytes=cfg.page_size * facts.kv_bytes_per_token(), fraction=fraction, free_bytes=free)
            budget = dataclasses.replace(budget, cpu=cpu)
            (log.warning if budget.trimmed else log.info)(budget.describe())
            pages, self.cache_budget = budget.pages, budget
        elif facts.device.type == "cuda":
            # as free_device_bytes does for the sized cache: a dropped engine in a reference cycle (the previous
            # mode of serve-bench) must not hold its cache's memory against this one (on the H200 an FP8 MoE
            # breakable engine ran out allocating 30,000 pages with 134 GiB still allocated)
            gc.collect()
        return KVCache(facts.config, pages, cfg.page_size, dtype=facts.dtype, device=facts.device,
                       max_seq_len=max_len, backend=cfg.attention_backend)

    # -- requests ---------------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = None, *,
                    id: Hashable | None = None, arrival: float | None = None) -> Request:
        """Queue a request; ``id`` (default a counter) must be hashable and new to this engine. Returns the live
        request. A refused request (``TypeError``/``ValueError`` naming the argument: prompt, params, id, the
        vocabulary, the cache) takes neither its id nor pages."""
        rid = id if id is not None else ("req", next(self._counter))
        try:
            hash(rid)
        except TypeError:
            raise TypeError(f"request id {describe(rid)} must be hashable") from None
        if rid in self._ids:
            raise ValueError(f"request id {describe(rid)} was already submitted to this engine; ids are unique")
        request = Request.make(rid, prompt, params, time.perf_counter() if arrival is None else arrival)
        vocab, prompt = self.facts.vocab_size, request.prompt
        # checked here: out of range, the embedding fails mid-step (a device assert on a GPU); min/max first, in C
        bad = [t for t in prompt if not 0 <= t < vocab] if min(prompt) < 0 or max(prompt) >= vocab else []
        if bad:
            raise ValueError(f"request {describe(rid)}: prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab})")
        self.scheduler.add(request)
        self._ids.add(rid)
        self._live[rid] = request
        return request

    def abort(self, request_id: Hashable) -> Request | None:
        """Abort a waiting or running request (also mid-prefill or preempted) between steps: its pages are freed at
        once, it leaves the queues and finishes with ``finish_reason == "aborted"`` (its ``output`` is what it had
        emitted; a token of it still in flight is discarded). Safe between steps while one is in flight: the
        freed pages go to later steps, which the device runs after it. Returns it; ``None`` when that id had
        already finished or been aborted (idempotent). Raises ``KeyError`` for an id this engine never accepted.
        The other requests' tokens do not change."""
        request = self._live.pop(request_id, None)
        if request is None:
            if request_id in self._ids:
                return None
            raise KeyError(f"request id {describe(request_id)} was never submitted to this engine")
        self.scheduler.abort(request)
        return request

    def idle_work(self) -> None:
        """What the engine does while no request is in flight (a server's loop calls it when idle): the full
        module's swap to its background package (see :meth:`Executor.refresh`), so the first request after a
        quiet spell does not pay for it. Cheap when nothing is pending."""
        if not self.has_work():
            self.executor.refresh(self.cache)

    def has_work(self) -> bool:
        """Requests are queued or running, or a launched step's tokens are still to be read."""
        return self.scheduler.has_work() or self._inflight is not None

    # -- steps ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Request]:
        """Run one step; returns the requests whose last token the host learned in it (in row order).

        Overlapped (``config.overlap``): schedule and launch this step, then read the previous step's tokens
        (its device work ran meanwhile) and finish the requests that stopped there; a stopped request's row in
        this step is discarded when it resolves. Synchronous: launch, then read this step's own tokens.
        Every token the host learned in it is in :attr:`emitted` until the next step (one per request).
        """
        self.executor.refresh(self.cache)  # a swap the full module's background package brought (rare)
        start = time.perf_counter()
        self.emitted = ([], [])
        batch = self.scheduler.schedule()
        previous, launched = self._inflight, None
        if batch.rows:
            launched = self._launch(batch, previous, start)
        elif previous is None:
            if self.scheduler.has_work():
                raise RuntimeError(
                    f"no request fits the KV cache ({self.cache.num_free_pages} pages free, "
                    f"{len(self.cache.sequences())} sequences hold the rest): pages are held outside the engine")
            return []
        self._inflight = launched
        finished = self._resolve(previous) if previous is not None else []
        if launched is not None and not self.config.overlap:
            self._inflight = None
            finished += self._resolve(launched)
        return finished

    def _launch(self, batch: Batch, previous: InFlight | None, start: float) -> InFlight:
        """Build and launch ``batch`` (forward, sampling, the tokens' copy to the host), then advance the
        requests as if its tokens were known: their counts include them, in flight."""
        scheduled = time.perf_counter()
        plan_clock = _plan_clock(self.cache.backend)
        prev = (previous.tokens, previous.index) if previous is not None else (None, None)
        inputs = build_inputs(batch.rows, self.device, *prev)
        meta = AttentionMetadata.for_batch(self.cache, [(r.request.id, r.cached, r.new) for r in batch.rows])
        built = time.perf_counter()
        hidden, kind, padded = self.executor.run(inputs.input_ids, meta)
        tokens = self._sample(hidden, inputs, batch.num_tokens)
        host, ready = start_host_copy(tokens)
        launched = time.perf_counter()
        plan_s, plans = (a - b for a, b in zip(_plan_clock(self.cache.backend), plan_clock))
        prefix = self.scheduler.prefix
        for r in batch.rows:
            r.request.num_computed += r.new
            if r.samples:
                r.request.inflight += 1
            if r.new > 1 and prefix is not None:  # a prefill chunk: later steps (run after this one) may share its
                prefix.commit(r.request)  # full pages; decode rows' pages are entered when their request ends
        return InFlight(batch, inputs.sampled, {q: i for i, q in enumerate(inputs.sampled)}, tokens, host, ready,
                        kind, padded, (scheduled - start, built - scheduled, launched - built), plan_s, int(plans))

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs, num_tokens: int) -> torch.Tensor:
        if not inputs.sampled:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if inputs.last_rows is None:  # every token is a last token (a decode step): no gather index needed
            last = hidden[:num_tokens]
        else:
            last = hidden.index_select(0, inputs.last_rows)
        return sample_on_device(self.model.logits(last), inputs.sampled)

    def _resolve(self, flight: InFlight) -> list[Request]:
        """Wait for ``flight``'s tokens on the host and emit them; tokens of requests that finished meanwhile
        (aborted, or stopped by the step before) are discarded."""
        waited = time.perf_counter()
        if flight.ready is not None:
            flight.ready.synchronize()  # the one intended sync of a step
        values = flight.host.tolist()
        now = time.perf_counter()
        finished = []
        emitted_requests, emitted_tokens = self.emitted
        for request, token in zip(flight.sampled, values):
            if request.status is Status.FINISHED:
                continue
            token = request.append(token, now)  # a forced EOS replaces the last sampled token
            emitted_requests.append(request)
            emitted_tokens.append(token)
            if request.finish_reason is not None:
                self.scheduler.finish(request)
                self._live.pop(request.id, None)
                finished.append(request)
        phases = (*flight.phases, time.perf_counter() - waited)
        self.steps.append(self._record(flight, phases))
        return finished

    def _record(self, flight: InFlight, phases: tuple[float, float, float, float]) -> StepStats:
        batch = flight.batch
        decode = sum(1 for r in batch.rows if r.new == 1 and r.cached > 0)
        return StepStats(kind=flight.kind, is_decode=batch.is_decode, tokens=batch.num_tokens, padded=flight.padded,
                         seqs=len(batch.rows), decode_rows=decode, prefill_tokens=batch.num_tokens - decode,
                         sampled=len(flight.sampled), preempted=len(batch.preempted), seconds=sum(phases),
                         phases=phases, plan_s=flight.plan_s, plans=flight.plans)

    def run(self, on_finish: Callable[[Request], None] | None = None) -> list[Request]:
        """Step until no request is left; returns the finished requests in finishing order. The heap that exists
        when it starts is frozen while it runs (``EngineConfig.freeze_gc``)."""
        done: list[Request] = []
        with frozen_heap(self.config.freeze_gc):
            while self.has_work():
                for request in self.step():
                    done.append(request)
                    if on_finish:
                        on_finish(request)
        return done

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None
                 = None) -> list[list[int]]:
        """All prompts at once through the engine; the output tokens per prompt, in prompt order."""
        many = isinstance(params, Sequence)
        requests = [self.add_request(p, params[i] if many else params) for i, p in enumerate(prompts)]
        self.run()
        return [list(r.output) for r in requests]

    # -- reports ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The steps so far summarized (see :func:`piecegraph.serve.stats.summarize`), pages and preemptions."""
        out = summarize(self.steps)
        out.update(free_pages=self.cache.num_free_pages, num_pages=self.cache.num_pages,
                   preemptions=self.scheduler.num_preemptions, aborted=self.scheduler.num_aborted)
        prefix = self.scheduler.prefix
        out["prefix_cache"] = prefix.stats() if prefix is not None else None
        return out

    def reset_stats(self) -> None:
        self.steps = []
        self.scheduler.num_preemptions = self.scheduler.num_aborted = 0
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.reset_stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the next requests start cold; a benchmark's repeats stay comparable)."""
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.reset()

    def capture_report(self) -> dict[str, Any]:
        """What start captured: per module its sizes and seconds, the pool's MiB, and the whole setup seconds."""
        kv = {"pages": self.cache.num_pages, "trimmed_from": None}
        if self.cache_budget is not None and self.cache_budget.trimmed:
            kv["trimmed_from"] = self.cache_budget.wanted
        return {**self.executor.report(), "setup_s": round(self.setup_s, 3), "kv_cache": kv}
