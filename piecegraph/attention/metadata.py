"""Per-step attention metadata, built once per forward step on the host from a batch description.

A batch is a list of ``(seq, num_cached, num_new)``: prefills (``num_cached`` 0), decode rows (``num_new`` 1) and
chunked-prefill continuations (both > 0) mixed freely, their new tokens packed sequence after sequence. The
builder reserves the pages the step needs, lays out every token's position and cache slot, and lets the cache's
attention backend plan the step (once, for all layers), outside any graph.
"""

from __future__ import annotations

import array
import dataclasses
import functools
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import sub
from typing import Any, Hashable, Iterator, Sequence

import torch

from piecegraph.attention.pages import SCRATCH_PAGE
from piecegraph.attention.types import PagedCache
from piecegraph.program import describe

# Fields a full CUDA graph never reads: per-step host data, used (if at all) before a replay by
# ``for_cuda_graph``. StaticContext skips them when it checks that a replay's metadata matches its capture.
_PER_STEP = {"piecegraph_static": "per_step"}


def _has_device_table(cache: PagedCache) -> bool:
    """A :class:`~piecegraph.attention.kv_cache.KVCache` keeps one; another ``PagedCache`` builds page layouts on
    the host."""
    return hasattr(cache, "device_table")


@dataclass(frozen=True)
class BatchLayout:
    """The host side of one step: per sequence its id, new tokens, kv length after the step and its pages.

    ``pages[i]`` may be longer than the step needs (pages reserved for later tokens; a cache's live list, see
    :meth:`KVCache.pages_view`): readers use its first ``pages_for(kv_lens[i], page_size)`` entries only.
    ``slots``: each sequence's row of the cache's device page table (:meth:`KVCache.device_table`; 0 = the
    scratch row), or ``None`` when the cache has none: then page layouts are built from ``pages`` on the host.
    """

    seq_ids: tuple[Hashable, ...]
    num_new: tuple[int, ...]
    kv_lens: tuple[int, ...]
    pages: tuple[Sequence[int], ...]
    page_size: int
    slots: tuple[int, ...] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @functools.cached_property  # read several times per step (dispatch, plan, graph view): O(rows) each
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (a pure decode step: the only kind ``mode="full"`` captures)."""
        return all(n == 1 for n in self.num_new)

    def token_positions(self) -> list[int]:
        return [p for new, kv in zip(self.num_new, self.kv_lens) for p in range(kv - new, kv)]

    def token_slots(self) -> list[int]:
        ps = self.page_size
        return [pages[p // ps] * ps + p % ps
                for new, kv, pages in zip(self.num_new, self.kv_lens, self.pages) for p in range(kv - new, kv)]


@dataclass
class AttentionMetadata:
    """What the attention split op reads from the forward context, for ``n`` tokens.

    ``positions`` and ``slot_mapping`` (int64 ``[n]``, on the cache's device) give each new token's position and
    the flat cache slot it writes (``page * page_size + offset``; 0 = the scratch page). In a pure decode step
    the sequences are the tokens, and ``page_table`` (int64 ``[n, cache.max_pages_per_seq]``, scratch-padded;
    only for a backend whose ``reads_page_table`` is true) and ``kv_lens`` (int64 ``[n]``) are set: all
    token-aligned, so a full CUDA graph can capture the op and piecegraph refills copies of them per replay.
    ``backend`` holds the backend's tensors of this step (token-aligned ones only in a decode step) and ``plan``
    its host-side plan. ``n`` may be smaller than the token count the model is called with: the caller padded
    the batch, and pad rows come out zero.
    """

    cache: PagedCache
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    page_table: torch.Tensor | None = None
    kv_lens: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    plan: Any = field(default=None, metadata=_PER_STEP)
    layout: BatchLayout | None = field(default=None, metadata=_PER_STEP)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def is_decode(self) -> bool:
        if self.layout is not None:
            return self.layout.is_decode
        return self.page_table is not None

    # -- builders ---------------------------------------------------------------------------------------
    @classmethod
    def for_batch(cls, cache: PagedCache, seqs: Sequence[tuple[Hashable, int, int]]) -> "AttentionMetadata":
        """Metadata of one step over ``seqs`` = ``[(seq, num_cached, num_new), ...]``, tokens packed in order.

        Reserves the pages each sequence needs for ``num_cached + num_new`` tokens (all or nothing: see
        :meth:`KVCache.reserve`); a sequence with ``num_cached > 0`` must already hold pages for them. Sequence
        ids are distinct within a step. The backend plans here, so build it once per step, not per layer.
        """
        if not seqs:
            raise ValueError("AttentionMetadata.for_batch needs at least one sequence")
        ids = [s for s, _, _ in seqs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"sequence ids must be distinct within a step, got {ids}")
        capacity = cache.capacity
        num_new, kv_lens = [], []  # built in the checking pass: one loop over 1000+ rows, not three
        for seq, cached, new in seqs:
            if not (isinstance(cached, int) and isinstance(new, int)) or cached < 0 or new < 1:
                raise ValueError(f"sequence {seq!r}: need num_cached >= 0 and num_new >= 1 (ints), "
                                 f"got num_cached={describe(cached)}, num_new={describe(new)}")
            if cached and cached > capacity(seq):  # a prefill (cached 0) needs no look-up
                raise ValueError(f"sequence {seq!r} claims {cached} cached tokens but holds pages for only "
                                 f"{capacity(seq)}; a sequence's earlier tokens must have gone through this cache "
                                 "(or reserve its pages first with cache.reserve([(seq, length)]))")
            num_new.append(new)
            kv_lens.append(cached + new)
        num_new, kv_lens = tuple(num_new), tuple(kv_lens)
        cache.reserve(zip(ids, kv_lens))
        device_table = _has_device_table(cache)
        pages = tuple(map(cache.pages_view if device_table else cache.page_table, ids))
        layout = BatchLayout(seq_ids=tuple(ids), num_new=num_new, kv_lens=kv_lens, pages=pages,
                             page_size=cache.page_size, slots=tuple(map(cache.slot, ids)) if device_table else None)
        return cls.from_layout(cache, layout)

    @classmethod
    def for_decode(cls, cache: PagedCache, seqs: Sequence[tuple[Hashable, int]]) -> "AttentionMetadata":
        """A pure decode step: ``seqs`` = ``[(seq, num_cached), ...]``, one new token each."""
        return cls.for_batch(cache, [(seq, cached, 1) for seq, cached in seqs])

    @classmethod
    def dummy(cls, cache: PagedCache, n: int) -> "AttentionMetadata":
        """A decode step of ``n`` pad tokens on the scratch page (position 0): for warm-up and graph capture."""
        if n < 1:
            raise ValueError(f"AttentionMetadata.dummy needs n >= 1, got {n}")
        layout = BatchLayout(seq_ids=tuple(range(n)), num_new=(1,) * n, kv_lens=(1,) * n,
                             pages=((SCRATCH_PAGE,),) * n, page_size=cache.page_size,
                             slots=(0,) * n if _has_device_table(cache) else None)
        return cls.from_layout(cache, layout)

    @classmethod
    def from_layout(cls, cache: PagedCache, layout: BatchLayout) -> "AttentionMetadata":
        """Lay out tokens on the device and let the backend plan (what :meth:`for_batch` does after reserving)."""
        # A large step (1000+ rows) lays out its tokens with C-level iteration and whole-tensor ops: with the
        # cache's device page table (layout.slots set) each token's flat slot is looked up there (one
        # index_select), so the host never walks the page lists. A small step (batch-1 decode) walks them: the
        # tensor ops' fixed cost is more than its few tokens' Python (measured on the host at 1 and 10 rows).
        decode, slots = layout.is_decode, layout.slots
        lookup = slots is not None and layout.num_tokens > SMALL_STEP
        positions = token_positions_tensor(layout) if lookup else layout.token_positions()
        host: dict[str, torch.Tensor | Sequence[int]] = {"positions": positions}
        if lookup:
            rows = host_tensor(slots if decode else list(_repeat_each(slots, layout.num_new)))
            host["at"] = rows * cache.max_pages_per_seq + positions.div(layout.page_size, rounding_mode="floor")
            host["offset"] = positions.remainder(layout.page_size)
        else:
            host["slot_mapping"] = layout.token_slots()
        # The dense decode page table, only for a backend that reads it (FlashInfer plans its own CSR layout):
        # gathered on the device from the cache's page table by slot, or (a cache without one) built on the host.
        table = decode and getattr(cache.backend, "reads_page_table", True)
        gather = table and slots is not None
        if gather:
            host["slots"] = slots
        elif table:
            width, pad = cache.max_pages_per_seq, (SCRATCH_PAGE,)
            host["page_table"] = [p for pages in layout.pages for p in (*pages, *pad * (width - len(pages)))]
        if decode:
            host["kv_lens"] = layout.kv_lens
        dev = to_device(host, cache.device)
        if lookup:
            pages = cache.device_table().view(-1).index_select(0, dev.pop("at"))
            dev["slot_mapping"] = torch.add(dev.pop("offset"), pages, alpha=layout.page_size)
        if gather:
            dev["page_table"] = cache.device_table().index_select(0, dev.pop("slots")).long()
        elif table:
            dev["page_table"] = dev["page_table"].view(layout.num_seqs, cache.max_pages_per_seq)
        meta = cls(cache=cache, layout=layout, **dev)
        cache.backend.plan(meta)
        return meta

    # -- CUDA graphs ------------------------------------------------------------------------------------
    def for_cuda_graph(self, size: int) -> "AttentionMetadata":
        """The metadata a full CUDA graph of ``size`` tokens captures or replays this step with.

        Pure decode steps pad to ``size`` rows (the backend's graph layout, or piecegraph's zero padding of
        token-aligned fields). A step with prefill rows only on a backend whose ``captures_mixed_steps`` is true
        (FlashInfer: ``flashinfer_mixed.py``); elsewhere it raises.
        """
        if not self.is_decode and not getattr(self.cache.backend, "captures_mixed_steps", False):
            raise ValueError(
                "mode='full' captures pure decode steps only (every sequence adding one token) on the "
                f"{getattr(self.cache.backend, 'name', '?')} attention backend; this step has {self.num_tokens} "
                f"tokens over {len(self.layout.seq_ids) if self.layout else '?'} sequences. Use mode='piecewise' "
                "for prefill and mixed steps."
            )
        return self.cache.backend.for_cuda_graph(self, size)

    def replace(self, **changes: Any) -> "AttentionMetadata":
        return dataclasses.replace(self, **changes)


def dummy(cache: PagedCache, n: int) -> AttentionMetadata:
    """Shorthand for :meth:`AttentionMetadata.dummy`."""
    return AttentionMetadata.dummy(cache, n)


SMALL_STEP = 64  # tokens: up to here a step's layout is built per token in Python (cheaper than tensor ops)


def token_positions_tensor(layout: BatchLayout) -> torch.Tensor:
    """``layout.token_positions()`` as an int64 CPU tensor, without a Python loop over tokens."""
    if layout.is_decode:
        return host_tensor(layout.kv_lens) - 1
    return host_tensor(list(chain.from_iterable(map(range, map(sub, layout.kv_lens, layout.num_new),
                                                    layout.kv_lens))))


def _repeat_each(values: Sequence[int], counts: Sequence[int]) -> Iterator[int]:
    """``values[i]`` ``counts[i]`` times, in order (C-level iteration)."""
    return chain.from_iterable(map(repeat, values, counts))


def to_device(host: dict[str, Sequence[int] | torch.Tensor], device: torch.device, dtype: torch.dtype = torch.int64
              ) -> dict[str, torch.Tensor]:
    """Host ints (lists, tuples or 1-d CPU tensors) as ``dtype`` tensors on ``device``, views of one packed
    buffer: on CUDA one pinned staging buffer and one non-blocking copy per call (not per field). The staging
    buffer comes from torch's caching host allocator, which keeps it from reuse until the copy ran."""
    values = list(host.values())
    if all(not isinstance(v, torch.Tensor) for v in values):
        flat = array.array(_ARRAY_CODES[dtype])
        for v in values:
            flat.extend(v)  # C-level, per field
        packed = torch.frombuffer(flat, dtype=dtype) if flat else torch.empty(0, dtype=dtype)
        if device.type == "cuda":
            packed = packed.pin_memory()
    else:
        parts = [v.to(dtype) if isinstance(v, torch.Tensor) else host_tensor(v, dtype) for v in values]
        size = sum(len(v) for v in parts)
        packed = torch.empty(size, dtype=dtype, pin_memory=device.type == "cuda")
        torch.cat(parts, out=packed)  # straight into the (pinned) staging buffer: no second host copy
    if device.type == "cuda":
        packed = packed.to(device, non_blocking=True)
    out, start = {}, 0
    for name, v in zip(host, values):
        out[name] = packed[start:start + len(v)]
        start += len(v)
    return out


_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def host_tensor(values: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU tensor of ``values`` (int32 or int64), through ``array``: about 3x faster than ``torch.tensor`` on
    a list, which matters for the page layouts of 1000-row steps (tens of thousands of ints per step)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)
