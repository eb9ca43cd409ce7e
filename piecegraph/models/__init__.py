"""Reference Qwen2/Llama decoder over flat tokens: config and presets, the decoder, loader and greedy generation;
beside it a mixture-of-experts decoder (``MoEDecoder``, ``MoEConfig``) on the same attention, and FP8 (e4m3) forms of
both (``quantize_fp8``). Each describes itself once as :class:`ModelFacts` (``model.facts()``, or
:func:`model_facts` for any module): device, dtype, cache shape, the weight bytes a forward reads.

Its attention is :mod:`piecegraph.attention`'s split op on the paged KV cache (imported with the decoder).
"""

from piecegraph.models.config import LLAMA_3_2_1B_SHAPE, LLAMA_7B_SHAPE, QWEN2_5_0_5B, TINY, ModelConfig
from piecegraph.models.decoder import Decoder
from piecegraph.models.facts import ModelFacts, model_facts
from piecegraph.models.fp8_moe import quantize_fp8
from piecegraph.models.generate import dummy_inputs, generate
from piecegraph.models.loader import load_hf, read_config, save_hf
from piecegraph.models.moe import MoEDecoder
from piecegraph.models.moe_config import QWEN1_5_MOE_A2_7B, TINY_MOE, MoEConfig

__all__ = [
    "Decoder",
    "ModelConfig",
    "ModelFacts",
    "MoEConfig",
    "MoEDecoder",
    "LLAMA_3_2_1B_SHAPE",
    "LLAMA_7B_SHAPE",
    "QWEN1_5_MOE_A2_7B",
    "QWEN2_5_0_5B",
    "TINY",
    "TINY_MOE",
    "dummy_inputs",
    "generate",
    "model_facts",
    "quantize_fp8",
    "load_hf",
    "read_config",
    "save_hf",
]
