"""A JIT kernel library inside the tests (see kernels.py); names re-exported the way libraries do."""

from .kernels import (  # noqa: F401 - re-exported on purpose: freeze() must patch these names too
    compiler,
    compiler_version,
    get_kernel_module,
    halves,
    rmsnorm,
    scale_,
    scaled_add,
)

__all__ = ["compiler", "compiler_version", "get_kernel_module", "halves", "rmsnorm", "scale_", "scaled_add"]
