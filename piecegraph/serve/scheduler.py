"""The scheduler: a waiting and a running queue, a per-step token budget, chunked prefill, pages, preemption.

Each step takes, in order: every running request (oldest first: decode rows take one token, unfinished
prefills the next chunk that fits the budget), then waiting requests (first come, first served) while the
budget, ``max_num_seqs`` and the free pages allow. A running request whose pages cannot grow preempts the
newest running request (its pages freed, back to the front of the waiting queue, recomputed later), repeatedly,
down to preempting itself. Pages are reserved here, before the step's metadata is built, so building it never
runs out of pages. Requests are never lost or duplicated: each is in exactly one of waiting, running, finished.

Overlapped steps (the engine schedules step k+1 before the host knows step k's tokens): a request's tokens in
flight count as tokens to compute (a decode row's input is the previous step's token, still on the device); a
request whose every output is sampled (:attr:`Request.fully_scheduled`) is skipped while its last tokens are in
flight; a waiting request is admitted only once none of its tokens is in flight (a preempted request is
prefilled again from host tokens).

Prefix caching (``prefix_cache=True``, ``serve/prefix_cache.py``): a request admitted for the first time, or again
after a preemption, starts with the cached pages of its longest cached prefix attached and its prefill after them.
Kept (unreferenced) cached pages count as free for admission and growth; a reservation evicts them, least recently
used first. Finished, aborted and preempted requests enter their computed full pages before their pages are freed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, NamedTuple

from piecegraph.attention.kv_cache import KVCache
from piecegraph.attention.pages import pages_for
from piecegraph.serve.prefix_cache import PrefixCache
from piecegraph.serve.request import Request, Status


class Row(NamedTuple):
    """One request's part of a step: ``new`` tokens after ``cached`` ones already in the cache. Immutable; a
    named tuple rather than a frozen dataclass because a step builds one per running request (1000+), and a
    frozen dataclass's ``__init__`` costs twice as much."""

    request: Request
    cached: int
    new: int

    @property
    def samples(self) -> bool:
        """Whether this row ends at the request's last token, so the step emits its next token."""
        return self.cached + self.new == self.request.num_tokens


@dataclass
class Batch:
    """What one step runs: its rows (tokens packed row after row) and the requests it preempted."""

    rows: list[Row] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.new for r in self.rows)

    @property
    def is_decode(self) -> bool:
        """Every row adds exactly one token: a pure decode step (what full graphs capture)."""
        return bool(self.rows) and all(r.new == 1 for r in self.rows)


class Scheduler:
    """Queues and pages of the engine; see the module docstring. ``cache`` holds the pages (its sequences are
    the running requests' ids). ``token_budget`` bounds the tokens of a step, ``max_num_seqs`` the running
    requests. ``prefix_cache``: share cached prefix pages (:attr:`prefix`, the cache's own
    :class:`~piecegraph.serve.prefix_cache.PrefixCache`; ``None`` when off)."""

    def __init__(self, cache: KVCache, token_budget: int, max_num_seqs: int, prefix_cache: bool = False) -> None:
        self.cache = cache
        self.prefix: PrefixCache | None = PrefixCache.of(cache) if prefix_cache else None
        self.token_budget, self.max_num_seqs = token_budget, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = self.num_aborted = 0

    # -- queues -----------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue ``request``; refuses one that could never fit the cache, even alone."""
        usable = (self.cache.num_pages - 1) * self.cache.page_size
        if request.max_len > min(self.cache.max_seq_len, usable):
            raise ValueError(
                f"request {request.id!r} needs up to {request.max_len} tokens (prompt {len(request.prompt)} + "
                f"max_new_tokens {request.params.max_new_tokens}), more than the KV cache holds for one sequence "
                f"(max_seq_len {self.cache.max_seq_len}, {usable} tokens of pages); shorten it or enlarge the cache")
        request.status = Status.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """Take a finished request out of its queue (running; waiting when it was preempted while its last token
        was in flight) and release its pages."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status, request.inflight = Status.FINISHED, 0
        self._release(request)

    def abort(self, request: Request) -> None:
        """Take a waiting or running request out of its queue between steps, free its pages at once and finish
        it with ``finish_reason="aborted"``; a finished request is left as it is (idempotent)."""
        if request.status is Status.FINISHED:
            return
        self.finish(request)
        request.finish_reason = "aborted"
        self.num_aborted += 1

    # -- one step ---------------------------------------------------------------------------------------
    def schedule(self) -> Batch:
        """The next step's rows, pages reserved; an empty batch when nothing is queued."""
        batch, budget = Batch(), self.token_budget
        rows, running, ps = batch.rows, Status.RUNNING, self.cache.page_size
        held = self.cache.num_pages_held
        # The running loop runs once per running request every step (1000+): the Request properties it needs
        # (fully_scheduled, pending) are inlined, and _grow is entered only when a page must be added.
        for request in list(self.running):
            if budget == 0 or request.status is not running:
                break
            generated = len(request.output) + request.inflight
            if generated >= request.params.max_new_tokens:
                continue  # fully scheduled: its last token is in flight, it finishes when the host learns it
            cached = request.num_computed
            new = len(request.prompt) + generated - cached
            if new > budget:
                new = budget
            if -(-(cached + new) // ps) > held(request.id) and not self._grow(request, cached + new, batch):
                break  # preempted itself: every request after it was preempted first
            rows.append(Row(request, cached, new))
            budget -= new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not batch.preempted:
            request = self.waiting[0]
            if request.inflight:
                break  # preempted with a token in flight: prefilled again once the host knows it (next step)
            if not self._admit(request, budget):
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            new = min(request.pending, budget)
            batch.rows.append(Row(request, request.num_computed, new))
            budget -= new
        return batch

    def _admit(self, request: Request, budget: int) -> bool:
        """Give a waiting request (no pages, nothing computed) its cached prefix and the pages of its first
        chunk; False, changing nothing, when the free pages (kept cached ones included) are too few."""
        prefix, ps = self.prefix, self.cache.page_size
        shared, entries = prefix.lookup(request) if prefix is not None else ([], [])
        start = len(shared) * ps
        total = start + min(request.num_tokens - start, budget)
        taken = prefix.kept_among(shared) if shared else 0  # attached, they no longer count as free
        if pages_for(total, ps) - len(shared) + taken > self.cache.num_free_pages:
            return False
        if prefix is not None:
            prefix.attach(request, shared, entries)
            if not request.preemptions:
                request.cached_tokens = start
                prefix.count(len(request.prompt), start)
        request.num_computed = start
        self.cache.reserve([(request.id, total)])
        return True

    def _grow(self, request: Request, total: int, batch: Batch) -> bool:
        """Reserve pages for ``total`` tokens of ``request``, preempting the newest running requests as needed;
        False when ``request`` itself had to go."""
        needed = self._pages_needed(request.id, total)
        if not needed:  # most decode steps: the last page has room
            return True
        while needed > self.cache.num_free_pages:
            victim = self.running[-1]
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is request:
                return False
        self.cache.reserve([(request.id, total)])
        return True

    def preempt(self, request: Request) -> None:
        """Free ``request``'s pages and queue it first in line, to be prefilled again (prompt + outputs)."""
        self.running.remove(request)
        self._release(request)
        request.num_computed = 0
        request.preemptions += 1
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        """Free ``request``'s pages, its computed full pages entered in the prefix cache first."""
        if self.prefix is not None and self.cache.num_pages_held(request.id):
            self.prefix.commit(request)
        request.prefix_entries = []
        self.cache.discard(request.id)

    def _pages_needed(self, seq: Hashable, total: int) -> int:
        return max(0, pages_for(total, self.cache.page_size) - self.cache.num_pages_held(seq))
