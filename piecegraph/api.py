"""``piecegraph.compile``: the public entry point."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .config import Config
from .diagnose.advisor import DoctorAdvisor
from .graphed.module import GraphedModule


def compile(  # noqa: A001 - mirrors torch.compile on purpose
    model: torch.nn.Module,
    *,
    mode: str | None = None,
    split_ops: Iterable[Any] | None = None,
    capture_sizes: Iterable[int] | None = None,
    max_tokens: int | None = None,
    compiler: str | None = None,
    config: Config | None = None,
    **options: Any,
) -> GraphedModule:
    """Trace ``model`` with Dynamo, split it at split ops, compile each piece once and replay CUDA graphs.

    Constraints: ``model.forward`` takes tensors whose dim ``token_dim`` (0) counts tokens, plus non-tensor
    arguments that never change; it returns a tensor or a tuple of tensors; it must trace with
    ``fullgraph=True`` (see ``piecegraph doctor`` when it does not). Split ops (attention) run eagerly between
    pieces and must write their tensor results into buffers they were given. Nothing runs until the first call.

    Example::

        graphed = piecegraph.compile(model, max_tokens=256)
        with piecegraph.forward_context(metadata):
            hidden = graphed(input_ids, positions)   # traced, compiled and captured for this size
        graphed.stats()  # {'sizes': [8], 'pieces': 25, 'capture_s': {8: 0.4}, ...}

    Pass ``config=Config(...)`` for every option at once; a keyword option given explicitly always overrides its
    field (even when it equals the default), one left out keeps the config's value (``Config``'s defaults:
    ``mode="piecewise"``, ``max_tokens=512``, ``compiler="inductor"``).

    A Hugging Face ``PreTrainedModel`` causal LM is wrapped first in :class:`piecegraph.hf.HFDecoder`: the
    returned module takes flat ``(input_ids [T], positions [T])`` and returns hidden states (``.model.logits(h)``
    for logits); the model's own forward and ``generate`` keep working as before. A multi-head latent attention
    model (``deepseek_v2``, ``deepseek_v3``, ``deepseek_v32``, ``glm_moe_dsa``) gets
    :class:`piecegraph.hf.mla.MLAHFDecoder`: the engine's MLA decoder (latent cache, DSA indexer) on the model's own
    tensors, split at ``mla_attention``.
    """
    model = _hf_wrapped(model)
    given = {"mode": mode, "max_tokens": max_tokens, "compiler": compiler, "split_ops": split_ops,
             "capture_sizes": capture_sizes}
    fields = {k: v for k, v in given.items() if v is not None}  # Config checks and converts them, naming the field
    return GraphedModule(model, (config or Config()).replace(**fields, **options), advisor=DoctorAdvisor())


def _hf_wrapped(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, or its :class:`~piecegraph.hf.HFDecoder` when it is a transformers ``PreTrainedModel``
    (checked without importing transformers)."""
    from .hf.model import is_hf_model

    if not is_hf_model(model):
        return model
    from .hf.model import HFDecoder

    return HFDecoder(model)
