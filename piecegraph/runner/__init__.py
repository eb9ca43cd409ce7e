"""The runner: a compiled :class:`~piecegraph.program.Program` run at any token count.

One call of ``n`` tokens is staged into static buffers (:mod:`.staging`), given the smallest capture size
``>= n`` (:mod:`.sizes`), captured on first use and replayed after (:mod:`.replay`), and its outputs cut back to
``n`` rows (:mod:`.outputs`); :class:`FlatRunner` (:mod:`.flat`) ties them together.
"""

from .flat import FlatRunner

__all__ = ["FlatRunner"]
