"""Automatic prefix caching: full KV pages shared between requests whose tokens up to and in them are equal.

Each full page of a request's tokens has a key in a hash chain: ``(parent entry, the page's token ids)``, the
parent being the entry of the page before it (:data:`ROOT` for the first page), as vLLM's automatic prefix caching
hashes ``(parent hash, block tokens)``. Keys are compared exactly (a dict hashes a key, then compares the tuples),
so a hash collision can never hand a request another prefix's pages; entry ids are never reused, so a key whose
parent was evicted can never match again.

A page's life: a request computes it (the step that writes its k/v is launched) and :meth:`PrefixCache.commit`
enters it; later requests :meth:`~PrefixCache.attach` it (one more reference in the KV cache); when its last holder
goes, the KV cache hands it to :meth:`~PrefixCache.keep`, which keeps it unreferenced in least-recently-used order
(kept pages count as free); a request that matches it takes it back out, or the KV cache's reservation evicts it,
least recently used first (a request's pages are kept last page first, so a prefix outlives its tails), and its
entry is forgotten. Preemption and aborts release pages the same way as finishing does.

The last-page rule: a match covers at most the full pages before the request's last token
(``(num_tokens - 1) // page_size`` pages), so at least one token is computed (its logits give the next token) and
every token computed lands in a page after the shared ones: a shared page is never written, and no copy is
needed. A fully cached prompt whose length is a multiple of the page size recomputes its last page (at most
``page_size`` tokens), as vLLM does; copy-on-write would save those tokens at the price of a page copy per hit.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Sequence

from piecegraph.attention.kv_cache import KVCache
from piecegraph.serve.request import Request

ROOT = 0  # the parent of a prompt's first page


class PrefixCache:
    """The prefix cache of ``cache``: its :attr:`~KVCache.keeper` (one per KV cache; engines sharing a cache share
    it, so they must run the same weights, as serve-bench's interleaved modes do). Host bookkeeping only: nothing
    here touches the device. ``prompt_tokens`` / ``cached_tokens`` count the prompt tokens of first admissions and
    how many of them were found cached (:meth:`count`)."""

    def __init__(self, cache: KVCache) -> None:
        if cache.keeper is not None:
            raise ValueError("this KV cache already has a page keeper; use PrefixCache.of(cache) to share it")
        self.cache, self.page_size = cache, cache.page_size
        self._entries: dict[tuple[int, tuple[int, ...]], int] = {}  # key -> entry id
        self._page_of: dict[int, int] = {}  # entry id -> page
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # page -> its key (cached pages only)
        self._kept: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, least recently used first
        self._ids = itertools.count(ROOT + 1)
        self.prompt_tokens = self.cached_tokens = 0
        cache.keeper = self

    @classmethod
    def of(cls, cache: KVCache) -> "PrefixCache":
        """``cache``'s prefix cache: the one it has, else a new one."""
        keeper = cache.keeper
        if keeper is None:
            return cls(cache)
        if not isinstance(keeper, cls):
            raise ValueError(f"this KV cache's page keeper is a {type(keeper).__name__}, not a PrefixCache")
        return keeper

    # -- the KV cache's keeper ------------------------------------------------------------------------------
    @property
    def num_kept(self) -> int:
        """Cached pages no sequence holds (they count as free: a reservation evicts them)."""
        return len(self._kept)

    @property
    def num_cached(self) -> int:
        """Pages with an entry, held or kept."""
        return len(self._key_of)

    def keep(self, pages: list[int]) -> list[int]:
        """Pages (in table order) whose last holder went: keep the cached ones, most recently used now, the last
        page first (so it is evicted before the pages its prefix needs); returns the others, to be freed."""
        other = []
        for page in reversed(pages):
            if page in self._key_of:
                self._kept[page] = None
            else:
                other.append(page)
        other.reverse()
        return other

    def evict(self, n: int) -> list[int]:
        """Forget the ``n`` least recently used kept pages and give them back to the KV cache."""
        pages = []
        for _ in range(n):
            page, _ = self._kept.popitem(last=False)
            key = self._key_of.pop(page, None)
            if key is not None:
                self._page_of.pop(self._entries.pop(key), None)
            pages.append(page)
        return pages

    def reset(self) -> None:
        """Forget every entry (a cold cache): kept pages stay counted as free until a reservation takes them."""
        self._entries.clear()
        self._page_of.clear()
        self._key_of.clear()

    # -- requests -------------------------------------------------------------------------------------------
    def lookup(self, request: Request) -> tuple[list[int], list[int]]:
        """``(pages, entries)`` of ``request``'s longest cached prefix of full pages, within the last-page rule
        (see the module docstring). Reads host-known tokens only: call it for a request with none in flight."""
        ps, parent = self.page_size, ROOT
        pages: list[int] = []
        entries: list[int] = []
        for i in range((request.num_tokens - 1) // ps):
            entry = self._entries.get((parent, tuple(request.token_slice(i * ps, (i + 1) * ps))))
            if entry is None:
                break
            pages.append(self._page_of[entry])
            entries.append(entry)
            parent = entry
        return pages, entries

    def kept_among(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` are kept (unreferenced): attaching them takes them out of the free count."""
        kept = self._kept
        return sum(1 for p in pages if p in kept)

    def attach(self, request: Request, pages: list[int], entries: list[int]) -> None:
        """Give ``request`` (holding no pages) the cached ``pages`` that :meth:`lookup` found, and start its chain
        there; they are the most recently used now."""
        for page in pages:
            self._kept.pop(page, None)
        if pages:
            self.cache.attach(request.id, pages)
        request.prefix_entries = list(entries)

    def commit(self, request: Request) -> None:
        """Enter ``request``'s full pages whose k/v are computed (a launched step writes them) and whose tokens
        the host knows, past those already in its chain. A page whose key is already cached (another request
        computed the same prefix at the same time) stays the request's own; the chain goes on from the cached
        entry."""
        ps, chain = self.page_size, request.prefix_entries
        done = min(request.num_computed, len(request.prompt) + len(request.output)) // ps
        if done <= len(chain):
            return
        table = self.cache.pages_view(request.id)
        parent = chain[-1] if chain else ROOT
        for i in range(len(chain), done):
            key = (parent, tuple(request.token_slice(i * ps, (i + 1) * ps)))
            entry = self._entries.get(key)
            if entry is None:
                entry, page = next(self._ids), table[i]
                self._entries[key], self._page_of[entry], self._key_of[page] = entry, page, key
            chain.append(entry)
            parent = entry

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Record a first admission: its prompt tokens and how many were cached (the hit rate's terms)."""
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def stats(self) -> dict[str, float | int]:
        """Prompt tokens admitted, how many were cached, the hit rate, and the pages cached and kept now."""
        rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "hit_rate": rate,
                "cached_pages": self.num_cached, "kept_pages": self.num_kept}

    def reset_stats(self) -> None:
        self.prompt_tokens = self.cached_tokens = 0
