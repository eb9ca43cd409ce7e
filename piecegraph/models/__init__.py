"""Reference Qwen2/Llama decoder over flat tokens: paged KV cache, per-step metadata, attention backends, the
attention split op, loader and greedy generation.

Importing this package registers ``torch.ops.piecegraph_models.attention`` and declares it a split op.
"""

from piecegraph.models import attention as _attention  # noqa: F401  (registers the split op)
from piecegraph.models.config import ATTENTION_BACKENDS, LLAMA_7B_SHAPE, QWEN2_5_0_5B, TINY, ModelConfig
from piecegraph.models.decoder import Decoder
from piecegraph.models.generate import dummy_inputs, generate
from piecegraph.models.kv_cache import DEFAULT_PAGE_SIZE, SCRATCH_PAGE, KVCache, OutOfPagesError
from piecegraph.models.loader import load_hf, read_config, save_hf
from piecegraph.models.metadata import AttentionMetadata, BatchLayout, dummy

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMetadata",
    "BatchLayout",
    "DEFAULT_PAGE_SIZE",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "OutOfPagesError",
    "LLAMA_7B_SHAPE",
    "QWEN2_5_0_5B",
    "SCRATCH_PAGE",
    "TINY",
    "dummy",
    "dummy_inputs",
    "generate",
    "load_hf",
    "read_config",
    "save_hf",
]
