"""How a GraphedModule meets Dynamo: the traced entry, the trace's argument copies, and packing the runner's
flat outputs back into the model's output structure."""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ArgSpec:
    """What a tensor argument looked like when the model was traced: every later call must match it.

    ``shape`` has ``None`` at the token dimension of a token input (the only size that may change). A call that
    differs in dtype, device, rank or any other size raises naming the argument, on every path (graphs or not):
    the compiled code would cast, fail deep inside Inductor, or compute garbage. A non-contiguous tensor where a
    contiguous one was traced is copied (a correct fallback; the caller's tensor is untouched).
    """

    name: str
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int | None, ...]
    contiguous: bool

    @classmethod
    def of(cls, name: str, t: torch.Tensor, token_dim: int | None) -> ArgSpec:
        shape = tuple(None if i == token_dim else s for i, s in enumerate(t.shape))
        return cls(name, t.dtype, t.device, shape, t.is_contiguous())

    def key(self, t: torch.Tensor) -> tuple:
        """What decides whether ``t`` matches: checked once per distinct key."""
        return (t.dtype, t.device, t.dim(), tuple(s for s, want in zip(t.shape, self.shape) if want is not None))

    def check(self, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"input {self.name} was a tensor when the model was traced and is now "
                            f"{type(value).__name__}; pass a tensor, or compile another model")
        if value.dtype != self.dtype or value.device != self.device:
            raise ValueError(
                f"input {self.name} is {value.dtype} on {value.device}; the model was traced with {self.dtype} "
                f"on {self.device}. Convert it (x.to(...)) or compile another model for this dtype/device."
            )
        if value.dim() != len(self.shape):
            raise ValueError(f"input {self.name} has rank {value.dim()}; it was traced with rank {len(self.shape)}")
        sizes = tuple(s for s, want in zip(value.shape, self.shape) if want is not None)
        if sizes != tuple(s for s in self.shape if s is not None):
            traced = tuple("tokens" if s is None else s for s in self.shape)
            raise ValueError(
                f"input {self.name} has shape {tuple(value.shape)}; it was traced as {traced}"
                + (" (only the token dimension may change)" if None in self.shape else " (a static input)")
            )
