"""What the cache-trace test files share: a toy model whose trace bakes in non-tensor arguments and attributes."""

import torch
from toy import ToyModel


class Tagged(torch.nn.Module):
    """A toy whose forward bakes non-tensor arguments and attributes into the trace."""

    def __init__(self, scale: float, layers: int) -> None:
        super().__init__()
        self.inner = ToyModel(dim=16, layers=layers, seed=layers)
        self.scale = scale

    def forward(self, x: torch.Tensor, pos: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        return self.inner(x * self.scale + shift, pos)
