"""The MLA decoder over flat tokens (DeepSeek-V2/V3/V3.2, Kimi-K2, GLM-5): latent attention with weight absorption, the
DSA indexer, DeepSeek-style MoE; Hugging Face parameter names, so their state dicts load unchanged.

Attention is the split op ``piecegraph_models::mla_attention`` (:mod:`piecegraph.attention.mla_op`) on a paged
latent cache: per token the normalized latent ``c_kv`` (``kv_lora_rank``) and the rotated key ``k_pe``
(``qk_rope_head_dim``), once for all heads. The up-projections are absorbed: the query's no-RoPE part is multiplied
by ``W_UK`` (from ``kv_b_proj``) before the op, so scores are ``q_nope W_UK . c_kv + q_pe . k_pe``; the op returns
``sum_j p_j c_kv_j`` per head, and ``W_UV`` then ``o_proj`` follow here. This equals transformers' expanded
``k_nope = W_UK c_kv``, ``v = W_UV c_kv`` exactly in exact arithmetic (float32 rounding apart).
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

import piecegraph.attention.mla_op  # noqa: F401  (registers torch.ops.piecegraph_models.mla_attention)
from piecegraph.models.decoder import MLP, Decoder, RMSNorm
from piecegraph.models.deepseek_moe import DeepseekMoE, keep_float32
from piecegraph.models.facts import ModelFacts, measure
from piecegraph.models.mla_config import MLAConfig
from piecegraph.models.moe import fill_random

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not config.rms_norm_eps
LORA_NORM_EPS = 1e-6
INDEX_NORM_EPS = 1e-6  # the indexer's k_norm (a LayerNorm)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(config: MLAConfig) -> tuple[torch.Tensor, float]:
    """``(inv_freq [qk_rope_head_dim // 2] float32, attention_factor)`` as transformers' default or YaRN RoPE
    computes them for ``config`` (YaRN: its ramp between interpolated and extrapolated frequencies, and the
    cos/sin scale ``attention_factor``)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if not config.rope_scaling:
        return 1.0 / pos_freqs, 1.0
    yarn = dict(config.rope_scaling)
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                            else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(yarn.get("beta_fast") or 32), correction_dim(yarn.get("beta_slow") or 1)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(config: MLAConfig) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when set (transformers'
    ``yarn_apply_mscale``: DeepSeek scales the whole score, not only the rotary dims)."""
    scale = config.qk_head_dim ** -0.5
    yarn = dict(config.rope_scaling)
    if yarn.get("mscale_all_dim"):
        scale *= _yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
    return scale


class MLARotary(nn.Module):
    """``forward(positions [T]) -> (cos, sin)``, each ``[T, qk_rope_head_dim // 2]`` float32, scaled by the
    YaRN attention factor (1 without YaRN). :func:`rotate` applies them."""

    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.config = config
        inv_freq, self.attention_factor = rope_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # derived from the config: not in checkpoints

    def _apply(self, fn, *args, **kwargs):  # type: ignore[override]
        # .to(bfloat16) / .to_empty() would round or drop inv_freq: recompute it in float32 on the new device
        super()._apply(fn, *args, **kwargs)
        self.inv_freq = rope_frequencies(self.config)[0].to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on ``x [T, heads, D]`` with ``cos``/``sin`` ``[T, D/2]`` (cast to ``x``'s dtype first, as transformers
    does). ``interleave``: the pairs are ``(x0, x1), (x2, x3), ...`` and the result is laid out as transformers'
    ``apply_rotary_pos_emb_interleave`` returns it (rotated even dims, then odd dims); else halves
    (``rotate_half``). Queries and keys get the same layout, so their dot products are those of any layout."""
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Indexer(nn.Module):
    """The DSA indexer of DeepSeek-V3.2 and GLM-5 (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``): per token a
    query of ``index_n_heads`` heads from the q_a latent, one key, and per-head weights
    ``weights_proj(x) * heads**-0.5`` in float32; the first ``qk_rope_head_dim`` dims of query and key rotated, in
    interleaved pairs (GLM-5) or in halves (V3.2) as ``config.index_rope_interleave`` says."""

    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.heads, self.dim, self.rope_dim = config.index_n_heads, config.index_head_dim, config.qk_rope_head_dim
        self.interleave = config.index_rope_interleave
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=INDEX_NORM_EPS)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)

    def _apply(self, fn, *args, **kwargs):  # type: ignore[override]
        super()._apply(fn, *args, **kwargs)
        keep_float32(self.weights_proj, "weight")  # transformers keeps it in float32 (_keep_in_fp32_modules)
        return self

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(index_q [T, heads, dim], index_weights [T, heads] float32, index_k [T, dim])``."""
        tokens, p = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(tokens, self.heads, self.dim)
        q = torch.cat([rotate(q[..., :p], cos, sin, self.interleave), q[..., p:]], dim=-1)
        k = self.k_norm(self.wk(x)).unsqueeze(1)
        k = torch.cat([rotate(k[..., :p], cos, sin, self.interleave), k[..., p:]], dim=-1).squeeze(1)
        # transformers keeps weights_proj in float32 and casts x to it: the same products in float32
        weights = nn.functional.linear(x.float(), self.weights_proj.weight.float()) * self.heads ** -0.5
        return q.contiguous(), weights, k.contiguous()


class MLAAttention(nn.Module):
    """Multi-head latent attention of one layer (Hugging Face names: ``q_proj`` or ``q_a_proj``/``q_a_layernorm``/
    ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, ``indexer``), calling
    the split op with absorbed weights (module docstring). A ``"shared"`` DSA layer has no indexer: the op reuses
    the selection of the step's most recent layer that had one."""

    def __init__(self, config: MLAConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_idx, self.heads, self.interleave = layer_idx, c.num_heads, c.rope_interleave
        self.nope, self.rope, self.rank, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, \
            c.value_head_dim
        self.scale, self.topk = softmax_scale(c), c.index_topk
        self.index_scale = c.index_head_dim ** -0.5 if c.index_head_dim else 1.0
        qk = c.num_heads * c.qk_head_dim
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, qk, bias=False)
        else:
            self.q_proj = nn.Linear(c.hidden_size, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.value_head_dim), bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.value_head_dim, c.hidden_size, bias=c.attention_bias)
        types = c.layer_indexer_types
        self.indexer = Indexer(c) if types and types[layer_idx] == "full" else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        q_resid = None
        if hasattr(self, "q_a_proj"):
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        else:
            q = self.q_proj(x)
        q = q.view(tokens, self.heads, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], rotate(q[..., self.nope:], cos, sin, self.interleave)
        ckv, kpe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        ckv = self.kv_a_layernorm(ckv)
        kpe = rotate(kpe.unsqueeze(1), cos, sin, self.interleave).squeeze(1)
        w_kv = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        # q_nope[t, h] @ W_UK[h]: [H, T, nope] x [H, nope, R] -> [T, H, R]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_kv[:, : self.nope]).transpose(0, 1).contiguous()
        index_q = index_weights = index_k = None
        if self.indexer is not None:
            index_q, index_weights, index_k = self.indexer(x, q_resid, cos, sin)
        # The op writes into a buffer allocated here, so pieces after the split find it at a stable address.
        out = torch.empty_like(q_latent)
        torch.ops.piecegraph_models.mla_attention(
            q_latent, q_pe.contiguous(), ckv.contiguous(), kpe.contiguous(), out, self.layer_idx, self.scale,
            self.topk, index_q, index_weights, index_k, self.index_scale)
        # out[t, h] (latent) @ W_UV[h]^T: [H, T, R] x [H, R, v] -> [T, H * v]
        values = torch.bmm(out.transpose(0, 1), w_kv[:, self.nope:].transpose(1, 2)).transpose(0, 1)
        return self.o_proj(values.reshape(tokens, self.heads * self.v_dim))


class MLADecoderLayer(nn.Module):
    """Pre-norm block: ``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``; the
    MLP dense (width ``intermediate_size``) or :class:`~piecegraph.models.deepseek_moe.DeepseekMoE`."""

    def __init__(self, config: MLAConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(config, layer_idx)
        sparse = config.layer_mlp_types[layer_idx] == "sparse"
        self.mlp = DeepseekMoE(config) if sparse else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class MLAModel(nn.Module):
    """The ``model.`` submodule: embeddings, layers, final norm, and the rotary table shared by every layer."""

    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MLADecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.rotary_emb = MLARotary(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class MLADecoder(Decoder):
    """An MLA causal LM over flat tokens (DeepSeek-V2/V3, GLM-5 shapes): :class:`~piecegraph.models.Decoder`'s
    ``forward(input_ids [T], positions [T]) -> hidden [T, hidden_size]`` and ``logits``, with the same constraints
    (inside ``piecegraph.forward_context``; ``T`` dynamic, no host reads), on a latent KV cache built from
    :attr:`config` (``KVCache.for_sequences(model.config, ...)``: one ``kv_lora_rank`` latent and one rotary key
    per token, plus the indexer's key with DSA).

    Example::

        model = MLADecoder.random(TINY_GLM5)
        generate(model, [[1, 2, 3]], 4)
    """

    def __init__(self, config: MLAConfig) -> None:
        if not isinstance(config, MLAConfig):
            raise TypeError(f"MLADecoder needs an MLAConfig, got {type(config).__name__}")
        nn.Module.__init__(self)  # not Decoder's: it would build the dense model
        self._assemble(config, MLAModel(config))

    def facts(self) -> ModelFacts:
        """As :meth:`Decoder.facts`, with the routed experts top-k reaches (``num_experts``, ``top_k``)."""
        sparse = "sparse" in self.config.layer_mlp_types
        return measure(self, self.config, self.config.num_experts if sparse else 0, self.config.top_k)

    @classmethod
    def random(cls, config: MLAConfig, seed: int = 0, dtype: torch.dtype = torch.float32,  # type: ignore[override]
               device: torch.device | str = "cpu") -> "MLADecoder":
        """Random weights built directly on ``device`` in ``dtype`` (nothing staged on the host), in eval mode,
        deterministic in ``seed`` for a given device: norm weights ~ 1 + N(0, 0.05), matrices ~ N(0, 1/fan_in),
        embeddings and biases ~ N(0, 0.02), routers' score-correction biases ~ N(0, 0.01) (float32).

        ``device="meta"``: shapes and dtypes only, nothing allocated (the preset's :meth:`facts`: weight bytes, KV
        bytes per token). On the CPU, weights larger than the host's physical memory raise ``MemoryError`` before
        anything is allocated (``glm5-shape`` in float32 is ~92 GB)."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype=dtype)
        device = torch.device(device)
        if device.type == "cpu":
            _check_host_memory(model, config, dtype)
        model = model.to_empty(device=device)
        if config.tie_embeddings:  # to_empty makes new tensors per module: tie them again
            model.lm_head.weight = model.model.embed_tokens.weight
        if device.type == "meta":
            return model.eval()  # nothing to fill
        gen = torch.Generator(device=device).manual_seed(seed)
        fill_random(model, gen)
        with torch.no_grad():  # after the parameters, as before: the same seed gives the same model
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0.0, 0.01, generator=gen)
        return model.eval()


def _check_host_memory(model: nn.Module, config: MLAConfig, dtype: torch.dtype) -> None:
    """``MemoryError`` when ``model``'s (meta) tensors need more bytes than the host's physical memory."""
    need = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return  # unknown: let the allocator decide
    if need > have:
        raise MemoryError(f"MLADecoder.random: {config.num_layers}-layer {config.model_type} weights need "
                          f"{need / 1e9:.1f} GB in {dtype}, more than this host's {have / 1e9:.1f} GB of memory; "
                          "build it on a GPU (device='cuda', bf16) or on device='meta' for its facts")
