"""Public functions of the test JIT library: pure-torch kernels reached through the loaders (loaders.py), behind
the ``api`` decorator (utils.py). Their signatures have what real libraries have: ``Literal``, ``Enum``,
``List[Tensor]``, ``out=``, a dtype argument, a function without hints, one that writes an input in place, and one
whose output shape depends on the data."""

import enum
from typing import List, Literal, Optional, Tuple

import torch

from .loaders import get_module
from .utils import api


class Activation(enum.Enum):
    SILU = "silu"
    GELU = "gelu"


@api()
def rms_norm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """RMS norm over the last dim; writes ``out`` when given and returns it (FlashInfer style)."""
    mod = get_module("rms_norm", input.dtype)
    y = mod.run(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w, input, weight)
    if out is None:
        return y
    out.copy_(y)
    return out


@api()
def quantize(x: torch.Tensor, granularity: Literal["tensor", "row"] = "tensor") -> Tuple[torch.Tensor, torch.Tensor]:
    """int8 quantization: ``(q int8 like x, scale float32)``; scale is ``[1]`` per tensor, ``[rows, 1]`` per row."""
    get_module("quantize", x.dtype)
    amax = x.abs().amax() if granularity == "tensor" else x.abs().amax(-1, keepdim=True)
    scale = (amax.float().clamp(min=1e-12) / 127.0).reshape(-1 if granularity == "tensor" else x.shape[0], 1)
    scale = scale.reshape(1) if granularity == "tensor" else scale
    return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


@api(backends=("ref", "tiled"))
def bmm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None,
        backend: Literal["ref", "tiled"] = "ref") -> torch.Tensor:
    """Batched ``a [B, m, k] @ b [B, k, n] -> [B, m, n]`` in ``dtype``; its runner class is built at each call
    (as FlashInfer 0.5's cuBLAS FP8 runner is)."""
    mod = get_module("bmm", a.dtype)

    class Runner:  # builtins.__build_class__ on every call
        def forward(self, x, y):
            return torch.bmm(x.float(), y.float()).to(dtype)

    y = mod.run(Runner().forward, a, b)
    if out is None:
        return y
    out.copy_(y)
    return out


@api()
def act_and_mul(input: torch.Tensor, activation: Activation = Activation.SILU) -> torch.Tensor:
    """``act(x[..., :d]) * x[..., d:]`` of a ``[..., 2d]`` input."""
    get_module("act_and_mul", input.dtype)
    d = input.shape[-1] // 2
    act = torch.nn.functional.silu if activation is Activation.SILU else torch.nn.functional.gelu
    return act(input[..., :d]) * input[..., d:]


@api()
def concat(parts: List[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """The parts concatenated along the last dim, times ``scale``."""
    get_module("concat", parts[0].dtype)
    return torch.cat(list(parts), dim=-1) * scale


@api()
def add_residual_(x: torch.Tensor, residual: torch.Tensor) -> None:
    """``residual += x`` in place."""
    get_module("add_residual", x.dtype)
    residual.add_(x)


@api()
def scale_rows(x, factor=2.0):
    """``x * factor`` (no type hints at all, as some libraries write)."""
    get_module("scale_rows", x.dtype)
    return x * factor


@api()
def positive_rows(x: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` whose sum is positive (through a runner class built per call): the output shape depends on
    the data."""
    mod = get_module("positive_rows", x.dtype)

    class Runner:  # builtins.__build_class__ on every call
        def forward(self, t):
            return t[t.sum(-1) > 0]

    return mod.run(Runner().forward, x)
