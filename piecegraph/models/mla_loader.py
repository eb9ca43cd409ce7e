"""Load a Hugging Face folder of a ``deepseek_v2``, ``deepseek_v3``, ``deepseek_v32`` or ``glm_moe_dsa`` model
into :class:`~piecegraph.models.mla.MLADecoder` (config.json + safetensors, local only)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from piecegraph.models.loader import _names, _read_tensors, _shard_files
from piecegraph.models.mla import MLADecoder
from piecegraph.models.mla_config import MODEL_TYPES, MLAConfig
from piecegraph.models.quant_formats import (
    FP8,
    CheckpointQuant,
    dequant_weight,
    float_dtype,
    is_aux,
    quantized_names,
    read_quant,
)

log = logging.getLogger("piecegraph.models")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHOW = 8
# weights the decoder keeps in float32 whatever its dtype (routers, the indexer's weights_proj), as transformers does
_FLOAT32_WEIGHTS = ("mlp.gate.weight", "indexer.weights_proj.weight")


def is_mla_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a ``config.json`` of one of :data:`~piecegraph.models.mla_config.MODEL_TYPES`."""
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") in MODEL_TYPES


def read_mla_config(path: str | Path, max_seq_len: int | None = None) -> MLAConfig:
    """The :class:`MLAConfig` of the checkpoint folder ``path`` (its ``config.json``). A ``quantization_config``
    is not part of the shape: :func:`load_mla` reads it (:func:`~piecegraph.models.quant_formats.read_quant`)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face checkpoint directory")
    hf = {k: v for k, v in json.loads(config_file.read_text()).items()
          if k not in ("quantization_config", "compression_config")}
    return MLAConfig.from_hf(hf, max_seq_len=max_seq_len)


def dequantize_checkpoint(tensors: dict[str, torch.Tensor], quant: CheckpointQuant, dtype: torch.dtype
                          ) -> dict[str, torch.Tensor]:
    """``tensors`` of a ``quant`` checkpoint with each quantized weight dequantized (float32 products, one weight
    at a time) and cast to ``dtype`` (routers' and the indexer's ``weights_proj`` kept float32), and every scale
    dropped; other tensors unchanged. Raises ``ValueError`` naming a weight whose scale does not fit it, or an
    e4m3 weight without a scale."""
    out = {}
    for name in quantized_names(tensors):
        try:
            w = dequant_weight(name, tensors, quant)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        out[name] = w if name.endswith(_FLOAT32_WEIGHTS) else w.to(dtype)
    out = {n: out.get(n, t) for n, t in tensors.items() if not is_aux(n)}
    unscaled = sorted(n for n, t in out.items() if t.dtype == FP8)
    if unscaled:
        raise ValueError(f"{_names(unscaled)}: float8_e4m3fn weights without a weight_scale_inv / weight_scale; "
                         f"the {quant.label} checkpoint is incomplete")
    return out


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint expert weights (``mlp.experts.{j}.gate_proj/up_proj/down_proj.weight``, as DeepSeek and GLM
    publish them and transformers saves them) as the stacked ``experts.gate_up_proj [E, 2W, H]`` (gate rows,
    then up) and ``experts.down_proj [E, H, W]``; other names unchanged. Consumes ``tensors``."""
    per_expert: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            per_expert.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, experts in per_expert.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))) or any(len(experts[j]) != 3 for j in ids):
            raise ValueError(f"{prefix}: expert weights are incomplete (experts {ids[:_SHOW]}...; each needs "
                             "gate_proj, up_proj and down_proj)")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[j]["gate_proj"], experts[j]["up_proj"]])
                                                     for j in ids])
        out[f"{prefix}.down_proj"] = torch.stack([experts[j]["down_proj"] for j in ids])
    return out


def load_mla(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
             max_seq_len: int | None = None) -> MLADecoder:
    """An :class:`MLADecoder` from the local Hugging Face folder ``path``, in eval mode.

    ``dtype`` defaults to the checkpoint's (its embeddings'); routers' weights and score-correction biases and
    the indexer's ``weights_proj`` stay float32, as transformers keeps them. Layers beyond
    ``num_hidden_layers`` (multi-token-prediction layers, ``num_nextn_predict_layers``) are skipped with a
    one-line note: greedy generation does not use them.

    A quantized checkpoint (:mod:`piecegraph.models.quant_formats`: DeepSeek-V3's and GLM-5-FP8's block-scaled
    e4m3 with ``weight_scale_inv``, compressed-tensors FP8, NVFP4) is dequantized at load, on every device, into
    ``dtype`` (default: the embeddings'), with one log line saying so: the MLA decoder keeps no
    FP8 block weights (``quantize_fp8`` / ``--quant fp8`` re-quantizes its experts and projections per tensor).
    Raises ``FileNotFoundError`` naming a missing file,
    ``ValueError`` for an unsupported config (see :meth:`MLAConfig.from_hf`) or listing missing, unexpected or
    mis-shaped weights.
    """
    path = Path(path)
    config = read_mla_config(path, max_seq_len)
    tensors = dict(_read_tensors(_shard_files(path), "cpu"))
    extra = sorted({int(m.group(1)) for n in tensors
                    if (m := _LAYER.match(n)) and int(m.group(1)) >= config.num_layers})
    if extra:
        log.warning("piecegraph: skipping layers %s of %s (multi-token-prediction layers beyond num_hidden_layers="
                    "%d; greedy decoding does not use them)", extra, path, config.num_layers)
        tensors = {n: t for n, t in tensors.items() if not ((m := _LAYER.match(n)) and int(m.group(1)) in extra)}
    tensors = {n: t for n, t in tensors.items() if not n.endswith("rotary_emb.inv_freq")}
    embed = tensors.get("model.embed_tokens.weight")
    model_dtype, quant = dtype or (embed.dtype if embed is not None else float_dtype(tensors)), read_quant(path)
    if quant is not None:
        tensors = dequantize_checkpoint(tensors, quant, model_dtype)
        (log.warning if torch.device(device).type == "cuda" else log.info)(
            "piecegraph: %s: checkpoint %s dequantized to %s at load (the MLA decoder keeps no FP8 block weights; "
            "--quant fp8 re-quantizes its experts and projections per tensor)", path, quant.label, model_dtype)
    tensors = stack_experts(tensors)
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = MLADecoder(config)
    expected = {n: t for n, t in model.state_dict().items() if not (config.tie_embeddings and n == "lm_head.weight")}
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        raise ValueError(f"weights in {path} do not match the {config.num_layers}-layer {config.model_type} decoder "
                         f"its config.json describes: missing [{_names(missing)}]; unexpected [{_names(unexpected)}]")
    bad = sorted(n for n, t in expected.items() if tuple(t.shape) != tuple(tensors[n].shape))
    if bad:
        detail = "; ".join(f"{n}: file {tuple(tensors[n].shape)} vs model {tuple(expected[n].shape)}"
                           for n in bad[:_SHOW])
        raise ValueError(f"weight shapes in {path} do not match its config.json: {detail}")
    model = model.to(model_dtype).to_empty(device=device)  # routers and indexer weights: float32 (their _apply)
    if config.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name in tensors:
                t.copy_(tensors[name])
    return model.eval()
