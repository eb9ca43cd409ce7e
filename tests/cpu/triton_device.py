"""Where a Triton kernel under test runs: CUDA, or CPU tensors under ``TRITON_INTERPRET=1``; skipped otherwise
(CI installs no Triton)."""

from __future__ import annotations

import os

import pytest
import torch


def kernel_device() -> str:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        pytest.skip("Triton's interpreter loops fail on numpy >= 2.4 (int() of a 1-element array)")
    return "cpu"
