"""Helpers shared by the CLI commands: device choice, model loading and ``--tp``."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import typer

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """``--device``: ``auto`` (CUDA when torch sees it, else the CPU), ``cpu`` or ``cuda``; anything else is a usage
    error naming the option and what it accepts (a GPU is chosen with CUDA_VISIBLE_DEVICES, not ``cuda:1``)."""
    if device not in DEVICES:
        raise typer.BadParameter(f"{device!r} is not one of {', '.join(DEVICES)}", param_hint="--device")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("--device cuda, but torch sees no CUDA device; use --device cpu",
                                 param_hint="--device")
    return device


def check_writable(path: Path | None, flag: str) -> None:
    """Refuse, before any work, an output file that cannot be written (a missing folder, no permission)."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise typer.BadParameter(f"cannot write {path}: the folder {folder} does not exist", param_hint=flag)
    if path.is_dir() or not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise typer.BadParameter(f"cannot write {path}: not a writable file", param_hint=flag)


def resolve_attention(attention: str, device: str) -> str:
    """The attention backend ``--attention`` names on ``device`` (``auto``: FlashInfer on CUDA when it imports)."""
    from piecegraph.attention import ATTENTION_BACKENDS, flashinfer_available

    if attention not in ATTENTION_BACKENDS:
        raise typer.BadParameter(f"{attention!r} is not one of {', '.join(ATTENTION_BACKENDS)}",
                                 param_hint="--attention")
    reason = flashinfer_available(torch.device(device))
    if attention == "flashinfer" and reason:
        raise typer.BadParameter(f"flashinfer cannot run here: {reason}", param_hint="--attention")
    if attention == "auto":
        return "torch" if reason else "flashinfer"
    return attention


def resolve_run_options(device: str, attention: str, outputs: dict[str, Path | None]) -> tuple[str, str]:
    """``(device, attention backend)``: ``--device`` resolved (:func:`resolve_device`), then every output file of
    ``outputs`` (option -> path, ``None`` for not asked) checked writable, then ``--attention`` resolved on that
    device (:func:`resolve_attention`); each refusal is a usage error naming its option, raised before any work."""
    device = resolve_device(device)
    for flag, path in outputs.items():
        check_writable(path, flag)
    return device, resolve_attention(attention, device)


PRESETS = ("tiny", "qwen2.5-0.5b", "llama-3.2-1b", "llama-7b-shape", "tiny-moe", "qwen1.5-moe-a2.7b", "tiny-mla",
           "deepseek-v3-shape", "glm5-shape", "glm5-shape-dense")
QUANTS = ("bf16", "fp8")
MODEL_HELP = " | ".join(PRESETS) + " | PATH (auto: tiny on CPU, 0.5B shape on GPU)"  # --model of every command


def default_model(model: str, device: str) -> str:
    """``--model`` as given, or for ``auto`` the preset :data:`MODEL_HELP` names: the 0.5B shape on CUDA, tiny
    elsewhere."""
    if model != "auto":
        return model
    return "qwen2.5-0.5b" if device == "cuda" else "tiny"


def load_model(model: str, device: str, dtype: torch.dtype, hf: bool = False, quant: str = "bf16",
               optimize: bool = True):
    """A preset of :data:`PRESETS` (random reference decoders, dense, MoE or MLA) or a local checkpoint directory:
    the reference decoder for Qwen2/Llama, the MLA decoder for DeepSeek-V2/V3/V3.2 and GLM-5 (``glm_moe_dsa``), unless
    ``hf`` (``--hf``) or another model type asks for the Hugging Face model itself through :mod:`piecegraph.hf`.
    ``quant="fp8"``: the reference decoder's projections, MLPs and experts in e4m3
    (:func:`piecegraph.models.quantize_fp8`; FlashInfer's kernels on sm90, torch elsewhere). ``optimize``: the
    reference decoders' q/k/v and gate/up projections fused into one GEMM each
    (:func:`piecegraph.models.fuse_projections`, before quantizing), and on CUDA in bf16/fp16 the remaining plain
    linears run steps of at most 16 rows on a Triton GEMV-shaped kernel where it measured faster than cuBLAS
    (:func:`piecegraph.models.gemv.use_small_batch_kernels`; ``PIECEGRAPH_SMALL_LINEAR=cublas`` forces cuBLAS).
    Pass ``optimize=run.solo`` for a model :func:`shard_for_tp` shards: it optimizes after sharding."""
    from piecegraph.models import (
        DEEPSEEK_V3_SHAPE,
        GLM5_SHAPE,
        LLAMA_3_2_1B_SHAPE,
        LLAMA_7B_SHAPE,
        QWEN1_5_MOE_A2_7B,
        QWEN2_5_0_5B,
        TINY,
        TINY_MLA,
        TINY_MOE,
        Decoder,
        MLAConfig,
        MLADecoder,
        MoEDecoder,
        fuse_projections,
        is_mla_folder,
        load_hf,
        load_mla,
        quantize_fp8,
    )
    from piecegraph.models.gemv import use_small_batch_kernels

    if quant not in QUANTS:
        raise typer.BadParameter(f"{quant!r} is not one of {', '.join(QUANTS)}", param_hint="--quant")
    presets = {"tiny": TINY, "qwen2.5-0.5b": QWEN2_5_0_5B, "llama-3.2-1b": LLAMA_3_2_1B_SHAPE,
               "llama-7b-shape": LLAMA_7B_SHAPE, "tiny-moe": TINY_MOE,
               "qwen1.5-moe-a2.7b": QWEN1_5_MOE_A2_7B, "tiny-mla": TINY_MLA,
               "deepseek-v3-shape": DEEPSEEK_V3_SHAPE, "glm5-shape": GLM5_SHAPE,
               # GLM-5's shape without its DSA indexer: dense MLA, what sparse attention is measured against
               "glm5-shape-dense": GLM5_SHAPE.replace(index_n_heads=0, index_head_dim=0, index_topk=0)}
    if model in presets:
        cls = MoEDecoder if model.endswith("moe") or "-moe-" in model else Decoder
        cls = MLADecoder if isinstance(presets[model], MLAConfig) else cls
        net = cls.random(presets[model], seed=0, dtype=dtype, device=device).eval()
    elif Path(model).is_dir() and not hf and is_mla_folder(model):  # DeepSeek-V2/V3, GLM-5: the MLA decoder
        try:
            net = load_mla(model, dtype=dtype, device=device)
        except (FileNotFoundError, ValueError) as err:
            raise typer.BadParameter(str(err).splitlines()[0], param_hint="--model") from None
    elif Path(model).is_dir() and (hf or _needs_transformers(model)):
        if quant != "bf16":
            raise typer.BadParameter("--quant fp8 is for the reference decoders, not the Hugging Face model",
                                     param_hint="--quant")
        return _load_transformers(model, device, dtype)
    elif hf:
        raise typer.BadParameter(f"{model!r} is not a local Hugging Face directory (--hf never downloads)",
                                 param_hint="--hf")
    elif Path(model).is_dir():
        try:
            net = load_hf(model, dtype=dtype, device=device).eval()
        except (FileNotFoundError, ValueError) as err:  # not a checkpoint, or one we cannot read: say which
            raise typer.BadParameter(str(err).splitlines()[0], param_hint="--model") from None
    else:
        raise typer.BadParameter(f"{model!r} is not one of {', '.join(PRESETS)} or a local Hugging Face directory",
                                 param_hint="--model")
    if optimize:
        net = fuse_projections(net)
    if quant == "fp8":
        net = quantize_fp8(net)
    return use_small_batch_kernels(net) if optimize else net


def _needs_transformers(path: str) -> bool:
    """A checkpoint whose model type the reference decoder does not implement (Mistral, Gemma, MoE, ...)."""
    from piecegraph.hf.load import read_model_type

    kind = read_model_type(path)
    return kind is not None and kind not in ("qwen2", "llama")


def _load_transformers(path: str, device: str, dtype: torch.dtype):
    from piecegraph.hf import load

    try:
        return load(path, dtype=dtype, device=device)
    except (FileNotFoundError, ValueError, ImportError, OSError) as err:
        raise typer.BadParameter(str(err).splitlines()[0], param_hint="--model") from None


def int_list(text: str, option: str) -> list[int]:
    """``"1,10,256"`` -> ``[1, 10, 256]`` (``""`` -> ``[]``); anything else is a usage error naming ``option``."""
    # One short message for both mistakes: it fits on one line of an 80-column terminal after typer's prefix.
    wrong = typer.BadParameter(f"{text!r}: expected positive ints like 1,10,256", param_hint=option)
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise wrong from None
    if any(v < 1 for v in values):
        raise wrong
    return values


def start_tp(tp: int, device: str) -> Any:
    """``--tp``: this process's :class:`~piecegraph.parallel.launch.TPRun` (``SINGLE`` for 1). Otherwise,
    outside torchrun, run this command again as ``tp`` ranks under torchrun and exit with its code; inside it,
    join the group as one rank. Call before loading the model."""
    from piecegraph.parallel.launch import SINGLE, init_tp, needs_relaunch, relaunch

    if tp <= 1:
        return SINGLE

    try:
        again = needs_relaunch(tp)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--tp") from None
    if again:
        raise typer.Exit(relaunch(tp, sys.argv[1:]))
    try:
        return init_tp(tp, device)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--tp") from None


def shard_for_tp(net: torch.nn.Module, run: Any) -> torch.nn.Module:
    """``net`` sharded over the ``--tp`` group (all-reduce inside the pieces), then optimized as
    :func:`load_model`'s ``optimize`` does (each shard's projections fused, small-batch kernels), or ``net`` when
    ``run`` is solo. ``net`` must not be optimized yet (``load_model(..., optimize=run.solo)``)."""
    if run.solo:
        return net
    from piecegraph.models import fuse_projections
    from piecegraph.models.fuse import FUSED_GROUPS
    from piecegraph.models.gemv import SmallBatchLinear, use_small_batch_kernels
    from piecegraph.parallel import apply_tp
    from piecegraph.parallel.launch import GROUP

    if any(isinstance(m, SmallBatchLinear) or any(isinstance(m, cls) and hasattr(m, fused)
                                                  for cls, _, fused, _, _ in FUSED_GROUPS)
           for m in net.modules()):
        raise ValueError("shard_for_tp shards the unfused q/k/v and gate/up projections: load the model with "
                         "load_model(..., optimize=run.solo); the shards are optimized here, after sharding")
    try:
        net = apply_tp(net, GROUP)
    except (TypeError, ValueError) as err:
        raise typer.BadParameter(str(err), param_hint="--tp") from None
    return use_small_batch_kernels(fuse_projections(net))  # each rank's shards: one GEMM each for q/k/v, gate/up
