"""``HFDecoder``: an unmodified Hugging Face ``*ForCausalLM`` as a flat-token decoder piecegraph can graph.

The wrapper owns no weights: it calls the model's own base model (``model.model``) with explicit positions,
``use_cache=False`` and ``return_dict=False``, and its own ``lm_head`` separately. Attention goes through the
split op (see ``piecegraph.hf.attention``), so the graph splits into ``num_layers + 1`` pieces.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from piecegraph.hf.arch import cache_config, check_supported, layer_constants, model_type
from piecegraph.hf.attention import FLAT, NAME, install


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``, without importing transformers (a model of that
    class exists only once transformers was imported)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    try:
        return isinstance(model, transformers.PreTrainedModel)
    except AttributeError:  # a half-imported or stubbed transformers
        return False


class HFDecoder(torch.nn.Module):
    """A Hugging Face causal LM over flat tokens: ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``.

    Constraints: a decoder of :data:`piecegraph.hf.arch.SUPPORTED` (else :class:`UnsupportedModelError` naming
    its model_type), in eval mode (the wrapper puts it there), called inside ``piecegraph.forward_context`` of
    :class:`~piecegraph.models.AttentionMetadata` on a :class:`~piecegraph.models.KVCache` built from
    :attr:`config` (``KVCache.for_sequences(wrapped.config, ...)``). ``config`` is a
    :class:`~piecegraph.models.ModelConfig` of the cache shape (what ``piecegraph.models.generate``, ``KVCache``
    and the bench read); the model's own config is ``hf_config``. :meth:`logits` applies ``lm_head`` (and a final
    logit softcap, Gemma 2) to the rows given, usually each sequence's last token.

    Wrapping switches the model's attention implementation to ``"piecegraph"``, which serves the model's own
    forward and ``generate`` with the implementation it had before, so those keep giving what they gave.

    Example::

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model = HFDecoder(hf)
        cache = KVCache.for_sequences(model.config, num_seqs=2, max_len=64)
        meta = AttentionMetadata.for_batch(cache, [("a", 0, 3)])
        with piecegraph.forward_context(meta):
            hidden = model(torch.tensor([5, 6, 7]), meta.positions)
        next_token = model.logits(hidden[-1:]).argmax(-1)
    """

    def __init__(self, model: torch.nn.Module, max_seq_len: int | None = None,
                 attention_backend: str = "auto") -> None:
        super().__init__()
        experts = getattr(model.config, "_experts_implementation", None) if _has_experts(model) else None
        check_supported(model.config, experts)
        if getattr(model, "model", None) is None or not hasattr(model, "lm_head"):
            raise TypeError(f"{type(model).__name__} is not a *ForCausalLM with .model and .lm_head: pass the "
                            "causal LM (AutoModelForCausalLM), not its base model")
        model.eval()
        install(model)
        self.hf = model
        self.hf_config = model.config
        self.config = cache_config(model.config, max_seq_len, attention_backend)
        self.constants = layer_constants(model)
        self.final_softcap = getattr(model.config, "final_logit_softcapping", None)
        # Hugging Face's grouped_mm / batched_mm experts flatten (token, k) pairs, sort them by expert and scatter
        # back: every output row depends on its own row only, so padding a call to a capture size is safe.
        self.row_wise_experts = experts in ("grouped_mm", "batched_mm")

    @property
    def model(self) -> torch.nn.Module:
        """The base model (``hf.model``: embeddings, layers, final norm), as the reference decoder's ``.model``."""
        return self.hf.model

    @property
    def model_type(self) -> str:
        return model_type(self.hf_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.hf.config._attn_implementation != NAME:  # switched back since the wrap: HF's would attend wrong
            raise RuntimeError(f"the model's attention implementation is now "
                               f"{self.hf.config._attn_implementation!r}, not {NAME!r}: wrap it again "
                               "(piecegraph.hf.HFDecoder(model)) after set_attn_implementation")
        # A 4D mask makes Hugging Face's mask builders return it as is: no [T, T] mask is built (attention is
        # paged and causal in the op, which ignores it).
        no_mask = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)
        out = self.hf.model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=no_mask,
                            use_cache=False, return_dict=False, **{FLAT: True})
        return out[0][0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size] -> [T, vocab_size]``, as the Hugging Face model computes them."""
        logits = self.hf.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def check_backend(self, backend_name: str) -> None:
        """Refuse, naming the model type, a backend that cannot run every layer's constants (FlashInfer plans one
        scale for all layers, and no sliding window shorter than the cache or softcap)."""
        if backend_name != "flashinfer":
            return
        scale = self.config.head_dim ** -0.5
        for i, c in enumerate(self.constants):
            window = c["window"] if c["window"] and c["window"] < self.config.max_seq_len else None
            if window or c["softcap"] or abs(c["scale"] - scale) > 1e-12 * scale:
                raise ValueError(
                    f"model_type {self.model_type!r}: layer {i} needs scale={c['scale']}, window={window}, "
                    f"softcap={c['softcap']}, which the flashinfer attention backend does not implement (it plans "
                    f"scale {scale} and no window or softcap); use attention_backend='torch'")


def _has_experts(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.endswith("Experts") for m in model.modules())
