"""Reference Qwen2/Llama decoder over flat tokens: config and presets, the decoder, loader and greedy generation;
beside it a mixture-of-experts decoder (``MoEDecoder``, ``MoEConfig``) on the same attention, and FP8 (e4m3) forms of
both (``quantize_fp8``); an MLA decoder (``MLADecoder``, ``MLAConfig``: DeepSeek-V2/V3, GLM-5 with DSA, their
experts; ``load_mla`` reads their Hugging Face folders). Each describes itself once as :class:`ModelFacts`
(``model.facts()``, or :func:`model_facts` for any module): device, dtype, cache shape, the weight bytes a forward
reads. :func:`fuse_projections` merges q/k/v and gate/up into one GEMM each.

Its attention is :mod:`piecegraph.attention`'s split op on the paged KV cache (imported with the decoder).
"""

from piecegraph.models.config import LLAMA_3_2_1B_SHAPE, LLAMA_7B_SHAPE, QWEN2_5_0_5B, TINY, ModelConfig
from piecegraph.models.decoder import Decoder
from piecegraph.models.facts import ModelFacts, model_facts
from piecegraph.models.fp8_moe import quantize_fp8
from piecegraph.models.fuse import fuse_projections
from piecegraph.models.generate import dummy_inputs, generate
from piecegraph.models.loader import load_hf, read_config, save_hf
from piecegraph.models.mla import MLADecoder
from piecegraph.models.mla_config import DEEPSEEK_V3_SHAPE, GLM5_SHAPE, TINY_GLM5, TINY_MLA, MLAConfig
from piecegraph.models.mla_loader import is_mla_folder, load_mla
from piecegraph.models.moe import MoEDecoder
from piecegraph.models.moe_config import QWEN1_5_MOE_A2_7B, TINY_MOE, MoEConfig

__all__ = [
    "DEEPSEEK_V3_SHAPE",
    "Decoder",
    "GLM5_SHAPE",
    "MLAConfig",
    "MLADecoder",
    "ModelConfig",
    "ModelFacts",
    "MoEConfig",
    "MoEDecoder",
    "LLAMA_3_2_1B_SHAPE",
    "LLAMA_7B_SHAPE",
    "QWEN1_5_MOE_A2_7B",
    "QWEN2_5_0_5B",
    "TINY",
    "TINY_GLM5",
    "TINY_MLA",
    "TINY_MOE",
    "dummy_inputs",
    "fuse_projections",
    "generate",
    "model_facts",
    "quantize_fp8",
    "is_mla_folder",
    "load_hf",
    "load_mla",
    "read_config",
    "save_hf",
]
