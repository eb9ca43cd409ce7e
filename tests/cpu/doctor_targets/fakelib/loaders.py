"""A cached loader that checks the file system on first use (warm after one call, yet Dynamo traces it)."""

import functools
import os

import torch


@functools.cache
def config() -> dict:
    """Settings read once: looks for an override file next to this module (posix.stat)."""
    override = os.path.join(os.path.dirname(__file__), "fakelib.cfg")
    return {"factor": 3.0 if os.path.exists(override) else 2.0}


def scale(x: torch.Tensor) -> torch.Tensor:
    """``x * factor`` with the factor from the cached loader."""
    return x * config()["factor"]
