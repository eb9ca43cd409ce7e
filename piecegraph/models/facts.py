"""What the bench, the serving engine and generation need to know about a model, read from it once.

:class:`ModelFacts` is a frozen description: where the weights live and in what dtype, the KV cache's shape, the
bytes of the weights and the bytes one forward must read. A reference decoder (``Decoder.facts()``), a Hugging
Face model's wrapper (``HFDecoder.facts()``) and any other module (:func:`model_facts`) describe themselves
through :func:`measure`; callers ask once and pass the facts down instead of asking the model again at each stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from piecegraph.attention.types import index_head_dim, indexed_layers, is_mla, v_head_dim
from piecegraph.models.config import ModelConfig


@dataclass(frozen=True)
class ModelFacts:
    """One model as its callers see it, measured at one moment (measure again after ``.to()`` or quantizing).

    ``device`` and ``dtype``: those of the model's first parameter (the reference decoders keep every parameter on
    one device and an FP8 model's embeddings, norms and router in that dtype). ``config``: the KV cache's shape
    (``None`` for a module without a :class:`ModelConfig`). ``weight_bytes``: every parameter and floating-point
    buffer once (tied weights once; an FP8 model's e4m3 weights and scales are buffers). ``quant``: ``"fp8"``
    when the model holds e4m3 tensors, else ``None``. The weight-read rule (:meth:`weight_bytes_read`):
    ``fixed_read_bytes`` every forward reads, ``expert_bytes`` of ``num_experts`` experts read as far as
    ``top_k`` routing reaches, and ``embed_row_bytes`` per token gathered.
    """

    device: torch.device
    dtype: torch.dtype
    config: ModelConfig | None
    weight_bytes: int
    quant: str | None
    fixed_read_bytes: int
    expert_bytes: int = 0
    num_experts: int = 0
    top_k: int = 0
    embed_row_bytes: int = 0

    @property
    def vocab_size(self) -> int:
        return self._shape().vocab_size

    @property
    def num_layers(self) -> int:
        return self._shape().num_layers

    def _shape(self) -> ModelConfig:
        if self.config is None:
            raise ValueError("this model has no ModelConfig (.config): its vocabulary and KV cache shape are unknown")
        return self.config

    def kv_bytes_per_token(self, cache_dtype: torch.dtype | None = None) -> int:
        """Bytes of k and v that one cached token holds across all layers, in ``cache_dtype`` (default
        :attr:`dtype`, what the caches the bench and the engine build hold). Needs :attr:`config`. An MLA config
        (``config.mla``) caches one latent and one rotary key per token for all heads, and the indexer's key
        in the layers that keep one (:func:`~piecegraph.attention.types.indexed_layers`):
        ``num_layers * (head_dim + v_head_dim) + indexed layers * index_head_dim`` elements; any other,
        ``num_kv_heads`` keys and values per layer, the values ``v_head_dim`` wide where the config says
        (DeepSeek-V2 run expanded)."""
        c = self._shape()
        itemsize = (cache_dtype or self.dtype).itemsize
        k_dim, v_dim, index_dim = c.head_dim, v_head_dim(c), index_head_dim(c)
        if is_mla(c):
            return (c.num_layers * (k_dim + v_dim) + len(indexed_layers(c)) * index_dim) * itemsize
        return c.num_layers * c.num_kv_heads * (k_dim + v_dim) * itemsize  # values may be narrower than keys

    def weight_bytes_read(self, tokens: int) -> int:
        """Bytes of weights one forward of ``tokens`` tokens must read.

        For a decoder with ``.model.embed_tokens`` (the reference decoders, a Hugging Face causal LM): every
        layer's parameters and floating-point buffers and the final norm, plus only the ``tokens`` embedding rows
        it gathers; a mixture of experts' experts only as far as top-k routing can reach, ``min(E, tokens *
        top_k)`` of each layer's (routing assumed to spread); ``lm_head`` is not part of the forward. Other
        models: every parameter.
        """
        reached = min(self.num_experts, tokens * self.top_k)
        experts = self.expert_bytes * reached // self.num_experts if self.num_experts else 0
        return self.fixed_read_bytes + experts + tokens * self.embed_row_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _alternates(model: nn.Module) -> set[int]:
    """Tensors a module keeps as another form of its weights, read instead of them at some token counts (named in
    its ``piecegraph_alternate_buffers``: FP8 experts' model-dtype fallback). Held, so counted in
    ``weight_bytes``; a step's reads count the primary form only, so a bandwidth fraction is never overstated."""
    return {id(t) for m in model.modules() for name in getattr(m, "piecegraph_alternate_buffers", ())
            if isinstance(t := getattr(m, name, None), torch.Tensor)}


def measure(model: nn.Module, config: ModelConfig | None, num_experts: int = 0, top_k: int = 0) -> ModelFacts:
    """The :class:`ModelFacts` of ``model`` with the KV cache shape ``config``; ``num_experts`` and ``top_k``
    describe its mixture of experts (0: dense), whose weights are the tensors named ``.experts.`` (each layer's
    experts stacked or listed). ``model`` needs at least one parameter. Tensors on the meta device count too."""
    param = next(model.parameters())
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    quant = "fp8" if any(t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz) for t in tensors) else None
    common = dict(device=param.device, dtype=param.dtype, config=config, quant=quant,
                  weight_bytes=sum(_nbytes(t) for t in {id(t): t for t in tensors}.values()))
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if inner is None or embed is None:
        return ModelFacts(**common, fixed_read_bytes=sum(_nbytes(p) for p in model.parameters()))
    skip = {id(p) for p in embed.parameters()} | _alternates(model)
    fixed = experts = 0
    for name, t in (*inner.named_parameters(), *inner.named_buffers()):
        if id(t) in skip or not t.is_floating_point():
            continue
        if ".experts." in name and num_experts:
            experts += _nbytes(t)
        else:
            fixed += _nbytes(t)
    return ModelFacts(**common, fixed_read_bytes=fixed, expert_bytes=experts, num_experts=num_experts,
                      top_k=top_k if num_experts else 0,
                      embed_row_bytes=embed.weight.shape[1] * embed.weight.element_size())


def model_facts(model: nn.Module) -> ModelFacts:
    """``model.facts()`` where the model describes itself (the reference decoders, ``piecegraph.hf.HFDecoder``);
    else :func:`measure` with its ``.config`` when that is a :class:`ModelConfig` (a dense model: no experts)."""
    describe = getattr(model, "facts", None)
    if callable(describe):
        return describe()
    config = getattr(model, "config", None)
    return measure(model, config if isinstance(config, ModelConfig) else None)
