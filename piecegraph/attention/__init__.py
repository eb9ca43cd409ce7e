"""Paged attention: the KV cache, per-step metadata, the attention backends and THE split op.

Bottom to top (imports point down this list): ``types`` (what the stage reads of a model and of a cache) and
``pages`` (page arithmetic); ``metadata`` (one step's layout, built once per step on the host); ``backends``
(``torch`` and ``flashinfer``, and the registry that picks one); ``kv_cache`` (storage, page tables and the
cache's backend); ``op`` (``piecegraph_models::attention``: KV-cache write and attention in one split op).

Importing this package registers ``torch.ops.piecegraph_models.attention`` and declares it a split op. Any model
whose shape is a :class:`CacheShape` (the reference decoder's ``ModelConfig``, ``piecegraph.hf``'s cache shape)
can call it.
"""

from piecegraph.attention import op as _op  # noqa: F401  (registers the split op)
from piecegraph.attention.backends import flashinfer_available, resolve_backend
from piecegraph.attention.kv_cache import KVCache, OutOfPagesError
from piecegraph.attention.metadata import AttentionMetadata, BatchLayout, dummy
from piecegraph.attention.pages import DEFAULT_PAGE_SIZE, SCRATCH_PAGE, pages_for
from piecegraph.attention.types import ATTENTION_BACKENDS, CacheShape, PagedCache

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "BatchLayout",
    "CacheShape",
    "DEFAULT_PAGE_SIZE",
    "KVCache",
    "OutOfPagesError",
    "PagedCache",
    "SCRATCH_PAGE",
    "dummy",
    "flashinfer_available",
    "pages_for",
    "resolve_backend",
]
