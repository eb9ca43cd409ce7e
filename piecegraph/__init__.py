"""piecegraph: piecewise CUDA graphs for PyTorch inference through torch.compile, robust to JIT kernel libraries."""

from . import compile as _compile_stage  # noqa: F401  (bind the stage package before the function below)
from .api import compile
from .config import Config, default_capture_sizes
from .context import forward_context, get_forward_context
from .doctor import doctor
from .graphed_module import GraphedModule
from .ops import FrozenCacheMiss, freeze, freeze_package, opaque, prewarm, unfreeze
from .ops.split import split_op

__all__ = [
    "compile",
    "Config",
    "GraphedModule",
    "default_capture_sizes",
    "forward_context",
    "get_forward_context",
    "split_op",
    "opaque",
    "freeze",
    "freeze_package",
    "unfreeze",
    "prewarm",
    "doctor",
    "FrozenCacheMiss",
]
__version__ = "0.1.0"
