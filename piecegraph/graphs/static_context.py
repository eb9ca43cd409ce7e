"""Static copies of the forward context for ``mode="full"``, whose graphs also capture the split ops.

A captured split op reads its metadata tensors at fixed addresses, so those tensors must be piecegraph's own
buffers, refilled before each replay. Everything else it read (a KV cache object, host values) is baked into
the graph and must not change; a change is an error rather than a silently wrong replay.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


def _fields(meta: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(meta) and not isinstance(meta, type):
        # Fields marked per-step are host data the graph never reads (see for_cuda_graph below).
        return {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)
                if f.metadata.get("piecegraph_static") != "per_step"}
    if isinstance(meta, dict):
        return dict(meta)
    raise TypeError(
        f"mode='full' needs the forward context to be a dataclass or a dict, got {type(meta).__name__}: "
        "piecegraph must copy its token-aligned tensors into static buffers"
    )


def _rebuild(meta: Any, values: dict[str, Any]) -> Any:
    return dict(values) if isinstance(meta, dict) else dataclasses.replace(meta, **values)


def graph_view(meta: Any, n: int, size: int) -> tuple[Any, int]:
    """``meta`` as a full graph of ``size`` reads it, and its token count.

    A metadata object may define ``for_cuda_graph(size)``: called before every capture and replay, it returns
    the metadata to capture with (itself, or one padded to ``size`` rows in buffers it owns per size, e.g. an
    attention backend planned for the padded batch), or raises when this call cannot run in a full graph.
    Dataclass fields with ``metadata={"piecegraph_static": "per_step"}`` are host data that only that hook reads;
    they are not compared between capture and replay.
    """
    hook = getattr(meta, "for_cuda_graph", None)
    if hook is None:
        return meta, n
    view = hook(size)
    return view, (n if view is meta else size)


class StaticContext:
    """Per-size static metadata for full-graph capture and replay.

    A field is *token-aligned* when it is a tensor whose dim 0 equals the call's token count: it gets a buffer
    of the largest size, filled with the call's rows and zeros after them (padding tokens must be harmless
    with all-zero metadata, e.g. slot 0 = a scratch cache page). Any other field must be the same object (or an
    equal value) at every replay of a size as when that size was captured.
    """

    def __init__(self, max_size: int):
        self.max_size = max_size
        self.buffers: dict[str, torch.Tensor] = {}
        self.captured: dict[int, tuple[Any, dict[str, Any]]] = {}

    def for_capture(self, meta: Any, n: int, size: int) -> Any:
        """Fill the buffers from ``meta`` and return the static metadata that ``size`` is captured with."""
        meta, n = graph_view(meta, n, size)
        values, fixed = self._split(meta, n)
        static = {}
        for name, tensor in values.items():
            buf = self._buffer(name, tensor)
            self._fill(buf, tensor, n, size)
            static[name] = buf[:size]
        static_meta = _rebuild(meta, {**fixed, **static})
        self.captured[size] = (static_meta, fixed)
        return static_meta

    def for_replay(self, meta: Any, n: int, size: int) -> None:
        """Refill the buffers from ``meta``; raise if a non-token field differs from the capture's."""
        meta, n = graph_view(meta, n, size)
        values, fixed = self._split(meta, n)
        _, captured_fixed = self.captured[size]
        for name, value in fixed.items():
            old = captured_fixed.get(name)
            if value is not old and not _equal(value, old):
                raise ValueError(
                    f"forward context field {name!r} changed since size {size} was captured in mode='full' "
                    f"({_short(old)} -> {_short(value)}); the graph baked in the old one. Keep it fixed, make it "
                    "a token-aligned tensor (dim 0 = token count), or use mode='piecewise'."
                )
        missing = set(self.buffers) - set(values)
        if missing:
            raise ValueError(f"forward context fields {sorted(missing)} are no longer token-aligned tensors")
        for name, tensor in values.items():
            self._fill(self.buffers[name], tensor, n, size)

    def _split(self, meta: Any, n: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        values, fixed = {}, {}
        for name, value in _fields(meta).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
                values[name] = value
            else:
                fixed[name] = value
        return values, fixed

    def _buffer(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None:
            buf = torch.zeros((self.max_size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
            self.buffers[name] = buf
        elif buf.shape[1:] != tensor.shape[1:] or buf.dtype != tensor.dtype or buf.device != tensor.device:
            raise ValueError(
                f"forward context field {name!r} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}; "
                f"it was captured as (*, {', '.join(map(str, buf.shape[1:]))}) {buf.dtype} on {buf.device}"
            )
        return buf

    @staticmethod
    def _fill(buf: torch.Tensor, tensor: torch.Tensor, n: int, size: int) -> None:
        buf[:n].copy_(tensor)
        if size > n:
            buf[n:size].zero_()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."
