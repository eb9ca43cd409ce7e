"""Load a Hugging Face causal LM from a local directory (never the hub) and wrap it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from piecegraph.hf.arch import UnsupportedModelError, check_supported
from piecegraph.hf.model import HFDecoder


def read_model_type(path: str | Path) -> str | None:
    """``model_type`` of the ``config.json`` in ``path``, or ``None`` when there is none."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get("model_type")


def load(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
         **options: Any) -> HFDecoder:
    """The :class:`HFDecoder` of the local checkpoint directory ``path`` (``AutoModelForCausalLM``, local files
    only), in eval mode. ``dtype`` defaults to the checkpoint's. A mixture-of-experts model keeps Hugging Face's
    default experts implementation (``grouped_mm``) or gets ``batched_mm`` where that falls back to ``eager``
    (a loop Dynamo cannot trace), unless ``options`` names one; other ``options`` go to :class:`HFDecoder`.
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
    return HFDecoder(hf, **options)


__all__ = ["UnsupportedModelError", "load", "read_model_type"]
