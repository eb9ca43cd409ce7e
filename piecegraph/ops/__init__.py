"""JIT safety: opaque() custom ops, split ops, freeze() for warm loaders, prewarm(), and library adapters."""

from piecegraph.ops.freeze import FreezeError, FrozenCacheMiss, freeze, freeze_package, frozen_functions, unfreeze
from piecegraph.ops.opaque import OpaqueError, is_opaque, opaque
from piecegraph.ops.prewarm import FilledLoader, PrewarmReport, prewarm
from piecegraph.ops.split import split_op

__all__ = [
    "opaque", "is_opaque", "OpaqueError",
    "freeze", "freeze_package", "unfreeze", "frozen_functions", "FrozenCacheMiss", "FreezeError",
    "prewarm", "PrewarmReport", "FilledLoader",
    "split_op",
]
