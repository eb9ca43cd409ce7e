"""Tensor parallelism applied from outside the model (gpt-fast style; the model code stays plain).

:func:`apply_tp` shards a :class:`~piecegraph.models.Decoder` or a dense Llama-style
:class:`piecegraph.hf.HFDecoder` in place for this process's rank:

* column-parallel (output features split, no communication): ``q_proj``, ``k_proj``, ``v_proj`` (with their
  biases), ``gate_proj``, ``up_proj``;
* row-parallel (input features split, one all-reduce after): ``o_proj``, ``down_proj``;
* vocab-parallel ``embed_tokens`` (each rank embeds the ids of its vocab slice, zeros elsewhere, one all-reduce)
  and ``lm_head`` (each rank computes the logits of its vocab slice, all-gathered on the last dim; tied weights
  stay tied, both are the same slice);
* attention heads split: rank ``r`` keeps q heads ``[r*H/N, (r+1)*H/N)`` and the kv heads they read; with fewer
  kv heads than ranks each kv head is replicated on ``N/KV`` ranks.

``model.config`` becomes the per-rank shape (``num_heads``, ``num_kv_heads``, ``intermediate_size`` divided), so a
:class:`~piecegraph.models.KVCache` built from it holds only this rank's kv heads and the attention backends plan
per rank. ``vocab_size`` stays the full vocabulary, since :meth:`Decoder.logits` returns full logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from piecegraph.hf.model import HFDecoder
from piecegraph.models.decoder import Decoder
from piecegraph.parallel.ops import all_reduce, get_group, group_rank, group_size


@dataclass(frozen=True)
class TPInfo:
    """What :func:`apply_tp` did: the group's registered name, rank, world size, and the all-reduce form."""

    group: str
    rank: int
    world_size: int
    inplace: bool
    full_config: object  # the unsharded ModelConfig


class RowParallelLinear(nn.Module):
    """``all_reduce(x_shard @ W_shard.T) + bias``: a Linear whose input features are split over the ranks."""

    def __init__(self, linear: nn.Linear, rank: int, world: int, group: str, inplace: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(_shard(linear.weight, 1, rank, world), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.group, self.inplace = group, inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(nn.functional.linear(x, self.weight), self.group, self.inplace)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the ranks; one all-reduce joins the slices."""

    def __init__(self, embedding: nn.Embedding, rank: int, world: int, group: str, inplace: bool) -> None:
        super().__init__()
        vocab = embedding.num_embeddings
        self.start, self.end = _bounds(vocab, rank, world)
        self.weight = nn.Parameter(embedding.weight.detach()[self.start:self.end].clone(), requires_grad=False)
        self.group, self.inplace = group, inplace

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        x = nn.functional.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(x, self.group, self.inplace)


class VocabParallelLMHead(nn.Module):
    """Logits of this rank's vocab slice, all-gathered along the last dim (eager: the reference decoder computes
    logits outside the compiled forward)."""

    def __init__(self, weight: nn.Parameter, start: int, end: int, vocab: int, group: str) -> None:
        super().__init__()
        self.weight = weight
        self.start, self.end, self.vocab, self.group = start, end, vocab, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(x, self.weight)
        world = group_size(self.group)
        sizes = [e - s for s, e in (_bounds(self.vocab, r, world) for r in range(world))]
        # Collectives (gloo's all_gather) want equal sizes: pad every slice to the largest, trim after.
        widest = max(sizes)
        local = nn.functional.pad(local, (0, widest - local.shape[-1])).contiguous()
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local, group=get_group(self.group))
        return torch.cat([part[..., :size] for part, size in zip(parts, sizes)], dim=-1)


def _bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s slice ``[start, end)`` of ``n`` rows split as evenly as possible (the first get one more)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _shard(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    size = t.shape[dim]
    if size % world:
        raise ValueError(f"piecegraph.parallel: cannot split dim {dim} of size {size} over {world} ranks evenly")
    return t.detach().narrow(dim, rank * (size // world), size // world).clone()


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t.detach().narrow(0, start, count).clone()


def _column(linear: nn.Linear, start: int, count: int) -> None:
    """Keep output features ``[start, start+count)`` of ``linear`` (weight rows and bias)."""
    linear.weight = nn.Parameter(_rows(linear.weight, start, count), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_rows(linear.bias, start, count), requires_grad=False)
    linear.out_features = count


def apply_tp(model: "Decoder | HFDecoder", group: str, *, inplace: bool = False) -> "Decoder | HFDecoder":
    """Shard ``model`` (the same full weights on every rank) in place for this rank of the process group registered
    as ``group`` (:func:`register_group`); returns it.

    ``model`` is a reference :class:`~piecegraph.models.Decoder` or a :class:`piecegraph.hf.HFDecoder` (a Hugging
    Face dense decoder with Llama-style modules: ``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` and a
    plain ``nn.Embedding``, e.g. Llama, Qwen2, Mistral; mixtures of experts and Gemma's scaled embedding are
    refused). ``inplace=False`` (the default) uses the out-of-place ``piecegraph_tp::all_reduce``, which stays
    inside the compiled pieces; ``inplace=True`` uses ``piecegraph_tp::all_reduce_``, to be named a split op
    (``piecegraph.compile(model, split_ops=[ALL_REDUCE_INPLACE])``) so the all-reduce runs eagerly between pieces;
    not named, it stays inside the pieces as well. Constraints (``ValueError`` otherwise): ``num_heads`` and
    ``intermediate_size`` divide by the world size ``N``; ``num_kv_heads`` divides by ``N`` or ``N`` by it.
    Build the KV cache from the returned ``model.config`` (per rank). ``model.tp`` records a :class:`TPInfo`.
    For an ``HFDecoder`` only the wrapped modules and ``model.config`` change, not the Hugging Face config, so
    the sharded model serves piecegraph's flat forward only (not Hugging Face's own ``forward``/``generate``).

    Example (under ``torchrun --nproc-per-node 2``)::

        dist.init_process_group("nccl")
        register_group("tp")                      # the world
        model = apply_tp(Decoder.random(config), "tp")
        cache = KVCache.for_sequences(model.config, 4, 256)
        graphed = piecegraph.compile(model)      # all-reduce captured inside the pieces
    """
    if getattr(model, "tp", None) is not None:
        raise ValueError("piecegraph.parallel.apply_tp: this model is already sharded (model.tp is set)")
    if isinstance(model, HFDecoder):
        head_owner = model.hf
    elif isinstance(model, Decoder):
        head_owner = model
    else:
        raise TypeError(f"piecegraph.parallel.apply_tp takes a piecegraph.models.Decoder or a piecegraph.hf."
                        f"HFDecoder (wrap a Hugging Face model with piecegraph.hf.wrap), got {type(model).__name__}")
    base = model.model
    _check_layout(model, base)
    rank, world = group_rank(group), group_size(group)
    config = model.config
    heads, kv, dim = config.num_heads, config.num_kv_heads, config.head_dim
    problems = []
    if heads % world:
        problems.append(f"num_heads ({heads})")
    if config.intermediate_size % world:
        problems.append(f"intermediate_size ({config.intermediate_size})")
    if kv % world and world % kv:
        problems.append(f"num_kv_heads ({kv}, nor does {world} divide by it)")
    if problems:
        raise ValueError(f"piecegraph.parallel.apply_tp: {', '.join(problems)} must divide by the world size "
                         f"{world}; pick a world size that divides the model's head counts and MLP width")
    heads_here = heads // world
    kv_here = kv // world if kv >= world else 1
    kv_first = rank * kv_here if kv >= world else rank * kv // world
    inter_here = config.intermediate_size // world
    vocab = base.embed_tokens.num_embeddings
    vocab_start, vocab_end = _bounds(vocab, rank, world)
    tied = head_owner.lm_head.weight is base.embed_tokens.weight

    for layer in base.layers:
        attn = layer.self_attn
        _column(attn.q_proj, rank * heads_here * dim, heads_here * dim)
        _column(attn.k_proj, kv_first * dim, kv_here * dim)
        _column(attn.v_proj, kv_first * dim, kv_here * dim)
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world, group, inplace)
        for name, value in (("num_heads", heads_here), ("num_kv_heads", kv_here),
                            ("num_key_value_groups", heads_here // kv_here)):
            if hasattr(attn, name):  # the reference decoder's head counts; Hugging Face's GQA group size
                setattr(attn, name, value)
        mlp = layer.mlp
        _column(mlp.gate_proj, rank * inter_here, inter_here)
        _column(mlp.up_proj, rank * inter_here, inter_here)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world, group, inplace)

    full_head = head_owner.lm_head.weight
    base.embed_tokens = VocabParallelEmbedding(base.embed_tokens, rank, world, group, inplace)
    head_weight = (base.embed_tokens.weight if tied else
                   nn.Parameter(_rows(full_head, vocab_start, vocab_end - vocab_start), requires_grad=False))
    head_owner.lm_head = VocabParallelLMHead(head_weight, vocab_start, vocab_end, vocab, group)
    model.config = config.replace(num_heads=heads_here, num_kv_heads=kv_here, intermediate_size=inter_here)
    model.tp = TPInfo(group, rank, world, inplace, config)
    return model


def _check_layout(model: nn.Module, base: nn.Module) -> None:
    """Refuse, naming what differs, a model whose modules are not the Llama-style ones apply_tp shards."""
    what = type(getattr(model, "hf", model)).__name__
    embed = getattr(base, "embed_tokens", None)
    if embed is None or not hasattr(base, "layers"):  # GPT-2-style layouts (transformer.wte, transformer.h)
        raise ValueError(f"piecegraph.parallel.apply_tp: {what} has no embed_tokens and layers under its base model "
                         "(another layout than Llama's), which apply_tp cannot shard")
    if type(embed) is not nn.Embedding:
        raise ValueError(f"piecegraph.parallel.apply_tp: {what}'s embed_tokens is a {type(embed).__name__}"
                         ", not a plain nn.Embedding (Gemma scales it), which apply_tp cannot shard yet")
    head = getattr(getattr(model, "hf", model), "lm_head", None)
    if type(head) is not nn.Linear or head.bias is not None:
        raise ValueError(f"piecegraph.parallel.apply_tp: {what}'s lm_head is not a bias-free nn.Linear")
    for i, layer in enumerate(base.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                 if type(getattr(attn, n, None)) is not nn.Linear]
        names += [f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")
                  if type(getattr(mlp, n, None)) is not nn.Linear]
        if names:
            raise ValueError(f"piecegraph.parallel.apply_tp: layer {i} of {what} has no nn.Linear {names} (a "
                             "mixture of experts, or another layout): only dense Llama-style decoders are sharded")
