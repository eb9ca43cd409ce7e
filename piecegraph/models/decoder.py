"""The reference Qwen2/Llama decoder over flat tokens, with Hugging Face parameter names.

Every batch is one flat run of ``T`` tokens (``input_ids`` and ``positions`` of shape ``[T]``); which sequence a
token belongs to lives only in the attention metadata of the forward context. So the traced graph is the same
for prefill, decode and mixed batches, and ``T`` is its only dynamic size.
"""

from __future__ import annotations

import torch
from torch import nn

import piecegraph.attention.op  # noqa: F401  (registers torch.ops.piecegraph_models.attention)
from piecegraph.models.config import ModelConfig
from piecegraph.models.facts import ModelFacts, measure


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as Hugging Face does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    """Non-interleaved RoPE (``rotate_half``) from positions; angles in float32, as Hugging Face computes them."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        # Not persistent: derived from the config, and absent from Hugging Face checkpoints.
        self.register_buffer("inv_freq", self._inv_freq("cpu"), persistent=False)

    def _inv_freq(self, device: torch.device | str) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / (self.theta ** exponents)

    def _apply(self, fn, *args, **kwargs):  # type: ignore[override]
        # model.to(bfloat16) would round inv_freq; recompute it in float32 on the new device instead.
        super()._apply(fn, *args, **kwargs)
        self.inv_freq = self._inv_freq(self.inv_freq.device)
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[T, heads, head_dim]`` by ``positions`` ``[T]``."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """q/k/v/o projections, RoPE, and the attention split op (which also writes the KV cache)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        tokens = x.shape[0]
        qkv_proj = getattr(self, "qkv_proj", None)  # fuse_projections: one GEMM, split into views
        if qkv_proj is not None:
            q, k, v = torch.split(qkv_proj(x), self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        q = rotary(q, positions).reshape(tokens, -1)
        k = rotary(k, positions).reshape(tokens, -1)
        # The op writes into a buffer allocated here, so pieces after the split find it at a stable address.
        out = torch.empty_like(q)
        torch.ops.piecegraph_models.attention(q, k, v, out, self.layer_idx)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up_proj = getattr(self, "gate_up_proj", None)  # fuse_projections: one GEMM, split into views
        if gate_up_proj is not None:
            gate, up = torch.split(gate_up_proj(x), self.gate_up_sizes, dim=-1)
            return self.down_proj(nn.functional.silu(gate) * up)
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    """The ``model.`` submodule of a Hugging Face ``*ForCausalLM``: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.rotary_emb = Rotary(config.head_dim, config.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rotary_emb)
        return self.norm(x)


class Decoder(nn.Module):
    """A Qwen2/Llama causal LM over flat tokens; a Hugging Face state dict loads into it unchanged.

    ``forward(input_ids [T], positions [T]) -> hidden [T, hidden_size]`` (after the final norm) must run inside
    ``piecegraph.forward_context(AttentionMetadata(...))``. Compute logits separately with :meth:`logits`,
    usually only for each sequence's last token. The forward traces with ``torch.compile(fullgraph=True)`` with
    ``T`` dynamic: no host reads of tensor values, no data-dependent shapes. When ``config.tie_embeddings``,
    ``lm_head.weight`` is the same Parameter as ``model.embed_tokens.weight``.

    Example::

        model = Decoder.random(TINY)
        cache = KVCache.for_sequences(TINY, num_seqs=4, max_len=64)
        meta = AttentionMetadata.for_batch(cache, [(1, 0, 3)])
        with forward_context(meta):
            hidden = model(torch.tensor([5, 6, 7]), meta.positions)
        next_token = model.logits(hidden[-1:]).argmax(-1)
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self._assemble(config, Model(config))

    def _assemble(self, config: ModelConfig, model: nn.Module) -> None:
        """Every decoder's parts: ``config``, the ``model.`` submodule (embeddings, layers, final norm) and
        ``lm_head``, tied to ``model.embed_tokens`` when the config says so. Subclasses with other layers call it
        from their ``__init__`` after ``nn.Module.__init__`` (this class's would build the dense model)."""
        self.config = config
        self.model = model
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size] -> [T, vocab_size]``."""
        return self.lm_head(hidden)

    def facts(self) -> ModelFacts:
        """This decoder's device, dtype, cache shape and weight bytes as they are now (measured again on each
        call: ask once, after ``.to()`` or ``quantize_fp8``, and pass the facts down)."""
        return measure(self, self.config)

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> "Decoder":
        """A randomly initialized decoder (deterministic in ``seed``) in eval mode, for tests and benchmarks.

        Embeddings and biases ~ N(0, 0.02); linear weights ~ N(0, 1/fan_in) (0.033 at hidden 896), so each layer
        adds O(1) to the residual and the output depends on the context, not only on the current token (with
        0.02 everywhere a tiny tied model just repeats its input); norm weights ~ 1 + N(0, 0.05).
        """
        model = cls(config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    std, mean = 0.05, 1.0
                elif name.endswith("proj.weight") or name == "lm_head.weight":
                    std, mean = param.shape[1] ** -0.5, 0.0
                else:
                    std, mean = 0.02, 0.0
                param.copy_(mean + std * torch.randn(param.shape, generator=gen))
        return model.to(dtype=dtype, device=device).eval()
