"""Page arithmetic shared by the KV cache, the per-step metadata and the attention backends (below all three)."""

from __future__ import annotations

SCRATCH_PAGE = 0  # the page that padded tokens write into; never allocated to a sequence
DEFAULT_PAGE_SIZE = 16


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens."""
    return -(-tokens // page_size)
