"""Adapters for JIT kernel libraries: each makes a library's public ops opaque and freezes its warm probes.

``from piecegraph.adapters import flashinfer; flashinfer.install()``. Importing an adapter does not import
its library; ``install()`` does, and says how to get it when it is missing.
"""

from piecegraph.adapters import flashinfer

__all__ = ["flashinfer"]
