"""Attention backends behind the one split op: ``torch`` (vectorized SDPA, CPU and GPU) and ``flashinfer``.

A backend plans a step on the host (:meth:`AttentionBackend.plan`, once per step for all layers), writes the new
tokens' k and v into the paged cache and attends (:meth:`AttentionBackend.forward`, inside the split op), and
says what a full CUDA graph of a decode step captures (:meth:`AttentionBackend.for_cuda_graph`). A multi-head
latent attention cache (``config.mla``) gets an MLA backend (``torch_mla``, ``flashinfer_mla``), which also has
``mla_forward`` for the ``mla_attention`` op and refuses the ordinary one.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch

from piecegraph.attention.types import ATTENTION_BACKENDS, CacheShape, is_mla, v_head_dim

if TYPE_CHECKING:
    from piecegraph.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """What the attention op needs from a backend. ``name`` is recorded by the benchmark."""

    name: str
    reads_page_table: bool  # whether decode steps need AttentionMetadata.page_table (a dense host-built table)

    def plan(self, meta: "AttentionMetadata") -> None:
        """Fill ``meta``'s backend fields for its step (host work; may copy to the device, never syncs)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, layer: int,
                meta: "AttentionMetadata", **constants: Any) -> None:
        """Write ``k`` ``[n, Hkv, D]`` and ``v`` ``[n, Hkv, Dv]`` (``Dv``: the cache's ``v_head_dim``, usually
        ``D``) into the cache at ``meta.slot_mapping``, attend with ``q`` ``[n, H, D]`` (causal by position), and
        fill ``out`` ``[n, H, Dv]``. ``n = meta.num_tokens``.

        ``constants`` are passed only when a layer needs them (Hugging Face models): ``scale`` (else
        ``head_dim ** -0.5``), ``window`` (sliding window), ``softcap`` (tanh logit cap), ``sinks`` (one softmax
        logit per query head), ``alibi_slopes`` (ALiBi: one slope per query head). A backend that cannot
        honour one raises ``ValueError`` saying so, never attends without it."""

    def for_cuda_graph(self, meta: "AttentionMetadata", size: int) -> "AttentionMetadata":
        """The decode metadata a full graph of ``size`` rows reads (``meta`` itself if zero padding is enough)."""


def flashinfer_available(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why FlashInfer cannot run attention on ``device`` in ``dtype``, or ``None`` when it can."""
    if device.type != "cuda":
        return f"FlashInfer runs on CUDA only; the cache is on {device}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashInfer attention runs in float16 or bfloat16; the cache is {dtype}"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (pip install piecegraph[flashinfer])"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # a broken install (missing tvm-ffi, CUDA mismatch) is a reason, not a crash
        return f"flashinfer does not import: {type(exc).__name__}: {exc}"
    return None


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, config: CacheShape) -> Any:
    """The backend instance for ``name`` (``auto``: FlashInfer when it imports on CUDA for a float16/bfloat16
    cache, else torch). An explicit ``"flashinfer"`` that cannot run raises, saying why. A multi-head latent
    attention shape (``config.mla``) gets an MLA backend: see :func:`resolve_mla_backend`."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {ATTENTION_BACKENDS}")
    if is_mla(config):
        return resolve_mla_backend(name, device, dtype, config)
    reason = flashinfer_available(device, dtype)
    if name == "flashinfer" and reason:
        raise ValueError(f"attention_backend='flashinfer': {reason}; use attention_backend='torch'")
    if name == "flashinfer" or (name == "auto" and reason is None):
        from piecegraph.attention.backends.flashinfer import FlashInferBackend

        return FlashInferBackend(config, device)
    from piecegraph.attention.backends.torch_sdpa import TorchBackend

    return TorchBackend(config)


# FlashInfer 0.5.3's MLA kernels are built and tested for DeepSeek's latent dims only (tests/attention/
# test_deepseek_mla.py: head_dim_ckv 512, head_dim_kpe 64); other dims JIT-compile but are unverified.
FLASHINFER_MLA_DIMS = ((512, 64),)


def flashinfer_mla_available(device: torch.device, dtype: torch.dtype, config: CacheShape) -> str | None:
    """Why FlashInfer's MLA kernel (``BatchMLAPagedAttentionWrapper``) cannot run this cache, or ``None``."""
    reason = flashinfer_available(device, dtype)
    if reason:
        return reason
    dims = (config.head_dim, v_head_dim(config))
    if dims not in FLASHINFER_MLA_DIMS:
        return (f"FlashInfer's MLA kernel runs latent/rotary dims {FLASHINFER_MLA_DIMS} only; this model has "
                f"kv_lora_rank {dims[0]} and qk_rope_head_dim {dims[1]}")
    try:
        import flashinfer.mla  # noqa: F401
    except Exception as exc:  # an older FlashInfer without the module is a reason, not a crash
        return f"flashinfer.mla does not import: {type(exc).__name__}: {exc}"
    return None


def resolve_mla_backend(name: str, device: torch.device, dtype: torch.dtype, config: CacheShape) -> Any:
    """The MLA backend for ``name``: FlashInfer's MLA kernel where it can run (``auto`` on CUDA, or
    ``"flashinfer"``), else the torch one. Asking for ``"flashinfer"`` where its MLA kernel cannot run falls
    back to torch with a warning naming the reason (the FlashInfer backend itself runs DSA layers on the torch
    path and says so once)."""
    from piecegraph.attention.backends.torch_mla import TorchMLABackend

    if name == "torch":
        return TorchMLABackend(config)
    reason = flashinfer_mla_available(device, dtype, config)
    if reason is None:
        from piecegraph.attention.backends.flashinfer_mla import FlashInferMLABackend

        return FlashInferMLABackend(config, device)
    if name == "flashinfer" or device.type == "cuda":
        warnings.warn(f"multi-head latent attention runs on the torch backend, not FlashInfer: {reason}",
                      stacklevel=3)
    return TorchMLABackend(config)
