"""piecegraph: piecewise CUDA graphs for PyTorch inference through torch.compile, robust to JIT kernel libraries."""

import sys as _sys

from . import compile as _compile_stage  # noqa: F401  (bind the stage package before the function below)
from .api import compile
from .config import Config, default_capture_sizes
from .context import forward_context, get_forward_context
from .doctor import doctor
from .graphed_module import GraphedModule
from .graphs.breakable import no_graph
from .graphs.capture import GraphPool
from .ops import FrozenCacheMiss, adapters, freeze, freeze_package, opaque, prewarm, unfreeze
from .ops.adapters import flashinfer as _flashinfer_adapter
from .ops.split import split_op

# `piecegraph.adapters.flashinfer.install()` is the documented spelling; the adapters live with the other ops.
_sys.modules[__name__ + ".adapters"] = adapters
_sys.modules[__name__ + ".adapters.flashinfer"] = _flashinfer_adapter

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
