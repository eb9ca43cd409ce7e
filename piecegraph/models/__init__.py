"""Reference Qwen2/Llama decoder over flat tokens: config and presets, the decoder, loader and greedy generation.

Its attention is :mod:`piecegraph.attention`'s split op on the paged KV cache (imported with the decoder).
"""

from piecegraph.models.config import LLAMA_7B_SHAPE, QWEN2_5_0_5B, TINY, ModelConfig
from piecegraph.models.decoder import Decoder
from piecegraph.models.generate import dummy_inputs, generate
from piecegraph.models.loader import load_hf, read_config, save_hf

__all__ = [
    "Decoder",
    "ModelConfig",
    "LLAMA_7B_SHAPE",
    "QWEN2_5_0_5B",
    "TINY",
    "dummy_inputs",
    "generate",
    "load_hf",
    "read_config",
    "save_hf",
]
