"""Fused input projections for the reference decoders: one GEMM for q, k, v and one for gate, up.

At batch 1 every GEMM is a weight read plus a launch, and ``k_proj``/``v_proj`` are small enough to be latency-bound;
one GEMM over the concatenated rows reads the same bytes in one kernel (vLLM's ``QKVParallelLinear`` and
``MergedColumnParallelLinear``). The forwards of :class:`~piecegraph.models.decoder.Attention` and
:class:`~piecegraph.models.decoder.MLP` split the fused output into views with the sizes stored beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from piecegraph.models.decoder import MLP, Attention

# (module class, its projections, the fused module's name, the attribute holding the split sizes, biases allowed)
FUSED_GROUPS = (
    (Attention, ("q_proj", "k_proj", "v_proj"), "qkv_proj", "qkv_sizes", True),
    (MLP, ("gate_proj", "up_proj"), "gate_up_proj", "gate_up_sizes", False),
)


def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse, in place, every reference :class:`~piecegraph.models.decoder.Attention`'s ``q_proj``, ``k_proj``,
    ``v_proj`` into one ``qkv_proj`` and every :class:`~piecegraph.models.decoder.MLP`'s ``gate_proj``, ``up_proj``
    into one ``gate_up_proj`` (the dense and MoE decoders' attention, dense MLPs and shared experts, the MLA
    decoder's dense and shared-expert MLPs; MLA attention is its own module and stays as it is); returns ``model``.

    A group is fused only if its projections are all plain ``nn.Linear`` (exactly that type: FP8, block-FP8 and
    tensor-parallel modules and any subclass are left alone) of one dtype, device and input width, with biases on
    all or none (none for the MLP); anything else is left as it is, without error. The fused weight is the parts'
    rows concatenated along the output dim, so the split sizes are the actual ``out_features`` (fewer than the
    config says on a tensor-parallel rank). Each part is freed as soon as its rows are copied: only the group being
    fused is ever held twice. Fusing twice is a no-op.

    Order: after loading weights (``state_dict`` names change: ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/
    ``up_proj`` become ``qkv_proj``/``gate_up_proj``, so a fused model does not load Hugging Face checkpoints;
    :func:`~piecegraph.models.save_hf` writes it unfused), after :func:`~piecegraph.parallel.apply_tp` (which
    shards the unfused projections), before :func:`~piecegraph.models.quantize_fp8` (which quantizes each fused
    part with its own scale) and before compiling.
    """
    for module in list(model.modules()):
        for cls, names, fused_name, sizes_name, bias_ok in FUSED_GROUPS:
            if isinstance(module, cls):
                _fuse(module, names, fused_name, sizes_name, bias_ok)
    return model


def _fusable(parts: list[nn.Module | None], bias_ok: bool) -> bool:
    """Whether ``parts`` are plain ``nn.Linear`` layers one GEMM can replace (see :func:`fuse_projections`)."""
    if not all(type(p) is nn.Linear for p in parts):
        return False
    first = parts[0].weight
    if any(p.weight.dtype != first.dtype or p.weight.device != first.device or p.weight.shape[1] != first.shape[1]
           for p in parts):
        return False
    biases = [p.bias for p in parts if p.bias is not None]
    if not biases:
        return True
    return bias_ok and len(biases) == len(parts) and all(b.dtype == first.dtype for b in biases)


@torch.no_grad()
def _fuse(parent: nn.Module, names: tuple[str, ...], fused_name: str, sizes_name: str, bias_ok: bool) -> None:
    parts = [getattr(parent, n, None) for n in names]
    if getattr(parent, fused_name, None) is not None or not _fusable(parts, bias_ok):
        return
    weight, bias = parts[0].weight, parts[0].bias
    sizes = tuple(int(p.weight.shape[0]) for p in parts)
    # skip_init: every row is overwritten below, so no random init
    fused = nn.utils.skip_init(nn.Linear, weight.shape[1], sum(sizes), bias=bias is not None, device=weight.device,
                               dtype=weight.dtype)
    fused.weight.requires_grad_(weight.requires_grad)
    if bias is not None:
        fused.bias.requires_grad_(bias.requires_grad)
    del parts, weight, bias  # only the parent holds the parts now: each is freed as soon as it is copied
    start = 0
    for name, size in zip(names, sizes):
        part = getattr(parent, name)
        fused.weight[start:start + size].copy_(part.weight)
        if fused.bias is not None:
            fused.bias[start:start + size].copy_(part.bias)
        start += size
        del part
        delattr(parent, name)
    setattr(parent, fused_name, fused)
    setattr(parent, sizes_name, sizes)
