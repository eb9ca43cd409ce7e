"""The size table: which capture size a call of ``n`` tokens uses, and what became of each size (captured, in how
many seconds; dropped after verification, with the error measured; refused over the graph memory limit)."""

from __future__ import annotations

import bisect
from typing import Sequence


class SizeTable:
    """The capture sizes, ascending, and their record.

    A call of ``n`` tokens uses the smallest size ``>= n`` (its bucket). ``exact``: padding would change an op's
    result (trace/mixing.py says which op), so only a size equal to ``n`` serves it. A static trace has no sizes
    until its first graphed call, which sets its one size (:meth:`set_static`).
    """

    def __init__(self, sizes: Sequence[int], exact: bool = False):
        self.sizes: tuple[int, ...] = tuple(sizes)
        self.exact = exact
        self.capture_s: dict[int, float] = {}  # captured sizes: the seconds each capture took
        self.dropped: dict[int, float] = {}  # sizes whose replay disagreed with the no-graph run: the error
        self.over_limit: dict[int, int] = {}  # sizes whose measured graph pool exceeded graph_memory_limit: bytes
        self.padded_checked: set[int] = set()  # sizes whose first padded call was verified

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def set_static(self, n: int) -> None:
        """A static trace's one size is the traced token count."""
        self.sizes = (n,)

    def bucket(self, n: int) -> int | None:
        """The size that serves ``n`` tokens; ``None`` when the call runs without a graph: above the largest size,
        its size dropped or over the memory limit, or (``exact``) no size equals ``n``."""
        pos = bisect.bisect_left(self.sizes, n)
        if pos == len(self.sizes):
            return None
        size = self.sizes[pos]
        if self.without_graph(size) or (self.exact and size != n):
            return None
        return size

    def without_graph(self, size: int) -> bool:
        """``size`` was dropped after verification or refused over the memory limit: its calls run without one."""
        return size in self.dropped or size in self.over_limit

    def is_captured(self, size: int) -> bool:
        return size in self.capture_s

    def record_capture(self, size: int, seconds: float) -> None:
        self.capture_s[size] = seconds

    def drop(self, size: int, error: float) -> None:
        """``size`` failed verification with relative ``error``: later calls of it run without a graph."""
        self.dropped[size] = error
        self.capture_s.pop(size, None)

    def refuse(self, size: int, pool_bytes: int) -> None:
        """``size`` would take ``pool_bytes`` of graph pool, over the limit: later calls of it run without a graph."""
        self.over_limit[size] = pool_bytes
        self.capture_s.pop(size, None)

    def forget_captures(self) -> None:
        """Every size captures again on its next use (dropped sizes stay dropped)."""
        self.capture_s.clear()
