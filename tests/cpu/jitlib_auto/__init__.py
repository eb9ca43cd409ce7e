"""A JIT kernel library for auto-opaque tests, listed in no adapter (see ops.py); names re-exported at the top
level, each behind a decorator, the way FlashInfer exports its public functions."""

from .fp8 import bmm_fp8
from .loaders import cache_dir, get_module, toolchain
from .ops import (
    Activation,
    act_and_mul,
    add_residual_,
    bmm,
    concat,
    positive_rows,
    quantize,
    rms_norm,
    scale_rows,
)
from .segment import SegmentGemm

__all__ = ["Activation", "act_and_mul", "add_residual_", "bmm", "bmm_fp8", "cache_dir", "concat", "get_module",
           "positive_rows", "quantize", "rms_norm", "scale_rows", "SegmentGemm", "toolchain"]
