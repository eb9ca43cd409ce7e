"""Load a Hugging Face causal LM from a local directory (never the hub) and wrap it; check a model or a folder."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from piecegraph.hf.arch import UnsupportedModelError, check_supported
from piecegraph.hf.mla import MLAHFDecoder
from piecegraph.hf.model import HFDecoder
from piecegraph.hf.probe import Verdict
from piecegraph.hf.probe import verify as verify_decoder
from piecegraph.models.fp8_block import swap_fp8_linears
from piecegraph.models.loader import _read_tensors, _shard_files
from piecegraph.models.mla_config import MODEL_TYPES as MLA_MODEL_TYPES
from piecegraph.models.quant_formats import dequantize_tensors, float_dtype, ragged_blocks, read_quant


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
    mla = model_type in MLA_MODEL_TYPES  # the engine's MLA decoder on the model's tensors (piecegraph/hf/mla.py)
    if not mla:
        check_supported(config)
    kwargs: dict[str, Any] = {"local_files_only": True, "dtype": dtype or "auto"}
    kwargs.update({k: options.pop(k) for k in ("experts_implementation", "attn_implementation") if k in options})
    quant = read_quant(path)  # transformers dequantizes block FP8 itself; the rest piecegraph dequantizes
    if quant is not None and (quant.producer != "fp8" or ragged_blocks(_shard_files(path), quant)):
        hf = _from_dequantized(path, dtype, quant, kwargs).to(device)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
        if quant is not None:  # transformers kept block FP8 (on a GPU): piecegraph's kernels, not the hub's
            swap_fp8_linears(hf, hf.get_input_embeddings().weight.dtype)
    if "experts_implementation" not in kwargs and getattr(hf.config, "_experts_implementation", None) == "eager":
        hf.config._experts_implementation = "batched_mm"  # grouped_mm cannot run here; eager does not trace
    return (MLAHFDecoder if mla else HFDecoder)(hf, verify=verify, **options)


def _from_dequantized(path: Path, dtype: torch.dtype | None, quant: Any, kwargs: dict[str, Any]) -> Any:
    """The transformers model of ``path`` with its weights dequantized by piecegraph, for formats transformers
    cannot load here (compressed-tensors without its package, ModelOpt, block FP8 with partial edge blocks), in
    ``dtype`` (default: the checkpoint's unquantized tensors'). The plain weights go through a temporary folder, so
    transformers' own loading applies (its renames, fused experts from per-expert checkpoints); it costs their size
    on disk while loading."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tensors = dict(_read_tensors(_shard_files(path), "cpu"))
    target = dtype or float_dtype(tensors)
    state = {n: t.to(target) for n, t in dequantize_tensors(tensors, quant).items()}
    config = {k: v for k, v in json.loads((path / "config.json").read_text()).items()
              if k not in ("quantization_config", "compression_config")}
    with tempfile.TemporaryDirectory(prefix="piecegraph-dequantized-") as folder:
        save_file(state, str(Path(folder) / "model.safetensors"), metadata={"format": "pt"})
        (Path(folder) / "config.json").write_text(json.dumps(config))
        if (path / "generation_config.json").is_file():
            shutil.copy(path / "generation_config.json", folder)
        return AutoModelForCausalLM.from_pretrained(folder, **{**kwargs, "dtype": target})


def verify(model: Any, *, raise_on_failure: bool = True) -> Verdict:
    """Whether piecegraph runs ``model`` exactly: its structure, then the numeric self-check of
    :mod:`piecegraph.hf.probe` (cached per model instance). ``model``: a Hugging Face causal LM (wrapped for the
    check and given back as it was) or an :class:`HFDecoder`. Returns the :class:`~piecegraph.hf.probe.Verdict`;
    a refusal raises :class:`UnsupportedModelError` naming the model type and the reason, unless
    ``raise_on_failure`` is False (then the verdict says it)."""
    if isinstance(model, HFDecoder):
        return _verify(model, raise_on_failure)
    try:
        wrapped = HFDecoder(model, verify=False)
    except UnsupportedModelError as err:
        if raise_on_failure:
            raise
        return Verdict(getattr(model.config, "model_type", type(model).__name__), False, str(err))
    with wrapped:
        return _verify(wrapped, raise_on_failure)


def _verify(decoder: HFDecoder, raise_on_failure: bool) -> Verdict:
    """The probe's verdict on ``decoder``; an MLA model (the engine's decoder on its tensors) checks itself."""
    if not isinstance(decoder, MLAHFDecoder):
        return verify_decoder(decoder, raise_on_failure=raise_on_failure)
    verdict = decoder.verdict()
    if raise_on_failure and not verdict.ok:
        raise UnsupportedModelError(verdict.reason)
    return verdict


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
        return _verify(decoder, raise_on_failure=False)


__all__ = ["UnsupportedModelError", "check_folder", "load", "read_model_type", "verify"]
