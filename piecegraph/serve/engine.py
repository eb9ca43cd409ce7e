"""The engine: requests in, one step at a time (schedule, one forward, sample), tokens out.

Example::

    engine = Engine(Decoder.random(TINY), EngineConfig(mode="auto", max_num_seqs=8, max_num_batched_tokens=64,
                                                       max_seq_len=128))
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=8))
    engine.stats()   # steps by kind (full / piecewise / ...), graph share, padding, preemptions
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Hashable, Sequence

import torch

from piecegraph.attention.kv_cache import KVCache
from piecegraph.attention.metadata import AttentionMetadata
from piecegraph.attention.pages import pages_for
from piecegraph.graphs.capture import timed_capture
from piecegraph.program import describe
from piecegraph.serve.config import EngineConfig
from piecegraph.serve.executor import Executor, Progress
from piecegraph.serve.request import Request, SamplingParams
from piecegraph.serve.sampling import sample
from piecegraph.serve.scheduler import Batch, Scheduler
from piecegraph.serve.stats import StepStats, summarize


class Engine:
    """Continuous batching over a flat-token model, with graphs chosen per step (see ``executor.py``).

    ``model``: ``forward(input_ids [T], positions [T]) -> hidden [T, ...]`` inside a forward context,
    ``logits(hidden) -> [rows, vocab]``, and ``.config`` with the KV-cache shape (``num_layers``,
    ``num_kv_heads``, ``head_dim``, ``max_seq_len``, ``attention_backend``): the reference decoder, or a Hugging
    Face wrapper with that interface. ``cache``: a KV cache to use (default: one built from ``config``); the engine
    owns its sequences. Graphs are captured here, before the first request (``progress`` is told each size), so
    ``setup_s`` and :meth:`capture_report` say what start cost. One thread at a time.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None, *, cache: KVCache | None = None,
                 progress: Progress | None = None) -> None:
        self.model, self.config = model, config or EngineConfig()
        self.cache = cache or self._build_cache()
        self.scheduler = Scheduler(self.cache, self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self.executor = Executor(model, self.config)
        self.steps: list[StepStats] = []
        self._ids: set[Hashable] = set()  # every id accepted, for uniqueness and abort's KeyError
        self._live: dict[Hashable, Request] = {}  # waiting or running requests by id
        self._counter = itertools.count()
        self.device = self.cache.device
        _, self.setup_s = timed_capture(lambda: self.executor.capture(self.cache, progress))

    def _build_cache(self) -> KVCache:
        cfg, model_cfg = self.config, self.model.config
        param = next(self.model.parameters())
        max_len = cfg.max_seq_len or model_cfg.max_seq_len
        pages = cfg.num_pages or cfg.max_num_seqs * pages_for(max_len, cfg.page_size) + 1
        return KVCache(model_cfg, pages, cfg.page_size, dtype=param.dtype, device=param.device, max_seq_len=max_len,
                       backend=cfg.attention_backend)

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
        vocab = self.model.config.vocab_size
        bad = [t for t in request.prompt if not 0 <= t < vocab]
        if bad:  # checked here: out of range, the embedding fails mid-step (a device assert on a GPU)
            raise ValueError(f"request {describe(rid)}: prompt token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {vocab})")
        self.scheduler.add(request)
        self._ids.add(rid)
        self._live[rid] = request
        return request

    def abort(self, request_id: Hashable) -> Request | None:
        """Abort a waiting or running request (also mid-prefill or preempted) between steps: its pages are freed at
        once, it leaves the queues and finishes with ``finish_reason == "aborted"`` (its ``output`` is what it had
        emitted). Returns it; ``None`` when that id had already finished or been aborted (idempotent). Raises
        ``KeyError`` for an id this engine never accepted. The other requests' tokens do not change."""
        request = self._live.pop(request_id, None)
        if request is None:
            if request_id in self._ids:
                return None
            raise KeyError(f"request id {describe(request_id)} was never submitted to this engine")
        self.scheduler.abort(request)
        return request

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- steps ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Request]:
        """Run one step; returns the requests it finished (in row order)."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.rows:
            if self.scheduler.has_work():
                raise RuntimeError(
                    f"no request fits the KV cache ({self.cache.num_free_pages} pages free, "
                    f"{len(self.cache.sequences())} sequences hold the rest): pages are held outside the engine")
            return []
        rows = batch.rows
        scheduled = time.perf_counter()
        flat = [t for r in rows for t in r.request.token_slice(r.cached, r.cached + r.new)]
        input_ids = torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True)
        meta = AttentionMetadata.for_batch(self.cache, [(r.request.id, r.cached, r.new) for r in rows])
        built = time.perf_counter()
        hidden, kind, padded = self.executor.run(input_ids, meta)
        launched = time.perf_counter()  # on a GPU the forward may still run: the host sync is in _sample
        tokens = self._sample(hidden, batch)
        now = time.perf_counter()
        finished = self._advance(batch, tokens, now)
        phases = (scheduled - start, built - scheduled, launched - built, now - launched)
        self.steps.append(self._record(batch, kind, padded, phases))
        return finished

    def _sample(self, hidden: torch.Tensor, batch: Batch) -> list[int]:
        rows = batch.rows
        ends, offset = [], 0
        for r in rows:
            offset += r.new
            if r.samples:
                ends.append(offset - 1)
        if not ends:
            return []
        if len(ends) == offset:  # every token is a last token (a decode step): no gather index needed
            last = hidden[:offset]
        else:
            last = hidden[torch.tensor(ends, dtype=torch.int64).to(self.device, non_blocking=True)]
        return sample(self.model.logits(last), [r.request for r in rows if r.samples])

    def _advance(self, batch: Batch, tokens: list[int], now: float) -> list[Request]:
        finished, it = [], iter(tokens)
        for r in batch.rows:
            r.request.num_computed += r.new
            if r.samples:
                r.request.append(next(it), now)
                if r.request.finish_reason is not None:
                    self.scheduler.finish(r.request)
                    self._live.pop(r.request.id, None)
                    finished.append(r.request)
        return finished

    def _record(self, batch: Batch, kind: str, padded: int, phases: tuple[float, float, float, float]
                ) -> StepStats:
        decode = sum(1 for r in batch.rows if r.new == 1 and r.cached > 0)
        return StepStats(kind=kind, is_decode=batch.is_decode, tokens=batch.num_tokens, padded=padded,
                         seqs=len(batch.rows), decode_rows=decode, prefill_tokens=batch.num_tokens - decode,
                         sampled=sum(r.samples for r in batch.rows), preempted=len(batch.preempted),
                         seconds=sum(phases), phases=phases)

    def run(self, on_finish: Callable[[Request], None] | None = None) -> list[Request]:
        """Step until no request is left; returns the finished requests in finishing order."""
        done: list[Request] = []
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
        return out

    def reset_stats(self) -> None:
        self.steps = []
        self.scheduler.num_preemptions = self.scheduler.num_aborted = 0

    def capture_report(self) -> dict[str, Any]:
        """What start captured: per module its sizes and seconds, the pool's MiB, and the whole setup seconds."""
        return {**self.executor.report(), "setup_s": round(self.setup_s, 3)}
