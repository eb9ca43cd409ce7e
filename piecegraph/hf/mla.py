"""``piecegraph.hf`` for multi-head latent attention models (``deepseek_v2``, ``deepseek_v3``, ``deepseek_v32``,
``glm_moe_dsa``): the engine's :class:`~piecegraph.models.mla.MLADecoder`, built from the Hugging Face model's
config and sharing its tensors (nothing copied), instead of the model's own layers.

Why not the model's own layers through ``AttentionInterface``, as for other models: their attention expands the
latent into per-head keys and values before the attention function sees them (the paged cache would hold
``num_heads`` times more than the latent), and the DSA indexer (DeepSeek-V3.2, GLM-5) keeps its own key cache through
transformers' ``Cache`` object, which piecegraph's flat forward does not give it. The engine's decoder computes
the same function (tests/cpu/test_mla_models.py checks greedy tokens against transformers' ``generate``) on the
latent paged cache.

Nothing on the Hugging Face model changes: its own forward and ``generate`` keep working, and unwrapping has
nothing to undo.
"""

from __future__ import annotations

from typing import Any

import torch

import piecegraph.hf.probe as probe
from piecegraph.hf.arch import UnsupportedModelError, model_type
from piecegraph.hf.model import SUBSTITUTES, HFDecoder
from piecegraph.models.facts import ModelFacts
from piecegraph.models.mla import MLADecoder
from piecegraph.models.mla_config import MODEL_TYPES, MLAConfig
from piecegraph.models.moe import Experts


def is_mla_model(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face causal LM of an MLA model type (:data:`MODEL_TYPES`)."""
    config = getattr(model, "config", None)
    return (config is not None and getattr(config, "model_type", None) in MODEL_TYPES
            and hasattr(model, "lm_head") and hasattr(model, "model"))


def engine_decoder(hf: torch.nn.Module, max_seq_len: int | None = None, attention_backend: str = "auto"
                   ) -> MLADecoder:
    """An :class:`MLADecoder` of ``hf``'s config whose parameters and buffers ARE ``hf``'s (same tensors, shared:
    a later in-place change of one is the other's); only the rotary table is computed anew. Raises
    :class:`UnsupportedModelError` naming the model type when the config cannot be read (see
    :meth:`MLAConfig.from_hf`) or a weight the decoder needs is missing from the model."""
    name = model_type(hf.config)
    try:
        config = MLAConfig.from_hf(hf.config.to_dict(), max_seq_len=max_seq_len)
    except ValueError as err:
        raise UnsupportedModelError(f"model_type {name!r}: {err}") from None
    config = config.replace(attention_backend=attention_backend)
    with torch.device("meta"):
        decoder = MLADecoder(config)
    theirs = hf.state_dict(keep_vars=True)  # every name, tied ones too; persistent buffers included
    missing = [n for n in decoder.state_dict() if n not in theirs]
    if missing:
        raise UnsupportedModelError(f"model_type {name!r}: the model has no {', '.join(missing[:4])} (the MLA "
                                    "decoder its config describes needs them)")
    for full, tensor in theirs.items():
        parent_name, _, leaf = full.rpartition(".")
        try:
            parent = decoder.get_submodule(parent_name)
        except AttributeError:
            continue  # e.g. the rotary embedding's or MTP layers' tensors: not part of the decoder
        if leaf in parent._parameters:
            parent._parameters[leaf] = tensor
        elif leaf in parent._buffers:
            parent._buffers[leaf] = tensor
    device = decoder.model.embed_tokens.weight.device
    decoder.model.rotary_emb.to_empty(device=device)  # its _apply computes the table on the model's device
    for module in decoder.modules():
        if isinstance(module, Experts):  # built on meta: choose the implementation for the real weights now
            module.use_grouped_mm = module._choose()
    return decoder.eval()


class MLAHFDecoder(HFDecoder):
    """A Hugging Face MLA causal LM as a flat-token decoder: :class:`~piecegraph.hf.HFDecoder`'s interface
    (``forward``, ``logits``, ``config``, ``facts``, ``hf``, ``close`` ...), computed by :func:`engine_decoder`'s
    decoder on the model's own tensors. ``config`` is the :class:`~piecegraph.models.MLAConfig` (a latent cache
    shape). ``verify`` (``None``: on unless ``PIECEGRAPH_HF_VERIFY=0``): compare the last-token logits of a
    13-token probe with the model's own forward first (relative tolerance by dtype, as
    :mod:`piecegraph.hf.probe`), else :class:`UnsupportedModelError`. The model itself is never changed."""

    piecegraph_not_traced = ("owns_wrap",)

    def __init__(self, model: torch.nn.Module, max_seq_len: int | None = None,
                 attention_backend: str = "auto", verify: bool | None = None) -> None:
        torch.nn.Module.__init__(self)  # not HFDecoder's: nothing of the model is wrapped
        self.engine = engine_decoder(model, max_seq_len, attention_backend)
        self.hf = model
        self.hf_config = model.config
        self.config = self.engine.config
        self.owns_wrap = False  # nothing to unwrap
        self.row_wise_experts = False  # the engine's experts declare themselves padding-safe
        self.constants, self.final_softcap, self.logit_scale = [], None, 1.0
        if probe.enabled(verify):
            self._check(None, None)

    def _check(self, tolerance: float | None, prompt: list[int] | None) -> None:
        verdict = self.verdict(tolerance, prompt)
        if not verdict.ok:
            raise UnsupportedModelError(verdict.reason)

    @torch.no_grad()
    def verdict(self, tolerance: float | None = None, prompt: list[int] | None = None) -> probe.Verdict:
        """The numeric self-check as a :class:`~piecegraph.hf.probe.Verdict` (what ``piecegraph.hf.verify`` and
        ``piecegraph doctor --model`` report): the last-token logits of ``prompt`` (default: the probe's first
        prompt) through the engine decoder against the model's own forward, within ``tolerance`` (default: the
        probe's for the dtype)."""
        from piecegraph.attention.kv_cache import KVCache
        from piecegraph.attention.metadata import AttentionMetadata
        from piecegraph.context import forward_context

        weight = self.engine.model.embed_tokens.weight
        tolerance = probe.TOLERANCE.get(weight.dtype, 5e-2) if tolerance is None else tolerance
        prompt = probe.probe_prompts(self.config.vocab_size)[0] if prompt is None else prompt
        ids = torch.tensor(prompt, device=weight.device)
        want = self.hf(ids[None]).logits[0, -1].float()
        cache = KVCache.for_sequences(self.config, 1, len(prompt), dtype=weight.dtype, device=weight.device,
                                      backend="torch")
        meta = AttentionMetadata.for_batch(cache, [("probe", 0, len(prompt))])
        with forward_context(meta):
            got = self.engine.logits(self.engine(ids, meta.positions)[-1:])[0].float()
        error = float((got - want).norm() / want.norm().clamp_min(1e-30))
        ok = error <= tolerance
        reason = "" if ok else (f"model_type {self.model_type!r}: piecegraph's MLA decoder differs from the model's "
                                f"own forward on a probe prompt (relative logit error {error:.3g} > {tolerance:g})")
        return probe.Verdict(self.model_type, ok, reason, tolerance=tolerance, logits_error=error,
                             logits_max_abs=float((got - want).abs().max()))

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def wrapped(self) -> bool:
        return True  # never wrapped in place: always ready

    def unwrap(self) -> torch.nn.Module:
        return self.hf

    def suspend(self) -> None:
        pass

    def resume(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.engine(input_ids, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.engine.logits(hidden)

    def facts(self) -> ModelFacts:
        return self.engine.facts()

    def check_backend(self, backend_name: str) -> None:
        pass  # the latent cache's own backend runs every layer (its scale is passed per call)


SUBSTITUTES.append((is_mla_model, MLAHFDecoder))  # HFDecoder(model) and piecegraph.compile(model) build it
