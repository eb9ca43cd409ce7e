"""The graphed module: what :func:`piecegraph.compile` returns, and how it comes to be.

:class:`GraphedModule` (:mod:`.module`) builds its runners on the first call (:mod:`.build`: a Dynamo trace, split
and bound to the call's arguments by :mod:`.binding`), or starts from the artifact cache (:mod:`.cached_start`,
:mod:`.binding_snapshot`); ``mode="auto"`` picks piecewise, the advisor's fixes or breakable capture
(:mod:`.auto`); :mod:`.weights` notices parameters replaced after capture.
"""

from .module import GraphedModule

__all__ = ["GraphedModule"]
