"""The forward context: per-call metadata (attention's sequence layout, the KV cache) that split ops read.

Split ops take their metadata from here rather than from graph inputs, so the traced graph stays the same for
every batch and the metadata's shapes never reach Dynamo.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator

_CURRENT: ContextVar[Any] = ContextVar("piecegraph_forward_context", default=None)


@contextlib.contextmanager
def forward_context(meta: Any) -> Iterator[Any]:
    """Make ``meta`` the metadata of the forward calls made inside the block.

    ``meta`` is any object, usually a dataclass. In ``mode="full"`` the graph also captures the split ops, so
    piecegraph copies ``meta``'s token-aligned tensor fields (dim 0 = token count) into static buffers, pads
    them with zeros, and requires every other field to be the same object as when that size was captured.

    Refuses nesting: a forward inside a forward is a bug (whose metadata would the inner call see?).
    """
    if _CURRENT.get() is not None:
        raise RuntimeError(
            "piecegraph.forward_context is already active; contexts do not nest. "
            "Leave the outer `with forward_context(...)` block before entering another."
        )
    token = _CURRENT.set(meta)
    try:
        yield meta
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> Any:
    """The metadata of the current forward call; raises if no :func:`forward_context` is active."""
    meta = _CURRENT.get()
    if meta is None:
        raise RuntimeError(
            "no piecegraph forward context is active: call the model inside "
            "`with piecegraph.forward_context(metadata): ...`"
        )
    return meta


def current_forward_context() -> Any:
    """The metadata of the current forward call, or ``None`` outside any context."""
    return _CURRENT.get()


@contextlib.contextmanager
def override_forward_context(meta: Any) -> Iterator[Any]:
    """Swap the active metadata (piecegraph's own use: static copies for full-graph capture and replay)."""
    token = _CURRENT.set(meta)
    try:
        yield meta
    finally:
        _CURRENT.reset(token)
