"""A toy model with its own split op, for engine tests (no dependency on the reference decoder)."""

import torch

import piecegraph
from piecegraph.context import get_forward_context

_lib = torch.library.Library("pg_toy", "DEF")
_lib.define("mix(Tensor x, Tensor(a!) out) -> ()")


def _mix(x: torch.Tensor, out: torch.Tensor) -> None:
    # Reads host metadata from the forward context, like attention: rows past `n` are padding. The mixing is a
    # matmul with zero weights on pad rows, so NaN in a pad row would leak (0 * NaN) as in real attention.
    n = get_forward_context()["n"]
    weights = torch.zeros(x.shape[0], x.shape[0], dtype=x.dtype, device=x.device)
    weights[:n, :n] = 1.0 / n
    out.copy_(torch.tanh(x) + weights @ x)
    out[n:].zero_()


_lib.impl("mix", _mix, "CompositeExplicitAutograd")
_lib._register_fake("mix", lambda x, out: None)
piecegraph.split_op("pg_toy::mix")


class ToyModel(torch.nn.Module):
    """Two linear blocks around a split op; positions enter as a second token input."""

    def __init__(self, dim: int = 16, layers: int = 2, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers + 1))
        for block in self.blocks:
            block.weight.data = torch.randn(dim, dim, generator=g) / dim**0.5
        self.layers = layers

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x) + pos[:, None].to(x.dtype)
        for i in range(self.layers):
            out = torch.empty_like(h)
            torch.ops.pg_toy.mix(h, out)
            h = torch.relu(self.blocks[i + 1](out)) + h
        return h


_lib.define("gate(Tensor x, Tensor(a!) out) -> ()")


def _gate(x: torch.Tensor, out: torch.Tensor) -> None:
    # Full-graph safe: reads only a token-aligned tensor of the context (padded with zeros by piecegraph).
    scale = get_forward_context()["scale"]
    out.copy_(torch.tanh(x) * scale[:, None])


_lib.impl("gate", _gate, "CompositeExplicitAutograd")
_lib._register_fake("gate", lambda x, out: None)
piecegraph.split_op("pg_toy::gate")


class GateModel(torch.nn.Module):
    """One split op that reads a per-token tensor from the context: capturable whole (mode full)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = torch.nn.Linear(dim, dim)
        self.b = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        out = torch.empty_like(h)
        torch.ops.pg_toy.gate(h, out)
        return self.b(out)


_lib.define("scale_rows(Tensor x, Tensor w) -> Tensor")
_lib.impl("scale_rows", lambda x, w: x * w[:, None], "CompositeExplicitAutograd")
_lib._register_fake("scale_rows", lambda x, w: torch.empty_like(x))


class TwoTokenInputs(torch.nn.Module):
    """``w`` meets ``x`` only inside an opaque op, so Dynamo gives its token dimension a symbol of its own."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.a(torch.ops.pg_toy.scale_rows(x, w))
