"""Load and save the reference decoder in the Hugging Face layout (config.json + safetensors), local only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from piecegraph.models.config import ModelConfig
from piecegraph.models.decoder import Decoder
from piecegraph.models.fuse import FUSED_GROUPS
from piecegraph.models.quant_formats import float_dtype, install, prepare, read_quant, vacate

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_SHOW = 8  # weight names listed in an error before "... and N more"


def _names(names: set[str]) -> str:
    shown = sorted(names)[:_SHOW]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f", ... and {more} more" if more else "")


def _shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, single file or sharded by an index."""
    if (path / _SINGLE).is_file():
        return [path / _SINGLE]
    index = path / _INDEX
    if not index.is_file():
        raise FileNotFoundError(
            f"{path} has no {_SINGLE} and no {_INDEX}: expected a Hugging Face checkpoint directory "
            "(download it first; load_hf never reaches the hub)"
        )
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    missing = [name for name in shards if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{index} names shard files missing from {path}: {', '.join(missing)}")
    return [path / name for name in shards]


def _read_tensors(files: list[Path], device: str) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device=device) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def read_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint directory ``path`` (from its ``config.json``)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face checkpoint directory")
    return ModelConfig.from_hf(json.loads(config_file.read_text()))


def load_hf(path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> Decoder:
    """A :class:`Decoder` from the local Hugging Face directory ``path``, in eval mode.

    ``path`` holds ``config.json`` and ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
    ``dtype`` defaults to the checkpoint's own dtype. A tied checkpoint may omit ``lm_head.weight``. A quantized
    checkpoint (:mod:`piecegraph.models.quant_formats`: block-scaled FP8, compressed-tensors FP8, NVFP4) keeps its
    FP8 weights on an sm89+ GPU (NVFP4 converted to FP8 blocks) and is dequantized elsewhere. Raises
    ``FileNotFoundError`` naming the path and the missing file, or ``ValueError`` listing missing and
    unexpected weight names or mismatched shapes.
    """
    path = Path(path)
    config = read_config(path)
    tensors = dict(_read_tensors(_shard_files(path), "cpu"))
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store it anyway; it is the embedding
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
        del tensors[name]  # older checkpoints saved RoPE's buffer; we derive it from the config
    model_dtype, quant, quantized = dtype or float_dtype(tensors), read_quant(path), {}
    if quant is not None:  # dequantized here, or set aside for the FP8 linears installed below
        tensors, quantized = prepare(tensors, quant, device)
    with torch.device("meta"):
        model = Decoder(config)
    vacate(model, quantized)
    expected = {name: p for name, p in model.named_parameters()}  # tied lm_head appears once, as the embedding
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if unexpected and all(n.endswith("o_proj.bias") for n in unexpected):
        raise ValueError(f"{path} has o_proj biases (Llama's attention_bias=true biases o_proj too), which the "
                         "reference decoder does not have; load it with piecegraph.hf.load instead")
    if missing or unexpected:
        raise ValueError(
            f"weights in {path} do not match the {config.num_layers}-layer decoder its config.json describes: "
            f"missing [{_names(missing)}]; unexpected [{_names(unexpected)}]"
        )
    bad = {n for n, p in expected.items() if tuple(p.shape) != tuple(tensors[n].shape)}
    if bad:
        detail = "; ".join(f"{n}: file {tuple(tensors[n].shape)} vs model {tuple(expected[n].shape)}"
                           for n in sorted(bad)[:_SHOW])
        raise ValueError(f"weight shapes in {path} do not match its config.json: {detail}")
    model = model.to(model_dtype).to_empty(device=device)  # cast on meta: no float32 copy of a bf16 model
    if config.tie_embeddings:  # to_empty made a new Parameter per module: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(tensors[name])
    if quant is not None:
        install(model, quantized, quant, device, model_dtype)
    return model.eval()


def save_hf(model: Decoder, path: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``model`` into ``path`` (created if needed).

    A tied ``lm_head.weight`` is omitted, as Hugging Face does. A model fused by
    :func:`~piecegraph.models.fuse_projections` is written unfused (``qkv_proj`` split back into ``q_proj``,
    ``k_proj``, ``v_proj`` and ``gate_up_proj`` into ``gate_proj``, ``up_proj`` by the recorded sizes): the folder is
    what the unfused model writes. Tensors are copied to the CPU; the model is not changed. Raises ``ValueError`` for
    FP8 weights (save before :func:`~piecegraph.models.quantize_fp8`) and for weights whose names or shapes differ
    from the decoder ``model.config`` describes (e.g. tensor-parallel shards). Returns ``path``.
    """
    path = Path(path)
    state = {name: t.detach() for name, t in model.state_dict().items()}
    fp8 = sorted(name for name, t in state.items() if t.dtype.itemsize == 1 and t.is_floating_point())
    if fp8:
        raise ValueError(f"save_hf writes float weights, but the model has FP8 ones ({_names(set(fp8))}): call "
                         "save_hf before quantize_fp8, on the float model")
    state = _unfuse(model, state)
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage, and HF omits it anyway
    _check_layout(state, model.config)
    state = {name: t.contiguous().cpu() for name, t in state.items()}
    config = model.config.to_hf()
    config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(path / _SINGLE), metadata={"format": "pt"})
    return path


def _unfuse(model: Decoder, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every fused projection of ``model`` split back into its parts' Hugging Face names."""
    for prefix, module in model.named_modules():
        for _, names, fused_name, sizes_name, _ in FUSED_GROUPS:
            sizes = getattr(module, sizes_name, None)
            if sizes is None or getattr(module, fused_name, None) is None:
                continue
            base = f"{prefix}." if prefix else ""
            for kind in ("weight", "bias"):
                fused = state.pop(f"{base}{fused_name}.{kind}", None)
                if fused is not None:
                    # own CPU copies: views would share the fused storage, which safetensors refuses
                    state.update({f"{base}{name}.{kind}": part.to("cpu", copy=True)
                                  for name, part in zip(names, fused.split(list(sizes)))})
    return state


def _check_layout(state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Refuse weights that :func:`load_hf` (and transformers) would not read back as the decoder of ``config``."""
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in Decoder(config).state_dict().items()}
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    bad = {n for n in set(expected) & set(state) if tuple(state[n].shape) != expected[n]}
    if missing or unexpected or bad:
        raise ValueError(
            f"save_hf: the model's weights do not match the {config.num_layers}-layer decoder its config describes "
            f"(tensor-parallel shards or a changed module?): missing [{_names(missing)}]; unexpected "
            f"[{_names(unexpected)}]; other shapes [{_names(bad)}]; save the unsharded reference decoder"
        )
