"""Tensor parallelism over ``torch.distributed``: shard the reference decoder from outside, and the all-reduce as
custom ops usable inside the compiled pieces (default) or as a split op.

Example (``torchrun --nproc-per-node 2 script.py``)::

    import torch.distributed as dist
    from piecegraph.parallel import ALL_REDUCE_INPLACE, apply_tp, register_group

    dist.init_process_group("nccl")   # gloo on CPU
    register_group("tp")              # None: the default (world) group
    model = apply_tp(Decoder.random(config), "tp")
    graphed = piecegraph.compile(model)                                   # all-reduce inside the pieces
    # or: apply_tp(..., inplace=True) and piecegraph.compile(model, split_ops=[ALL_REDUCE_INPLACE])
"""

from piecegraph.parallel.ops import (
    ALL_REDUCE,
    ALL_REDUCE_INPLACE,
    all_reduce,
    get_group,
    group_rank,
    group_size,
    register_group,
)
from piecegraph.parallel.tp import (
    RowParallelLinear,
    TPInfo,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    apply_tp,
)

__all__ = [
    "ALL_REDUCE",
    "ALL_REDUCE_INPLACE",
    "RowParallelLinear",
    "TPInfo",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "all_reduce",
    "apply_tp",
    "get_group",
    "group_rank",
    "group_size",
    "register_group",
]
