"""Load a Hugging Face causal LM from a local directory (never the hub) and wrap it; check a model or a folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from piecegraph.hf.arch import UnsupportedModelError, check_supported
from piecegraph.hf.model import HFDecoder
from piecegraph.hf.probe import Verdict
from piecegraph.hf.probe import verify as verify_decoder


def read_model_type(path: str | Path) -> str | None:
    """``model_type`` of the ``config.json`` in ``path``, or ``None`` when there is none."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("model_type")


def load(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
         verify: bool | None = None, **options: Any) -> HFDecoder:
    """The :class:`HFDecoder` of the local checkpoint directory ``path`` (``AutoModelForCausalLM``, local files
    only), in eval mode. ``dtype`` defaults to the checkpoint's. A mixture-of-experts model keeps Hugging Face's
    default experts implementation (``grouped_mm``) or gets ``batched_mm`` where that falls back to ``eager``
    (a loop Dynamo cannot trace), unless ``options`` names one; other ``options`` go to :class:`HFDecoder`.
    The config is checked before the weights load (:func:`~piecegraph.hf.arch.check_supported`), the model after
    (:class:`HFDecoder`: its structure and, unless ``verify`` is False, the numeric self-check; ``None``: on
    unless ``PIECEGRAPH_HF_VERIFY=0``).
    ``load(path).unwrap()`` is the plain Hugging Face model (see :func:`piecegraph.hf.unwrap`).
    Raises ``FileNotFoundError`` for a directory without ``config.json``, :class:`UnsupportedModelError`
    naming the model type piecegraph cannot run, ``ImportError`` without transformers.
    """
    path = Path(path)
    model_type = read_model_type(path)
    if model_type is None:
        raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face checkpoint directory")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as err:
        raise ImportError("loading a Hugging Face model needs transformers: pip install 'piecegraph[hf]'") from err
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_supported(config)
    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": dtype or "auto"}
    kwargs.update({k: options.pop(k) for k in ("experts_implementation", "attn_implementation") if k in options})
    hf = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
    if "experts_implementation" not in kwargs and getattr(hf.config, "_experts_implementation", None) == "eager":
        hf.config._experts_implementation = "batched_mm"  # grouped_mm cannot run here; eager does not trace
    return HFDecoder(hf, verify=verify, **options)


def verify(model: Any, *, raise_on_failure: bool = True) -> Verdict:
    """Whether piecegraph runs ``model`` exactly: its structure, then the numeric self-check of
    :mod:`piecegraph.hf.probe` (cached per model instance). ``model``: a Hugging Face causal LM (wrapped for the
    check and given back as it was) or an :class:`HFDecoder`. Returns the :class:`~piecegraph.hf.probe.Verdict`;
    a refusal raises :class:`UnsupportedModelError` naming the model type and the reason, unless
    ``raise_on_failure`` is False (then the verdict says it)."""
    if isinstance(model, HFDecoder):
        return verify_decoder(model, raise_on_failure=raise_on_failure)
    try:
        wrapped = HFDecoder(model, verify=False)
    except UnsupportedModelError as err:
        if raise_on_failure:
            raise
        return Verdict(getattr(model.config, "model_type", type(model).__name__), False, str(err))
    with wrapped:
        return verify_decoder(wrapped, raise_on_failure=raise_on_failure)


def check_folder(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
                 ) -> Verdict:
    """The verdict on the checkpoint folder ``path`` (what ``piecegraph doctor --model PATH`` prints): its config,
    then the model loaded as :func:`load` loads it (``dtype`` default: the checkpoint's), then the numeric
    self-check. A refusal is a verdict with ``ok`` False and the reason; a missing folder or ``config.json``
    raises ``FileNotFoundError``."""
    try:
        decoder = load(path, dtype=dtype, device=device, verify=False)
    except UnsupportedModelError as err:
        return Verdict(read_model_type(path) or "?", False, str(err))
    with decoder:
        return verify_decoder(decoder, raise_on_failure=False)


__all__ = ["UnsupportedModelError", "check_folder", "load", "read_model_type", "verify"]
