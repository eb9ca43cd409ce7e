"""Public ops of the fake library, each calling one primitive Dynamo cannot trace (no cache in front)."""

import ctypes
import logging
import subprocess
import sys
import threading
import time

import numpy as np
import torch

from .api import api_logged

_LOCK = threading.Lock()
_LABS = ctypes.CDLL(None).labs  # a C function through ctypes, looked up once at import
_log = logging.getLogger("fakelib")


def shell_gelu(x: torch.Tensor) -> torch.Tensor:
    """gelu, after asking a subprocess something (as JIT libraries ask nvcc for its version)."""
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return torch.nn.functional.gelu(x)


def add_bias(x: torch.Tensor) -> torch.Tensor:
    """``x + 1`` under a module lock."""
    with _LOCK:
        y = x + 1
    return y


def lookup(x: torch.Tensor) -> torch.Tensor:
    """``x + n`` where n comes from reading this file (file I/O on every call)."""
    with open(__file__) as f:
        n = len(f.read(8))
    return x + n


def timed(x: torch.Tensor) -> torch.Tensor:
    """relu, timed with the host clock."""
    start = time.perf_counter()
    y = torch.relu(x)
    _ = time.perf_counter() - start
    return y


def labs_scale(x: torch.Tensor) -> torch.Tensor:
    """``x * labs(-3)`` through ctypes (a foreign call)."""
    return x * _LABS(-3)


def quiet(x: torch.Tensor) -> torch.Tensor:
    """tanh, with a debug log line."""
    _log.debug("quiet called on %s", tuple(x.shape))
    return torch.tanh(x)


def noise(x: torch.Tensor) -> torch.Tensor:
    """``x + r`` with r from numpy's random generator."""
    return x + float(np.random.default_rng(0).random())


def sized(x: torch.Tensor) -> torch.Tensor:
    """``x`` times a host value from a builtin Dynamo does not model."""
    return x * (sys.getsizeof(x) > 0)


@api_logged
def logged_gelu(x: torch.Tensor) -> torch.Tensor:
    """shell_gelu behind a forwarding decorator: the doctor must name logged_gelu, not the wrapper."""
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return torch.nn.functional.gelu(x)


@api_logged
def logged_silu(x: torch.Tensor) -> torch.Tensor:
    """A second function behind the same wrapper code, so the wrapper alone cannot name the entry."""
    return torch.nn.functional.silu(x)
