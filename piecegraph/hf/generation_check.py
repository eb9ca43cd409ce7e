"""Whether transformers' greedy ``generate`` would give other tokens than piecegraph's greedy decoding because of
the model's ``generation_config``: a logits processor that piecegraph does not apply (a forced first token,
suppressed ids, repetition and n-gram penalties, a minimum length, bad words, beams, ...). Such a model is refused
naming the field and the value that makes it run; ``forced_eos_token_id`` is applied (``piecegraph.hf.generate``
and the engine end an answer cut by its length limit with it), and sampling fields do not matter to greedy
decoding."""

from __future__ import annotations

from typing import Any

from piecegraph.hf.arch import UnsupportedModelError, model_type

# fields whose processor forces a token (forced_eos_token_id is applied, not refused)
FORCED_TOKENS = ("forced_bos_token_id",)
# fields of token ids transformers' greedy generate never picks (Whisper's), always or first
SUPPRESSED_TOKENS = ("suppress_tokens", "begin_suppress_tokens")
# fields whose processor (or search) changes greedy tokens unless they hold this neutral value (None too)
NEUTRAL = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
           "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0, "min_new_tokens": None,
           "sequence_bias": None, "exponential_decay_length_penalty": None, "forced_decoder_ids": None,
           "num_beams": 1, "guidance_scale": 1.0, "watermarking_config": None}


def check_generation(model: Any) -> None:
    """Raise :class:`~piecegraph.hf.arch.UnsupportedModelError` when ``model.generation_config`` makes
    transformers' greedy ``generate`` differ from piecegraph's greedy decoding: a forced first token
    (``forced_bos_token_id``), suppressed ids inside the vocabulary (``suppress_tokens``,
    ``begin_suppress_tokens``), or any :data:`NEUTRAL` field away from its neutral value. The message names the
    field and the value to set to run it (the tokens then equal transformers' generate with that value)."""
    gen = getattr(model, "generation_config", None)
    name = model_type(model.config)
    for field in FORCED_TOKENS:
        value = getattr(gen, field, None)
        if value is not None:
            raise UnsupportedModelError(
                f"model_type {name!r}: its generation_config.{field}={value} makes transformers' generate force "
                "that token, which piecegraph's greedy decoding does not do; set "
                f"model.generation_config.{field} = None to run it (its greedy tokens then equal transformers' "
                f"generate with {field}=None)")
    vocab = getattr(model.config, "vocab_size", None) or 0
    for field in SUPPRESSED_TOKENS:  # transformers masks the ids inside the vocabulary (others are no-ops)
        ids = [i for i in (getattr(gen, field, None) or ()) if isinstance(i, int) and 0 <= i < vocab]
        if ids:
            raise UnsupportedModelError(
                f"model_type {name!r}: its generation_config.{field} makes transformers' generate suppress tokens "
                f"{ids[:8]}, which piecegraph's greedy decoding does not do; set "
                f"model.generation_config.{field} = None to run it")
    for field, neutral in NEUTRAL.items():
        value = getattr(gen, field, None)
        if value is not None and value != neutral:
            raise UnsupportedModelError(
                f"model_type {name!r}: its generation_config.{field}={value!r} changes the tokens of transformers' "
                "greedy generate (a logits processor or search piecegraph's greedy decoding does not apply); set "
                f"model.generation_config.{field} = {neutral!r} to run it")
