"""The reference mixture-of-experts decoder over flat tokens (Qwen2-MoE style), beside the dense one.

Attention, RMSNorm, RoPE, embeddings and the layer/model skeleton are the dense decoder's
(:mod:`piecegraph.models.decoder`): same split op, same ``forward(input_ids [T], positions [T]) -> hidden [T, H]``,
so :func:`~piecegraph.models.generate`, ``KVCache.for_sequences(model.config, ...)`` and ``piecegraph.compile``
take it unchanged. Only the MLP differs: a router, stacked experts, an optional gated shared expert.

Padding: routing is capacity-free and every expert output lands only in its own token's row, so pad rows (routed
like any row) never change a real row's expert choice or output. With ``expert_impl="gather"`` every op is
row-wise. With ``"grouped_mm"`` two ops of :meth:`Experts._grouped` work along the token dimension: the ``argsort``
of the (token, expert) pairs and the ``searchsorted`` that turns the sorted expert ids into group ends. Pad rows
change the order and the group sizes, but only where rows sit in the grouped GEMM, not what any row computes; the
token-mixing check cannot see that, so :class:`Experts` declares it (``piecegraph_padding_safe = True``) and the
check skips the ops inside it (tests/cpu/test_moe.py appends pad rows and checks the real rows are unchanged;
without the declaration the check names exactly those two nodes).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from piecegraph.models.decoder import MLP, Attention, Decoder, DecoderLayer, Model, RMSNorm, Rotary
from piecegraph.models.facts import ModelFacts, measure
from piecegraph.models.moe_config import MoEConfig


def grouped_mm_runs(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` exists, traces (bf16 only: its meta in torch 2.13 refuses other dtypes) and
    computes right on ``device`` (a tiny problem checked against ``mm``, once per device and dtype; never on
    ``meta``). Call it eagerly, never under a trace."""
    device = torch.device(device)
    if device.type == "meta" or dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return _grouped_mm_checked(str(device), dtype)


@functools.cache  # a fact about this process's torch and device: checked once
def _grouped_mm_checked(device: str, dtype: torch.dtype) -> bool:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 16, generator=gen), torch.randn(2, 16, 16, generator=gen)
    want = torch.cat([a[:8] @ b[0], a[8:] @ b[1]])
    try:
        offs = torch.tensor([8, 32], dtype=torch.int32, device=device)
        got = torch._grouped_mm(a.to(device, dtype), b.to(device, dtype).transpose(1, 2).contiguous()
                                .transpose(1, 2), offs=offs).float().cpu()
    except (RuntimeError, NotImplementedError):
        return False
    return bool((got - want).abs().max() <= 0.05 * want.abs().max())


class Experts(nn.Module):
    """``E`` SwiGLU experts as stacked weights: ``gate_up_proj [E, 2W, H]`` (gate rows first, then up) and
    ``down_proj [E, H, W]`` (Hugging Face's layout, ``[out, in]`` per expert).

    ``forward(x [T, H], ids [T, k] int64, weights [T, k]) -> [T, H]``: ``sum_j weights[t, j] *
    expert[ids[t, j]](x[t])``. Static: ``E``, ``W``, ``H``, ``k`` and the implementation (chosen when the
    weights move, see :attr:`use_grouped_mm`); ``T`` is symbolic under Dynamo, with no data-dependent shapes or
    host reads in either implementation.
    """

    piecegraph_padding_safe = True  # the sort moves rows, never mixes them (module docstring)

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        e, w, h = config.num_experts, config.expert_width, config.hidden_size
        self.impl, self.width = config.expert_impl, w
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * w, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, w))
        self.use_grouped_mm = self._choose()

    def _choose(self) -> bool:
        if self.impl == "gather":
            return False
        return grouped_mm_runs(self.gate_up_proj.device, self.gate_up_proj.dtype)

    def _apply(self, fn, *args, **kwargs):  # type: ignore[override]
        # .to(), .cuda(), .to_empty(): the implementation follows the weights' device and dtype (decided here,
        # eagerly, so the forward never probes under a trace).
        super()._apply(fn, *args, **kwargs)
        self.use_grouped_mm = self._choose()
        return self

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens, k = ids.shape
        if self.impl == "grouped_mm" and not self.use_grouped_mm:
            raise ValueError(f"MoEConfig.expert_impl='grouped_mm', but torch._grouped_mm does not run on {x.device} "
                             f"in {self.gate_up_proj.dtype} (bf16 only); use 'auto' or 'gather'")
        flat = ids.reshape(-1)  # pair p = t * k + j
        y = self._grouped(x, flat, k) if self.use_grouped_mm else self._gather(x, flat, k)
        return (y.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(1)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(gate_up[:, : self.width]) * gate_up[:, self.width:]

    def _gather(self, x: torch.Tensor, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Per pair, its expert's weights gathered (``[T*k, 2W, H]``) and one ``bmm``: row-wise, any dtype."""
        xs = x.unsqueeze(1).expand(-1, k, -1).reshape(flat.shape[0], -1, 1)  # [T*k, H, 1]
        h = self._swiglu(torch.bmm(self.gate_up_proj.index_select(0, flat), xs).squeeze(-1))
        return torch.bmm(self.down_proj.index_select(0, flat), h.unsqueeze(-1)).squeeze(-1)  # [T*k, H]

    def _grouped(self, x: torch.Tensor, flat: torch.Tensor, k: int) -> torch.Tensor:
        """Pairs sorted by expert (stable), one ``torch._grouped_mm`` per projection over the groups, then back
        to pair order. The sort and the group ends see every row, pad rows too (module docstring)."""
        order = torch.argsort(flat, stable=True)
        experts = torch.arange(self.gate_up_proj.shape[0], device=flat.device)
        ends = torch.searchsorted(flat.index_select(0, order), experts, right=True).to(torch.int32)
        xs = x.index_select(0, order // k)
        h = self._swiglu(torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=ends))
        ys = torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=ends)
        return torch.empty_like(ys).index_copy(0, order, ys)


class SparseMoeBlock(nn.Module):
    """Router (``gate``: ``[E, H]``, no bias), :class:`Experts`, and when ``shared_expert_width > 0`` a shared
    SwiGLU expert scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE's names and formula).

    ``forward(x [T, H]) -> [T, H]``; :meth:`route` returns each row's expert weights and ids. Every row is
    routed and combined on its own: no capacity, no token dropped, nothing mixed across rows.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.routing, self.norm_topk_prob = config.top_k, config.routing, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_width:
            self.shared_expert = MLP(config.replace(intermediate_size=config.shared_expert_width))
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, ids [T, k] int64)``: scores in float32 (softmax over the experts, or a
        sigmoid each), the ``top_k`` largest, renormalised to sum to one when ``norm_topk_prob``."""
        logits = self.gate(x).float()
        scores = torch.softmax(logits, dim=-1) if self.routing == "softmax" else torch.sigmoid(logits)
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoEDecoderLayer(DecoderLayer):
    """The dense pre-norm block (its ``forward``) with :class:`SparseMoeBlock` as ``mlp``."""

    def __init__(self, config: MoEConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)  # not DecoderLayer's: it would build a dense MLP
        self.self_attn = Attention(config, layer_idx)
        self.mlp = SparseMoeBlock(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)


class MoEModel(Model):
    """The dense ``Model`` (its ``forward``) over :class:`MoEDecoderLayer` layers."""

    def __init__(self, config: MoEConfig) -> None:
        nn.Module.__init__(self)  # not Model's: it would build dense layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MoEDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.rotary_emb = Rotary(config.head_dim, config.rope_theta)


def fill_random(model: nn.Module, gen: torch.Generator) -> None:
    """Draw ``model``'s parameters in place from ``gen`` (on their device): norm weights ~ 1 + N(0, 0.05),
    embeddings and vectors ~ N(0, 0.02), every other matrix ~ N(0, 1/fan_in), fan_in being its last dim."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.05, generator=gen)
            elif param.dim() >= 2 and name != "model.embed_tokens.weight":
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen)
            else:
                param.normal_(0.0, 0.02, generator=gen)


class MoEDecoder(Decoder):
    """A Qwen2-MoE-style causal LM over flat tokens: :class:`Decoder`'s ``forward`` and ``logits`` (same
    constraints: run inside ``piecegraph.forward_context(AttentionMetadata(...))``; ``T`` dynamic, no host reads).

    Example::

        model = MoEDecoder.random(TINY_MOE)
        cache = KVCache.for_sequences(model.config, num_seqs=2, max_len=64)
        generate(model, [[1, 2, 3]], 4, cache=cache)
    """

    def __init__(self, config: MoEConfig) -> None:
        if not isinstance(config, MoEConfig):
            raise TypeError(f"MoEDecoder needs a MoEConfig, got {type(config).__name__} (use Decoder for dense)")
        nn.Module.__init__(self)  # not Decoder's: it would build the dense model
        self._assemble(config, MoEModel(config))

    def facts(self) -> ModelFacts:
        """As :meth:`Decoder.facts`, with the experts top-k routing reaches (``num_experts``, ``top_k``)."""
        return measure(self, self.config, self.config.num_experts, self.config.top_k)

    @classmethod
    def random(cls, config: MoEConfig, seed: int = 0, dtype: torch.dtype = torch.float32,  # type: ignore[override]
               device: torch.device | str = "cpu") -> "MoEDecoder":
        """Random weights built directly on ``device`` in ``dtype`` (nothing staged on the host: the A2.7B shape
        is 28.6 GB in bf16), in eval mode, deterministic in ``seed`` for a given device.

        Norm weights ~ 1 + N(0, 0.05); embeddings and biases ~ N(0, 0.02); every other matrix (projections,
        experts, router, gates, ``lm_head``) ~ N(0, 1/fan_in), fan_in being its last dim.
        """
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype=dtype).to_empty(device=device)
        if config.tie_embeddings:  # to_empty makes new tensors per module: tie them again
            model.lm_head.weight = model.model.embed_tokens.weight
        fill_random(model, torch.Generator(device=device).manual_seed(seed))
        return model.eval()
