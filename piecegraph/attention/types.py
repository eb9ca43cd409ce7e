"""What the attention stage reads of a model and of a cache, as protocols (the bottom of the stage).

The reference decoder's ``ModelConfig`` and ``piecegraph.hf``'s cache shape are both a :class:`CacheShape`; the
per-step metadata and the backends read the cache through :class:`PagedCache`, so neither imports
:class:`~piecegraph.attention.kv_cache.KVCache`, which sits above them (it owns its backend).
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Protocol

import torch

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")


class CacheShape(Protocol):
    """The model dimensions a KV cache and an attention backend are built for.

    Optional attributes, read with :func:`v_head_dim`, :func:`index_head_dim` and :func:`is_mla` (absent means
    the default): ``v_head_dim`` (the cache's v per head; default ``head_dim``: values as wide as keys),
    ``index_head_dim`` (a DSA indexer's key cache per token; default 0: none) and ``mla`` (multi-head latent
    attention: k holds the latent of ``head_dim``, v the rotary key of ``v_head_dim``, one "head" per token).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int  # the default longest sequence of a cache
    attention_backend: str  # one of ATTENTION_BACKENDS


class PagedCache(Protocol):
    """What the metadata builder and the backends read of a paged KV cache."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    page_size: int
    max_seq_len: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    backend: Any

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def max_pages_per_seq(self) -> int: ...

    def capacity(self, seq: Hashable) -> int: ...

    def page_table(self, seq: Hashable) -> list[int]: ...

    def reserve(self, lengths: Iterable[tuple[Hashable, int]]) -> None: ...


def v_head_dim(config: CacheShape) -> int:
    """The width of the cache's v per kv head: ``config.v_head_dim``, else ``config.head_dim``."""
    return int(getattr(config, "v_head_dim", None) or config.head_dim)


def index_head_dim(config: CacheShape) -> int:
    """The width of a DSA indexer's cached key per token: ``config.index_head_dim``, else 0 (no indexer)."""
    return int(getattr(config, "index_head_dim", None) or 0)


def indexed_layers(config: CacheShape) -> tuple[int, ...]:
    """The layers whose DSA indexer caches its keys: none without an indexer; those ``"full"`` in
    ``config.layer_indexer_types`` where the config has them (a ``"shared"`` layer reuses an earlier layer's
    choice and keeps no keys); else every layer."""
    if not index_head_dim(config):
        return ()
    types = getattr(config, "layer_indexer_types", None)
    if not types:
        return tuple(range(config.num_layers))
    return tuple(i for i, kind in enumerate(types) if kind == "full")


def is_mla(config: CacheShape) -> bool:
    """Whether ``config`` is a multi-head latent attention shape (``config.mla``; see :class:`CacheShape`)."""
    return bool(getattr(config, "mla", False))
