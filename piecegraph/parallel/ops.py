"""The tensor-parallel all-reduce as custom ops with fakes, over ``torch.distributed`` process groups.

Two ops, both summing over the ranks of the process group registered under ``group`` (see
:func:`register_group`):

* ``piecegraph_tp::all_reduce(Tensor x, str group) -> Tensor``: out-of-place (a fresh tensor). The default: it
  stays inside the compiled pieces, so a captured graph contains the collective (NCCL collectives are
  graph-capturable; gloo is CPU only and never captured).
* ``piecegraph_tp::all_reduce_(Tensor(a!) x, str group) -> ()``: in place, for use as a split op
  (``Config(split_ops=[ALL_REDUCE_INPLACE])`` or ``piecegraph.split_op(ALL_REDUCE_INPLACE)``). A split op runs
  eagerly between pieces and must write into a buffer it was given, which the in-place form does.

Padding: an all-reduce is row-wise (row ``i`` of the result only depends on row ``i`` on every rank), so a bucket's
padded rows never leak into real rows, whichever of the two ops is used. Every rank must run the same program with
the same capture sizes, so that the collectives pair up (the same bucket on every rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ALL_REDUCE = "piecegraph_tp::all_reduce"
ALL_REDUCE_INPLACE = "piecegraph_tp::all_reduce_"

_GROUPS: dict[str, "dist.ProcessGroup | None"] = {}


def register_group(name: str, group: "dist.ProcessGroup | None" = None) -> str:
    """Register ``group`` (``None``: the default world group) under ``name`` for the all-reduce ops; returns
    ``name``. Re-registering a name replaces it. Requires ``torch.distributed`` to be initialized.

    Example: ``register_group("tp", dist.new_group([0, 1]))``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("piecegraph.parallel: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group (e.g. under torchrun) before registering a group")
    _GROUPS[name] = group
    return name


def get_group(name: str) -> "dist.ProcessGroup | None":
    """The process group registered under ``name``; ``KeyError`` naming the registered ones otherwise."""
    try:
        return _GROUPS[name]
    except KeyError:
        raise KeyError(f"piecegraph.parallel: no process group registered as {name!r} (registered: "
                       f"{sorted(_GROUPS)}); call piecegraph.parallel.register_group first") from None


def group_size(name: str) -> int:
    """The world size of the group registered under ``name``."""
    return dist.get_world_size(get_group(name))


def group_rank(name: str) -> int:
    """This process's rank in the group registered under ``name``."""
    return dist.get_rank(get_group(name))


def _all_reduce_impl(x: torch.Tensor, group: str) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=get_group(group))
    return out


def _all_reduce_fake(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


def _all_reduce_inplace_impl(x: torch.Tensor, group: str) -> None:
    dist.all_reduce(x, group=get_group(group))


def _all_reduce_inplace_fake(x: torch.Tensor, group: str) -> None:
    return None


# "DEF", as piecegraph_models does (FRAGMENT before Inductor's first import broke torch.compile on torch 2.11).
_LIB = torch.library.Library("piecegraph_tp", "DEF")
_LIB.define("all_reduce(Tensor x, str group) -> Tensor")
_LIB.define("all_reduce_(Tensor(a!) x, str group) -> ()")
for _key in ("CPU", "CUDA"):
    _LIB.impl("all_reduce", _all_reduce_impl, _key)
    _LIB.impl("all_reduce_", _all_reduce_inplace_impl, _key)
torch.library.register_fake(ALL_REDUCE, _all_reduce_fake, lib=_LIB)
torch.library.register_fake(ALL_REDUCE_INPLACE, _all_reduce_inplace_fake, lib=_LIB)


def all_reduce(x: torch.Tensor, group: str, inplace: bool = False) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group``: out of place (the default), or in place (returns ``x``)."""
    if inplace:
        torch.ops.piecegraph_tp.all_reduce_(x, group)
        return x
    return torch.ops.piecegraph_tp.all_reduce(x, group)
