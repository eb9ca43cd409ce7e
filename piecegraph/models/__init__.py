"""Reference Qwen2/Llama decoder over flat tokens, its attention split op, loader and greedy generation.

Importing this package registers ``torch.ops.piecegraph_models.attention`` and declares it a split op.
"""

from piecegraph.models.attention import SCRATCH_SLOT, AttentionMetadata, KVCache, dummy
from piecegraph.models.config import QWEN2_5_0_5B, TINY, ModelConfig
from piecegraph.models.decoder import Decoder
from piecegraph.models.generate import dummy_inputs, generate
from piecegraph.models.loader import load_hf, read_config, save_hf

__all__ = [
    "AttentionMetadata",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "QWEN2_5_0_5B",
    "SCRATCH_SLOT",
    "TINY",
    "dummy",
    "dummy_inputs",
    "generate",
    "load_hf",
    "read_config",
    "save_hf",
]
