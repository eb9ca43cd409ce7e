"""A program's flat outputs on their way back to the caller: token outputs cut back to the call's ``n`` rows and
copied out of graph-owned memory (the runner), then packed into the model's own output shape (the binding)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def cut_to_tokens(outputs: Sequence[Any], n: int, token_dim: int, token_outputs: Sequence[bool],
                  copy: bool) -> tuple[Any, ...]:
    """``outputs`` with every token output narrowed to its first ``n`` rows (a padded replay computed ``size``),
    each tensor cloned when ``copy``: a graph's outputs live in its pool and the next replay overwrites them."""
    result = []
    for out, is_token in zip(outputs, token_outputs):
        if isinstance(out, torch.Tensor):
            if is_token:
                out = out.narrow(token_dim, 0, n)
            if copy:
                out = out.clone()
        result.append(out)
    return tuple(result)


def unpack_single(outputs: tuple[Any, ...]) -> Any:
    return outputs[0]


def pack_spec(result: Any, outputs: tuple[Any, ...] | None) -> tuple[str, Any] | None:
    """Where ``result`` (a tensor, or a tuple or list of tensors) sits in the program's flat ``outputs``, as data:
    ``("tensor", i)``, ``("tuple", [i, ...])`` or ``("list", [i, ...])``; ``None`` when it is not that."""
    if outputs is None:
        return None

    def index(t: Any) -> int | None:
        return next((i for i, o in enumerate(outputs) if o is t), None)

    if isinstance(result, torch.Tensor):
        i = index(result)
        return None if i is None else ("tensor", i)
    if type(result) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in result):
        idx = [index(t) for t in result]
        return None if None in idx else (type(result).__name__, idx)
    return None


def packer_of(spec: tuple[str, Any]) -> Callable[[tuple[Any, ...]], Any]:
    """The function that rebuilds the model's output from the flat outputs, for a :func:`pack_spec`."""
    kind, where = spec
    if kind == "tensor":
        return lambda outs: outs[where]
    container = tuple if kind == "tuple" else list
    return lambda outs: container(outs[i] for i in where)


def side_outputs(result: Any, outputs: tuple[Any, ...]) -> bool:
    """Whether the graph returns tensors that are not part of the model's result: Dynamo's side effects (a
    buffer re-assigned in forward), which only its own compiled code applies."""
    returned = {id(t) for t in ([result] if isinstance(result, torch.Tensor) else result)}
    return any(isinstance(o, torch.Tensor) and id(o) not in returned for o in outputs)
