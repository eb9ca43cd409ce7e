"""How a GraphedModule meets Dynamo: the traced entry, the trace's argument copies, and packing the runner's
flat outputs back into the model's output structure."""

from __future__ import annotations

import itertools
import types
from typing import Any, Callable

import torch


def _entry(model: torch.nn.Module, kwargs: dict[str, Any]) -> Any:
    return model(**kwargs)


_ENTRIES = itertools.count()


def fresh_entry() -> Callable[..., Any]:
    """A new code object per GraphedModule: Dynamo caches by code object, and we trace each model once, so
    separate models must not share (and exhaust) one cache entry list."""
    code = _entry.__code__.replace(co_name=f"piecegraph_entry_{next(_ENTRIES)}")
    return types.FunctionType(code, _entry.__globals__, code.co_name)


def trace_copy(value: Any, td: int) -> Any:
    """Mark the token dim dynamic; a call with fewer than 2 tokens is traced on a zero-padded copy."""
    if not isinstance(value, torch.Tensor) or value.dim() <= td:
        return value
    value = value.clone()  # marking dynamic tags the tensor: tag a copy, not the caller's
    if value.shape[td] < 2:
        pad_shape = list(value.shape)
        pad_shape[td] = 2 - value.shape[td]
        value = torch.cat([value, torch.zeros(pad_shape, dtype=value.dtype, device=value.device)], dim=td)
    torch._dynamo.mark_dynamic(value, td)
    return value


def unpack_single(outputs: tuple[Any, ...]) -> Any:
    return outputs[0]


def packer(result: Any, outputs: tuple[Any, ...] | None) -> Callable[[tuple[Any, ...]], Any] | None:
    if outputs is None:
        return None

    def index(t: Any) -> int | None:
        return next((i for i, o in enumerate(outputs) if o is t), None)

    if isinstance(result, torch.Tensor):
        i = index(result)
        return None if i is None else (lambda outs: outs[i])
    if isinstance(result, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in result):
        idx = [index(t) for t in result]
        if None in idx:
            return None
        kind = type(result)
        return lambda outs: kind(outs[i] for i in idx)
    return None
