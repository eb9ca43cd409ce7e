"""piecegraph: piecewise CUDA graphs for PyTorch inference through torch.compile, robust to JIT kernel libraries."""

import time as _time

from . import _import_clock, adapters
from .api import compile
from .config import Config, default_capture_sizes
from .context import forward_context, get_forward_context
from .diagnose import doctor
from .graphed import GraphedModule
from .graphs.breakable import no_graph
from .graphs.capture import GraphPool
from .ops import FrozenCacheMiss, freeze, freeze_package, opaque, prewarm, unfreeze
from .ops.split import split_op

__all__ = [
    "compile",
    "Config",
    "GraphedModule",
    "GraphPool",
    "default_capture_sizes",
    "forward_context",
    "get_forward_context",
    "split_op",
    "no_graph",
    "adapters",
    "opaque",
    "freeze",
    "freeze_package",
    "unfreeze",
    "prewarm",
    "doctor",
    "FrozenCacheMiss",
]
__version__ = "0.1.0"
# Seconds `import piecegraph` took (stats()["startup"]["import_s"]); torch included when piecegraph imported it.
IMPORT_S = _time.perf_counter() - _import_clock.START
