"""The paged KV cache: fixed-size pages per layer, one page table per sequence, page 0 a scratch page.

Layout ``[num_pages, page_size, num_kv_heads, head_dim]`` per layer for k, ``v_head_dim`` wide (default
``head_dim``) for v (FlashInfer's ``NHD``; the pair ``(cache.k[layer], cache.v[layer])`` is the ``paged_kv_cache``
its wrappers take). A multi-head latent attention shape (``config.mla``) stores its latent in k and its rotary key
in v, one "head" each, and a DSA indexer's keys in ``index_k`` (``[num_pages, page_size, index_head_dim]``).
Page 0 is never given to
a sequence: padded tokens (all-zero metadata) write into it and read from it, harmlessly.

Page tables live twice: as host lists (what the scheduler and the host half of a step's layout read) and as one
persistent device tensor, :meth:`KVCache.device_table` (``[rows, max_pages_per_seq]`` int32, one row per live
sequence, its *slot*; row 0 is all scratch), updated incrementally: a page gained or freed is a pending write,
flushed in one packed non-blocking copy and one ``index_copy_`` when a step's metadata asks for the table, so decode
steps gather their page layouts on the device instead of sending every page from the host.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Protocol, Sequence

import torch

from piecegraph.attention.backends import resolve_backend
from piecegraph.attention.metadata import to_device
from piecegraph.attention.pages import DEFAULT_PAGE_SIZE, SCRATCH_PAGE, pages_for
from piecegraph.attention.types import CacheShape, index_head_dim, indexed_layers, is_mla, v_head_dim
from piecegraph.program import describe

__all__ = ["DEFAULT_PAGE_SIZE", "SCRATCH_PAGE", "KVCache", "OutOfPagesError", "PageKeeper", "pages_for"]

class PageKeeper(Protocol):
    """What keeps pages no sequence holds for later reuse (``piecegraph.serve.prefix_cache.PrefixCache``): kept
    pages count as free (:attr:`KVCache.num_free_pages`) and are taken back, least useful first, when the free
    list runs short."""

    @property
    def num_kept(self) -> int:
        """Unreferenced pages it keeps."""

    def keep(self, pages: list[int]) -> list[int]:
        """``pages`` (in table order) lost their last holder: keep some; returns the rest, to be freed."""

    def evict(self, n: int) -> list[int]:
        """Give back ``n`` kept pages (at most :attr:`num_kept`), forgetting what they held."""


class OutOfPagesError(RuntimeError):
    """The KV cache has too few free pages for a request; nothing was allocated or freed by the failed call."""


def _key_value_pages(config: CacheShape, num_pages: int, page_size: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's zeroed k ``[pages, page, kv_heads, head_dim]`` and v (``v_head_dim`` wide: values may be
    narrower or wider than keys; MLA's v is the rotary key). On CUDA, keys and values of different widths are
    views of one page buffer as wide as the wider, so that k and v have the same strides: FlashInfer's paged
    kernels require it (the unused columns cost ``|head_dim - v_head_dim|`` per head and token)."""
    k_dim, v_dim = config.head_dim, v_head_dim(config)
    shape = (num_pages, page_size, config.num_kv_heads)
    if device.type != "cuda" or k_dim == v_dim or is_mla(config):
        return ([torch.zeros(*shape, k_dim, dtype=dtype, device=device) for _ in range(config.num_layers)],
                [torch.zeros(*shape, v_dim, dtype=dtype, device=device) for _ in range(config.num_layers)])
    wide = [torch.zeros(2, *shape, max(k_dim, v_dim), dtype=dtype, device=device) for _ in range(config.num_layers)]
    return [w[0, ..., :k_dim] for w in wide], [w[1, ..., :v_dim] for w in wide]


class KVCache:
    """Paged k/v storage of every layer, and the page tables of the sequences that live in it.

    ``num_pages`` counts the scratch page too, so ``num_pages - 1`` pages hold sequences. ``max_seq_len``
    (default ``config.max_seq_len``) bounds one sequence; it fixes the width of decode page tables, which full
    CUDA graphs bake in. The attention backend (``"auto" | "torch" | "flashinfer"``, default
    ``config.attention_backend``) lives with the cache: it owns the workspace and plans each step's metadata.
    Storage is zero-initialized, so pad tokens reading the scratch page stay finite.

    Example::

        cache = KVCache(TINY, num_pages=64)               # 63 usable pages of 16 tokens
        meta = AttentionMetadata.for_batch(cache, [("a", 0, 37)])  # allocates 3 pages for sequence "a"
        cache.free("a")
    """

    def __init__(self, config: CacheShape, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 max_seq_len: int | None = None, backend: str | None = None) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVCache {name} must be a positive int, got {describe(value)}")
        if num_pages < 2:
            raise ValueError(f"KVCache num_pages={num_pages}: page {SCRATCH_PAGE} is the scratch page, so at least "
                             "2 pages are needed")
        self.config = config
        self.num_pages, self.page_size = num_pages, page_size
        self.max_seq_len = config.max_seq_len if max_seq_len is None else max_seq_len
        if self.max_seq_len < 1:
            raise ValueError(f"KVCache max_seq_len must be positive, got {self.max_seq_len}")
        self.num_kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        self.v_head_dim, self.index_head_dim = v_head_dim(config), index_head_dim(config)
        self.k, self.v = _key_value_pages(config, num_pages, page_size, dtype, torch.device(device))
        # a DSA indexer's keys, one per token (same pages), in the layers whose indexer keeps them; an empty
        # tensor in a layer that shares an earlier layer's choice (a write there fails loudly); none without one
        kept = indexed_layers(config)
        self.index_k = [torch.zeros(num_pages if i in kept else 0, page_size, self.index_head_dim, dtype=dtype,
                                    device=device) for i in range(config.num_layers if kept else 0)]
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # popped from the end: low pages first
        self._refs = [0] * num_pages  # sequences holding each page (a shared prefix page: several)
        self.keeper: PageKeeper | None = None  # keeps unreferenced pages for reuse (a prefix cache); see attach
        self._tables: dict[Hashable, list[int]] = {}
        self._slots: dict[Hashable, int] = {}  # sequence -> its row of the device table
        self._free_slots: list[int] = []
        self._next_slot = 1  # row 0: the scratch row (all SCRATCH_PAGE), for pad rows
        self._writes: dict[tuple[int, int], int] = {}  # (row, column) -> page, not yet on the device
        self._table: torch.Tensor | None = None
        self.backend = resolve_backend(backend or config.attention_backend, self.device, dtype, config)

    @classmethod
    def for_sequences(cls, config: CacheShape, num_seqs: int, max_len: int, page_size: int = DEFAULT_PAGE_SIZE,
                      **kwargs) -> "KVCache":
        """A cache with room for ``num_seqs`` sequences of ``max_len`` tokens each (plus the scratch page)."""
        if num_seqs < 1 or max_len < 1:
            raise ValueError(f"KVCache.for_sequences needs num_seqs >= 1 and max_len >= 1, got {num_seqs}, {max_len}")
        num_pages = num_seqs * pages_for(max_len, page_size) + 1
        return cls(config, num_pages, page_size, max_seq_len=max_len, **kwargs)

    # -- storage ----------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def max_pages_per_seq(self) -> int:
        """Width of a decode page table: the pages of one sequence of ``max_seq_len`` tokens."""
        return pages_for(self.max_seq_len, self.page_size)

    # -- pages ------------------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        """Pages a reservation can take: free ones and the unreferenced pages the :attr:`keeper` keeps."""
        return len(self._free) + (self.keeper.num_kept if self.keeper is not None else 0)

    def refcount(self, page: int) -> int:
        """How many sequences hold ``page`` (0: free, or kept by the keeper)."""
        return self._refs[page]

    def attach(self, seq: Hashable, pages: Sequence[int]) -> None:
        """Start ``seq``'s page table with ``pages``, pages other sequences hold or the keeper kept (a cached
        prefix; the keeper takes them out of its kept set first), each gaining a reference. ``seq`` must hold no
        pages. The pages are shared, never copied: ``seq`` must not write them (its new tokens go to pages it
        reserves after them), and :meth:`free` releases a page only when its last holder goes."""
        if self.capacity(seq):
            raise ValueError(f"sequence {seq!r} already holds pages; attach shared pages before any reservation")
        if any(not SCRATCH_PAGE < p < self.num_pages for p in pages):
            raise ValueError(f"sequence {seq!r}: pages {list(pages)} include one outside 1..{self.num_pages - 1}")
        if len(pages) > self.max_pages_per_seq:
            raise ValueError(f"sequence {seq!r}: {len(pages)} pages exceed max_pages_per_seq "
                             f"{self.max_pages_per_seq}")
        table = self._tables.setdefault(seq, [])
        row = self._slot_for(seq)
        for page in pages:
            self._refs[page] += 1
            self._writes[row, len(table)] = page
            table.append(page)

    def page_table(self, seq: Hashable) -> list[int]:
        """The pages of ``seq`` in order (a copy); raises ``KeyError`` naming it when it holds none."""
        if seq not in self._tables:
            raise KeyError(f"sequence {seq!r} has no pages in this KV cache (allocate it first, or it was freed)")
        return list(self._tables[seq])

    def capacity(self, seq: Hashable) -> int:
        """Tokens the pages of ``seq`` can hold (0 for a sequence without pages)."""
        return self.num_pages_held(seq) * self.page_size

    def num_pages_held(self, seq: Hashable) -> int:
        """Pages ``seq`` holds (0 for a sequence without pages)."""
        return len(self._tables.get(seq, ()))

    def sequences(self) -> list[Hashable]:
        return list(self._tables)

    def reserve(self, lengths: Iterable[tuple[Hashable, int]]) -> None:
        """Grow each ``(seq, total_tokens)``'s page table to hold ``total_tokens``, all or nothing.

        Raises ``ValueError`` when a length exceeds ``max_seq_len`` and :class:`OutOfPagesError` when the free
        pages do not cover the whole request; in both cases no page table changes.
        """
        needs: dict[Hashable, int] = {}  # the sequences that grow, first-seen order: pages are handed out in it
        tables, ps, limit = self._tables, self.page_size, self.max_seq_len
        for seq, total in lengths:
            if total > limit:
                raise ValueError(f"sequence {seq!r} would hold {total} tokens, beyond the KV cache's max_seq_len "
                                 f"{limit}; build the cache with a larger max_seq_len")
            need = -(-total // ps) - len(tables.get(seq, ()))
            if need > 0 and need > needs.get(seq, 0):  # most decode rows need none: their last page has room
                needs[seq] = need
        wanted = sum(needs.values())
        if wanted > len(self._free):
            available = self.num_free_pages
            if wanted > available:
                raise OutOfPagesError(
                    f"the KV cache needs {wanted} more pages of {self.page_size} tokens for this batch but has "
                    f"{available} free of {self.num_pages - 1} ({len(self._tables)} sequences hold the rest). "
                    "Free finished sequences (cache.free(seq)), run fewer sequences per step, or build a larger "
                    "cache.")
            self._free.extend(self.keeper.evict(wanted - len(self._free)))  # least recently used kept pages
        refs = self._refs
        for seq, n in needs.items():
            table = self._tables.setdefault(seq, [])
            row = self._slot_for(seq)
            for _ in range(n):
                page = self._free.pop()
                refs[page] = 1
                self._writes[row, len(table)] = page
                table.append(page)

    def discard(self, seq: Hashable) -> int:
        """Release the pages of ``seq`` when it holds any (:meth:`free`); returns how many, 0 for a sequence
        without pages: the clean-up of sequences a step may or may not have reserved."""
        return self.free(seq) if self.capacity(seq) else 0

    def free(self, seq: Hashable) -> int:
        """Release every page of ``seq``; returns how many. A page another sequence still holds stays; one whose
        last holder went is free again, or kept by the :attr:`keeper`. Unknown sequences raise ``KeyError``."""
        if seq not in self._tables:
            raise KeyError(f"sequence {seq!r} has no pages in this KV cache")
        pages = self._tables.pop(seq)
        refs, released = self._refs, []
        for page in pages:
            refs[page] -= 1
            if not refs[page]:
                released.append(page)
        if released and self.keeper is not None:
            released = self.keeper.keep(released)
        self._free.extend(reversed(released))
        row = self._slots.pop(seq)
        for col in range(len(pages)):  # back to scratch: a reused row never shows a stale page
            self._writes[row, col] = SCRATCH_PAGE
        self._free_slots.append(row)
        return len(pages)

    # -- the device page table ----------------------------------------------------------------------------
    def _slot_for(self, seq: Hashable) -> int:
        row = self._slots.get(seq)
        if row is None:
            row = self._free_slots.pop() if self._free_slots else self._claim_row()
            self._slots[seq] = row
        return row

    def _claim_row(self) -> int:
        row, self._next_slot = self._next_slot, self._next_slot + 1
        return row

    def slot(self, seq: Hashable) -> int:
        """The row of ``seq`` in :meth:`device_table` (a sequence holding pages); ``KeyError`` otherwise."""
        if seq not in self._slots:
            raise KeyError(f"sequence {seq!r} has no pages in this KV cache (allocate it first, or it was freed)")
        return self._slots[seq]

    def pages_view(self, seq: Hashable) -> list[int]:
        """The live page list of ``seq`` (not a copy: read it, never write it). Later reservations append to it
        and a free leaves it as it was, so entries below the pages of a length already reserved stay valid."""
        return self._tables[seq]

    def device_table(self) -> torch.Tensor:
        """Every live sequence's pages on the device: ``[rows, max_pages_per_seq]`` int32, row :meth:`slot`,
        scratch past a sequence's pages; row 0 all scratch. The pending page changes are written first (one
        packed non-blocking copy from pinned memory, one ``index_copy_``; nothing waits for the device)."""
        rows_needed = self._next_slot
        if self._table is None or self._table.shape[0] < rows_needed:
            grown = torch.zeros(max(2 * rows_needed, 16), self.max_pages_per_seq, dtype=torch.int32,
                                device=self.device)
            if self._table is not None:
                grown[:self._table.shape[0]] = self._table
            self._table = grown
        if self._writes:  # distinct (row, column) keys: a later write to the same entry replaced the earlier
            width = self._table.shape[1]
            host = {"at": [r * width + c for r, c in self._writes], "pages": list(self._writes.values())}
            self._writes = {}
            dev = to_device(host, self.device)
            self._table.view(-1).index_copy_(0, dev["at"], dev["pages"].to(torch.int32))
        return self._table

    def slot_of(self, seq: Hashable, position: int) -> int:
        """Flat slot (``page * page_size + offset``) of ``seq``'s token at ``position``."""
        table = self._tables[seq]
        return table[position // self.page_size] * self.page_size + position % self.page_size

    def __repr__(self) -> str:
        return (f"KVCache({self.num_pages} pages x {self.page_size} tokens, {len(self.k)} layers, "
                f"{self.num_kv_heads} kv heads x {self.head_dim}, {self.dtype}, {self.device}, "
                f"backend={self.backend.name}, {len(self._tables)} sequences, {self.num_free_pages} pages free)")
