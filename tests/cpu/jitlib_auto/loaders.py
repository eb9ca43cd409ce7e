"""The JIT loaders: ``functools.cache`` functions that, on first use, stat a cache directory, ask a toolchain for
its version through ``subprocess``, take a lock and build the kernel module's class at call time. Each step stops
Dynamo, and a warm cache does not help: Dynamo traces through ``functools.cache``."""

import functools
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

_LOCK = threading.Lock()


def cache_dir() -> Path:
    """``$JITLIB_AUTO_CACHE_DIR``, else a per-user folder under the system temp dir."""
    return Path(os.environ.get("JITLIB_AUTO_CACHE_DIR") or Path(tempfile.gettempdir()) / f"jitlib-auto-{os.getuid()}")


@functools.cache
def toolchain() -> str:
    """The "compiler" version: a subprocess, as JIT libraries run ``nvcc --version``."""
    return subprocess.check_output([sys.executable, "-c", "print('jitlib-auto cc 1.0')"], text=True).strip()


@functools.cache
def get_module(name: str, dtype: torch.dtype):
    """The kernel module of ``name`` for ``dtype``: built once per process (a class made at call time)."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.stat(folder)  # posix.stat, as FlashInfer's Path.exists does
    version = toolchain()
    with _LOCK:
        class Module:  # builtins.__build_class__ at call time
            tag = f"{name}-{dtype}-{version}"

            @staticmethod
            def run(fn, *args):
                return fn(*args)

        return Module()
