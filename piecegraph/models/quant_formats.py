"""The quantized checkpoint formats people download, read from ``config.json``, and their dequantization.

Three formats (:func:`read_quant` says which one a checkpoint directory holds):

- ``fp8-block``: ``quant_method: "fp8"`` with ``weight_block_size [bn, bk]`` (DeepSeek-V3, Qwen3-*-FP8,
  GLM-4.5-FP8): each quantized ``X.weight`` is e4m3 ``[N, K]`` beside a float32 ``X.weight_scale_inv`` of shape
  ``[ceil(N/bn), ceil(K/bk)]``; ``w = q * scale_inv[i // bn, j // bk]`` (the edge blocks of a ragged shape are
  partial, as DeepSeek's ``weight_dequant`` reads them). Without ``weight_block_size``: one scalar scale
  (``fp8-tensor``). Activations: dynamic, per token and 1 x ``bk`` group.
- ``fp8-channel`` / ``fp8-tensor`` (compressed-tensors ``float-quantized``, RedHat/neuralmagic; ModelOpt ``FP8``):
  e4m3 ``X.weight`` beside ``X.weight_scale`` of shape ``[N, 1]`` (channel) or ``[1]``/``[]`` (tensor);
  ``w = q * weight_scale``. Activations: dynamic per token, or static ``X.input_scale``.
- ``nvfp4`` (ModelOpt ``quant_algo: NVFP4``): ``X.weight`` uint8 ``[N, K/2]``, two e2m1 codes a byte (the even
  element in the low nibble), ``X.weight_scale`` e4m3 ``[N, K/16]`` and the float32 scalar ``X.weight_scale_2``;
  ``w = e2m1 * (weight_scale * weight_scale_2)``. ``X.input_scale`` is the activations' static global scale.

Dequantization is exact float32 arithmetic on the stored values (one rounding per product, as transformers'
``Fp8Dequantize`` and DeepSeek's reference compute it); the caller casts to the model's dtype. Activation and KV
scales (``input_scale``, ``activation_scale``, ``k_scale``, ``v_scale``) have no meaning for a dequantized model
and are dropped.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

_log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the 3 low bits of an e2m1 code; bit 3 is the sign
_AUX = ("input_scale", "activation_scale", "k_scale", "v_scale", "input_global_scale")
_SCALES = ("weight_scale_inv", "weight_scale", "weight_scale_2")


class UnsupportedQuantization(ValueError):
    """A ``quantization_config`` piecegraph cannot read; the message names it and the supported formats."""


@dataclass(frozen=True)
class CheckpointQuant:
    """A checkpoint's quantization as its config states it.

    ``method``: ``"fp8-block"``, ``"fp8-channel"``, ``"fp8-tensor"`` or ``"nvfp4"``. ``block``: the weight scale's
    block ``(rows, cols)`` for ``fp8-block``, ``None`` otherwise. ``group``: elements per NVFP4 scale (16).
    ``producer``: the config's ``quant_method`` (``fp8``, ``compressed-tensors``, ``modelopt``). ``activations``:
    how the checkpoint quantizes activations (``dynamic`` or ``static``). ``skipped``: module names or patterns the
    config keeps unquantized (they carry no scale, which is how the loader tells them apart anyway)."""

    method: str
    producer: str
    block: tuple[int, int] | None = None
    group: int = 0
    activations: str = "dynamic"
    skipped: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """``"fp8 (block 128x128)"``, ``"fp8 (per-channel, compressed-tensors)"``, ``"nvfp4 (modelopt, group
        16)"``: what the start-up banner calls the checkpoint."""
        if self.method == "fp8-block":
            return f"fp8 (block {self.block[0]}x{self.block[1]})"
        if self.method == "nvfp4":
            return f"nvfp4 ({self.producer}, group {self.group})"
        kind = "per-channel" if self.method == "fp8-channel" else "per-tensor"
        return f"fp8 ({kind}, {self.producer})"


def _fp8_from_transformers(qc: dict[str, Any]) -> CheckpointQuant:
    block = qc.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) <= 0):
        raise UnsupportedQuantization(f"quantization_config.weight_block_size must be two positive ints, got {block}")
    return CheckpointQuant("fp8-block" if block else "fp8-tensor", "fp8", tuple(block) if block else None,
                           activations=qc.get("activation_scheme", "dynamic"),
                           skipped=tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()))


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    schemes = {json.dumps([g.get("weights"), g.get("input_activations")], sort_keys=True) for g in groups}
    weights = (groups[0].get("weights") or {}) if groups else {}
    acts = (groups[0].get("input_activations") or {}) if groups else {}
    fp8 = weights.get("num_bits") == 8 and weights.get("type") == "float"
    if fmt != "float-quantized" or len(schemes) != 1 or not fp8:
        raise UnsupportedQuantization(
            f"compressed-tensors checkpoint with format {fmt!r} and weights {weights or groups}: piecegraph reads "
            "its FP8 'float-quantized' form (8-bit float weights, one scheme for every group) only")
    strategy = weights.get("strategy")
    skipped = tuple(qc.get("ignore") or ())
    activations = "dynamic" if not acts or acts.get("dynamic", True) else "static"
    if strategy == "block":
        block = tuple(weights.get("block_structure") or ())
        if len(block) != 2:
            raise UnsupportedQuantization(f"compressed-tensors block strategy without a block_structure: {weights}")
        return CheckpointQuant("fp8-block", "compressed-tensors", block, activations=activations, skipped=skipped)
    if strategy not in ("channel", "tensor"):
        raise UnsupportedQuantization(f"compressed-tensors FP8 weight strategy {strategy!r}: piecegraph reads "
                                      "channel, tensor and block")
    return CheckpointQuant(f"fp8-{strategy}", "compressed-tensors", activations=activations, skipped=skipped)


def _modelopt(qc: dict[str, Any]) -> CheckpointQuant:
    algo = str(qc.get("quant_algo", "")).upper()
    skipped = tuple(qc.get("exclude_modules") or qc.get("ignore") or ())
    if algo == "NVFP4":
        return CheckpointQuant("nvfp4", "modelopt", group=int(qc.get("group_size") or 16), activations="static",
                               skipped=skipped)
    if algo == "FP8":
        return CheckpointQuant("fp8-tensor", "modelopt", activations="static", skipped=skipped)
    raise UnsupportedQuantization(f"ModelOpt quant_algo {algo or None!r}: piecegraph reads NVFP4 and FP8")


def detect(config: dict[str, Any], hf_quant_config: dict[str, Any] | None = None) -> CheckpointQuant | None:
    """The :class:`CheckpointQuant` that ``config`` (a parsed ``config.json``) declares in its
    ``quantization_config`` (or ``compression_config``, compressed-tensors' older name), else the ModelOpt
    ``hf_quant_config`` (``hf_quant_config.json``'s ``quantization`` section); ``None`` for a plain checkpoint.
    Raises :class:`UnsupportedQuantization` naming any other method or variant."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if qc is None and hf_quant_config is not None:
        qc = {"quant_method": "modelopt", **(hf_quant_config.get("quantization") or hf_quant_config)}
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "gguf":  # transformers dequantizes a GGUF file as it reads it: a folder it saved holds float weights
        return None
    if method == "fp8":
        return _fp8_from_transformers(qc)
    if method == "compressed-tensors" or (method is None and "config_groups" in qc and "quant_algo" not in qc):
        return _compressed_tensors(qc)
    if method == "modelopt" or "quant_algo" in qc:
        return _modelopt(qc)
    raise UnsupportedQuantization(
        f"quantization_config.quant_method {method!r}: piecegraph reads 'fp8' (block-scaled), 'compressed-tensors' "
        "(FP8) and 'modelopt' (NVFP4, FP8) checkpoints")


def read_quant(path: str | Path) -> CheckpointQuant | None:
    """:func:`detect` on the checkpoint directory ``path`` (its ``config.json``, and ``hf_quant_config.json`` when
    ModelOpt wrote one); ``None`` when there is no ``config.json`` or it declares no quantization."""
    path = Path(path)
    if not (path / "config.json").is_file():
        return None
    extra = path / "hf_quant_config.json"
    return detect(json.loads((path / "config.json").read_text()),
                  json.loads(extra.read_text()) if extra.is_file() else None)


def dequant_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 ``q * scale_inv`` with each scale covering a ``block`` of ``q`` ``[..., N, K]`` (``scale_inv``
    ``[..., ceil(N/bn), ceil(K/bk)]``; the last row and column of blocks may be partial). ``block`` ``None`` (a
    checkpoint without ``weight_block_size``): one scalar scale covers everything. A scale whose shape is not the
    block grid's (a scalar where blocks are stated included) is a ``ValueError``, never broadcast."""
    if block is None:
        if scale_inv.numel() != 1:
            raise ValueError(f"a per-tensor FP8 weight of shape {tuple(q.shape)} needs one scale, got "
                             f"{tuple(scale_inv.shape)} (is weight_block_size missing from the config?)")
        return q.float() * scale_inv.float().reshape(())
    (n, k), (bn, bk) = q.shape[-2:], block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ValueError(f"a weight of shape {tuple(q.shape)} in {bn}x{bk} blocks needs a scale of shape "
                         f"[..., {want[0]}, {want[1]}], got {tuple(scale_inv.shape)}")
    s = scale_inv.float().repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    return q.float() * s


def dequant_fp8_scaled(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``q * scale`` for a per-channel ``scale`` ``[N, 1]`` (or ``[N]``) or a per-tensor one (1 element)."""
    s = scale.float()
    if s.numel() == 1:
        return q.float() * s.reshape(())
    if s.numel() != q.shape[-2]:
        raise ValueError(f"a per-channel scale needs one value per output row ({q.shape[-2]}), got "
                         f"{tuple(scale.shape)}")
    return q.float() * s.reshape(*q.shape[:-2], -1, 1)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 ``packed [..., K/2]``, two e2m1 codes a byte, the even element in the low nibble:
    ``[..., K]``."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1).long()
    magnitude = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)[codes & 0x07]
    return torch.where(codes >= 8, -magnitude, magnitude)


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, group: int = 16
                  ) -> torch.Tensor:
    """float32 weights of a ModelOpt NVFP4 linear: ``e2m1 * (scale * scale_2)``, ``scale`` (e4m3) one per ``group``
    elements of a row, ``scale_2`` the float32 global scale."""
    if packed.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"an NVFP4 weight is packed uint8 (two e2m1 a byte), got {packed.dtype}")
    values = unpack_e2m1(packed.view(torch.uint8))
    k = values.shape[-1]
    if scale.shape[-1] * group != k or scale.shape[:-1] != values.shape[:-1]:
        raise ValueError(f"an NVFP4 weight of {tuple(values.shape)} values needs a scale of shape "
                         f"[..., {k // group}] (one per {group}), got {tuple(scale.shape)}")
    block_scale = scale.float() * scale_2.float().reshape(())
    return values * block_scale.repeat_interleave(group, -1)


def dequant_weight(name: str, tensors: dict[str, torch.Tensor], quant: CheckpointQuant) -> torch.Tensor:
    """float32 dequantization of ``tensors[name]`` (a ``.weight``) with its sibling scales in ``tensors``."""
    stem, w = name.removesuffix("weight"), tensors[name]
    if quant.method == "nvfp4":
        return dequant_nvfp4(w, tensors[stem + "weight_scale"], tensors[stem + "weight_scale_2"], quant.group)
    if w.dtype != FP8:
        raise ValueError(f"{name} has a scale but is stored as {w.dtype}, not float8_e4m3fn: not a {quant.label} "
                         "checkpoint piecegraph can read")
    if stem + "weight_scale_inv" in tensors:
        return dequant_fp8_block(w, tensors[stem + "weight_scale_inv"], quant.block)
    scale = tensors[stem + "weight_scale"]
    if quant.method == "fp8-block":  # compressed-tensors' block strategy names its scale weight_scale
        return dequant_fp8_block(w, scale, quant.block)
    return dequant_fp8_scaled(w, scale)


def quantized_names(tensors: dict[str, Any]) -> list[str]:
    """The ``.weight`` names in ``tensors`` that carry a scale (the quantized ones), sorted."""
    return sorted(n for n in tensors if n.endswith(".weight")
                  and any(n.removesuffix("weight") + s in tensors for s in _SCALES))


def is_aux(name: str) -> bool:
    """Whether ``name`` is a scale of a quantized weight or of activations / the KV cache."""
    return name.rsplit(".", 1)[-1] in _SCALES + _AUX


def dequantize_tensors(tensors: dict[str, torch.Tensor], quant: CheckpointQuant) -> dict[str, torch.Tensor]:
    """``tensors`` (a checkpoint's, by name) with every quantized weight replaced by its float32 dequantization and
    every scale dropped; the other tensors are passed through as they are. Raises ``ValueError`` naming a weight
    whose scale does not fit it."""
    out = {n: t for n, t in tensors.items() if not is_aux(n)}
    for name in quantized_names(tensors):
        out[name] = dequant_weight(name, tensors, quant)
    return out


def float_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The checkpoint's own compute dtype: that of its unquantized floating-point tensors (embeddings, norms),
    the first of 16 bits or more; float32 when there is none."""
    for name, t in tensors.items():
        if t.is_floating_point() and t.element_size() >= 2 and not is_aux(name):
            return t.dtype
    return torch.float32


def keeps_fp8(device: torch.device | str) -> bool:
    """Whether a checkpoint's quantized weights stay quantized on ``device``: a CUDA GPU with FP8 tensor cores
    (sm89+). Elsewhere they are dequantized at load."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def engine_form(quant: CheckpointQuant, device: str, transformers: bool = False) -> str:
    """What the engine runs for a ``quant`` checkpoint on ``device`` (``"cpu"`` or ``"cuda"``), loaded by the
    reference loader or, with ``transformers``, by :func:`piecegraph.hf.load`; asks the GPU nothing (the server
    process keeps CUDA uninitialized), so on CUDA it names the rule :func:`keeps_fp8` applies."""
    if device == "cpu":
        return "dequantized on cpu"
    if transformers:
        if quant.producer != "fp8":
            return "dequantized (transformers does not run this format here)"
        return "fp8 block linears (piecegraph's kernels in transformers' model) on sm89+, dequantized on older GPUs"
    if quant.method == "nvfp4":
        form = "fp8 block 128x128 (converted from nvfp4 at load: no FP4 GEMM here)"
    elif quant.method == "fp8-block":
        form = f"fp8 block {quant.block[0]}x{quant.block[1]}"
    else:
        form = "fp8 per-channel"
    return f"{form} on sm89+, dequantized on older GPUs"


def running_note(quant: CheckpointQuant | None, engine: str, dtype: torch.dtype) -> str:
    """The banner's words for a checkpoint of ``quant`` that the engine runs as ``engine`` (:func:`engine_form`)
    in ``dtype``: ``"checkpoint fp8 (block 128x128) -> running bf16 (dequantized on cpu)"``; ``""`` for a plain
    checkpoint."""
    if quant is None:
        return ""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "float32"}.get(dtype, str(dtype))
    if engine.startswith("dequantized"):
        return f"checkpoint {quant.label} -> running {name} ({engine})"
    return f"checkpoint {quant.label} -> running {engine} ({name} activations)"


def prepare(tensors: dict[str, torch.Tensor], quant: CheckpointQuant, device: torch.device | str
            ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """``(plain, quantized)`` for loading ``tensors`` of a ``quant`` checkpoint on ``device``: where
    :func:`keeps_fp8`, ``quantized`` maps each quantized linear's module name to its tensors (``weight``, scales,
    ``bias``), taken out of ``plain``; elsewhere every weight is dequantized into ``plain`` and ``quantized`` is
    empty. Activation and KV scales are dropped either way."""
    if not keeps_fp8(device):
        if torch.device(device).type == "cuda":
            _log.warning("%s checkpoint dequantized at load: this GPU has no FP8 tensor cores (sm89+)", quant.label)
        return dequantize_tensors(tensors, quant), {}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name in quantized_names(tensors):
        stem = name.removesuffix("weight")
        group = {key.removeprefix(stem): t for key, t in tensors.items() if key.startswith(stem)
                 and key.removeprefix(stem) in ("weight", "bias") + _SCALES}
        groups[stem.rstrip(".")] = group
    taken = {stem + "." + key for stem, group in groups.items() for key in group}
    return {n: t for n, t in tensors.items() if n not in taken and not is_aux(n)}, groups


def vacate(model: nn.Module, quantized: dict[str, Any]) -> None:
    """Replace each module named in ``quantized`` by an empty placeholder (before ``to_empty``: no memory is
    allocated for the float weights they replace); :func:`install` fills the places."""
    for name, group in quantized.items():
        parent, _, child = name.rpartition(".")
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} has quantized weights but is a {type(linear).__name__}, not a linear layer "
                             "piecegraph can run in FP8")
        shape = tuple(group["weight"].shape)
        if group["weight"].dtype == torch.uint8:  # NVFP4: two values a byte
            shape = (shape[0], shape[1] * 2)
        if shape != tuple(linear.weight.shape) or (group.get("bias") is None) != (linear.bias is None):
            raise ValueError(f"{name}.weight: file {tuple(group['weight'].shape)} ({group['weight'].dtype}) vs "
                             f"model {tuple(linear.weight.shape)}, bias {'bias' in group} vs "
                             f"{linear.bias is not None}: the checkpoint does not match its config.json")
        setattr(model.get_submodule(parent), child, nn.Identity())


def install(model: nn.Module, quantized: dict[str, dict[str, torch.Tensor]], quant: CheckpointQuant,
            device: torch.device | str, out_dtype: torch.dtype) -> None:
    """Put an FP8 linear for each of ``quantized``'s modules (:func:`prepare`) into ``model`` on ``device``:
    :class:`~piecegraph.models.fp8_block.FP8BlockLinear` for block scales (NVFP4 weights converted to 128x128
    e4m3 blocks first, said once in the log), :class:`~piecegraph.models.fp8_block.FP8ChannelLinear` for channel
    and tensor scales. Outputs in ``out_dtype``."""
    from piecegraph.models.fp8_block import FP8BlockLinear, FP8ChannelLinear, quantize_weight_blocks

    if quant.method == "nvfp4" and quantized:
        _log.warning("nvfp4 checkpoint: this GPU runs no FP4 GEMM here, so its %d quantized linears are converted "
                     "at load to fp8 e4m3 in 128x128 blocks (each weight re-rounded to 3 mantissa bits)",
                     len(quantized))
    for name, t in quantized.items():
        parent, _, child = name.rpartition(".")
        bias = t.get("bias")
        bias = None if bias is None else bias.to(device, out_dtype)
        if quant.method == "nvfp4":
            w = dequant_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"], quant.group)
            q, s = quantize_weight_blocks(w.to(device))
            module = FP8BlockLinear(q, s, (128, 128), bias, out_dtype)
        elif quant.method == "fp8-block":
            scale = t.get("weight_scale_inv", t.get("weight_scale"))
            module = FP8BlockLinear(t["weight"].to(device), scale.to(device), quant.block, bias, out_dtype)
        else:
            scale = t.get("weight_scale_inv", t.get("weight_scale"))
            module = FP8ChannelLinear(t["weight"].to(device), scale.to(device), bias, out_dtype)
        setattr(model.get_submodule(parent), child, module)



def ragged_blocks(files: list[Path], quant: CheckpointQuant) -> list[str]:
    """The block-scaled weights in the safetensors ``files`` with a partial edge block after a full one in some
    dimension (transformers' ``Fp8Dequantize`` reads the block size off the scale grid, ``size // blocks``, and
    gets such weights wrong). Reads the headers only."""
    from safetensors import safe_open

    if quant.method != "fp8-block":
        return []
    ragged = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names = set(f.keys())
            for name in (n for n in names if n.endswith(".weight") and n[:-6] + "weight_scale_inv" in names):
                shape = f.get_slice(name).get_shape()
                if any(size % b and size > b for size, b in zip(shape[-2:], quant.block)):
                    ragged.append(name)  # one partial block alone is read right
    return sorted(ragged)
