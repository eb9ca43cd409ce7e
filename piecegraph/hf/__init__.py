"""Hugging Face decoders with piecewise graphs, unmodified: piecegraph's attention through ``AttentionInterface``.

``HFDecoder(hf_model)`` (or ``piecegraph.compile(hf_model)``, which wraps a ``PreTrainedModel`` itself) runs an
unmodified ``transformers`` causal LM over flat tokens on piecegraph's paged KV cache: its attention calls the
split op ``piecegraph_models::attention``, so the graph splits into ``num_layers + 1`` pieces.
``generate(hf_model, prompts, max_new_tokens)`` is greedy generation with packed piecewise prefill and
full-graph decode. ``unwrap(model)`` (or ``HFDecoder.unwrap()``, or the end of ``with HFDecoder(model)``) gives
the model back exactly as it was; while wrapped, its own forward, ``generate`` and ``generate_batch`` work as
before. Which models run is decided by evidence, not by name: the config and the built model are checked for
what the flat forward relies on, and a short numeric probe (:func:`verify`, once per model, on by default)
compares piecegraph's attention with the model's own forward; a model that differs is refused naming the first
layer that differs. Importing this package does not import transformers.
"""

from piecegraph.hf.arch import UnsupportedModelError, cache_config, check_structure, check_supported
from piecegraph.hf.generate import Session, eos_ids, generate, new_token_limits, wrap
from piecegraph.hf.load import check_folder, load, read_model_type, verify
from piecegraph.hf.model import HFDecoder, is_hf_model, unwrap
from piecegraph.hf.probe import Verdict

__all__ = [
    "HFDecoder",
    "Session",
    "UnsupportedModelError",
    "Verdict",
    "cache_config",
    "check_folder",
    "check_structure",
    "check_supported",
    "eos_ids",
    "generate",
    "new_token_limits",
    "is_hf_model",
    "load",
    "read_model_type",
    "unwrap",
    "verify",
    "wrap",
]
