"""A tiny JIT kernel library that behaves like FlashInfer on its first call, to reproduce the clash on CPU.

On first use of a kernel, behind ``functools.cache``, the loader stats its cache directory, asks the system C
compiler for its version through ``subprocess``, takes a ``threading.Lock``, compiles a C kernel into a shared
library with ``cc -shared -fPIC -O2`` and loads it with ctypes; the public functions then call the kernel on
tensor memory (contiguous float32 CPU tensors, outputs allocated with ``torch.empty``). Every one of those steps
stops Dynamo, and warming up does not help because Dynamo traces through ``functools.cache``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional, Tuple

import torch

_LOCK = threading.Lock()
_F32P = ctypes.POINTER(ctypes.c_float)

_SOURCES = {
    "scaled_add": """
void scaled_add(const float* x, const float* y, float* out, long n, float alpha) {
    for (long i = 0; i < n; ++i) out[i] = x[i] + alpha * y[i];
}""",
    "rmsnorm": """
#include <math.h>
void rmsnorm(const float* x, const float* w, float* out, long rows, long cols, float eps) {
    for (long r = 0; r < rows; ++r) {
        const float* xr = x + r * cols; float* o = out + r * cols; double ss = 0.0;
        for (long c = 0; c < cols; ++c) ss += (double)xr[c] * xr[c];
        float inv = 1.0f / sqrtf((float)(ss / cols) + eps);
        for (long c = 0; c < cols; ++c) o[c] = xr[c] * inv * w[c];
    }
}""",
    "scale_inplace": """
void scale_inplace(float* x, long n, float alpha) {
    for (long i = 0; i < n; ++i) x[i] *= alpha;
}""",
}


def compiler() -> Optional[str]:
    """The C compiler this library uses (``$CC`` or ``cc``), or None when there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def cache_dir() -> Path:
    """``$JITLIB_CACHE_DIR``, else a per-user folder under the system temp dir."""
    return Path(os.environ.get("JITLIB_CACHE_DIR") or Path(tempfile.gettempdir()) / f"jitlib-{os.getuid()}")


@functools.cache
def compiler_version() -> str:
    """First line of ``cc --version`` (a subprocess: Dynamo stops at its lock)."""
    out = subprocess.check_output([compiler() or "cc", "--version"], text=True)
    return out.splitlines()[0]


@functools.cache
def get_kernel_module(name: str) -> ctypes.CDLL:
    """Build (once per source and compiler) and load the shared library of kernel ``name``."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.stat(folder)  # what FlashInfer's Path.exists does: posix.stat
    source = _SOURCES[name]
    tag = hashlib.sha1((source + compiler_version()).encode()).hexdigest()[:12]
    lib = folder / f"{name}-{tag}.so"
    with _LOCK:
        if not lib.exists():
            src = folder / f"{name}-{tag}-{os.getpid()}.c"
            tmp = folder / f"{name}-{tag}-{os.getpid()}.so"
            src.write_text(source)
            subprocess.check_call([compiler() or "cc", "-shared", "-fPIC", "-O2", str(src), "-o", str(tmp), "-lm"])
            os.replace(tmp, lib)  # atomic: a concurrent process sees the whole library or none
            src.unlink()
    return ctypes.CDLL(str(lib))


def _ptr(t: torch.Tensor) -> ctypes._Pointer:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("jitlib kernels take contiguous float32 CPU tensors")
    return ctypes.cast(t.data_ptr(), _F32P)


def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``x + alpha * y`` in a freshly built C kernel."""
    out = torch.empty_like(x)
    get_kernel_module("scaled_add").scaled_add(_ptr(x), _ptr(y), _ptr(out), ctypes.c_long(x.numel()),
                                               ctypes.c_float(alpha))
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
    """RMS norm over the last dim; writes into ``out`` when given and returns it (FlashInfer style)."""
    out = torch.empty_like(x) if out is None else out
    cols = x.shape[-1]
    get_kernel_module("rmsnorm").rmsnorm(_ptr(x), _ptr(weight), _ptr(out), ctypes.c_long(x.numel() // cols),
                                         ctypes.c_long(cols), ctypes.c_float(eps))
    return out


def scale_(x: torch.Tensor, alpha: float) -> None:
    """``x *= alpha`` in place."""
    get_kernel_module("scale_inplace").scale_inplace(_ptr(x), ctypes.c_long(x.numel()), ctypes.c_float(alpha))


def halves(x: torch.Tensor, alpha: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(alpha * first half, alpha * second half)`` of the last dim, through the scaled-add kernel."""
    h = x.shape[-1] // 2
    a, b = x[..., :h].contiguous(), x[..., h:].contiguous()
    zero = torch.zeros_like(a)
    return scaled_add(zero, a, alpha), scaled_add(zero, b, alpha)
