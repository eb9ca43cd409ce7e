"""An OpenAI request's sampling fields as the engine's :class:`~piecegraph.serve.SamplingParams`, plus the stops
the server applies itself; every limit the engine would hit later is checked here, naming the field."""

from __future__ import annotations

import secrets
from typing import Any

from piecegraph.serve.request import SamplingParams
from piecegraph.server.protocol import MAX_SEED, MAX_STOP, APIError
from piecegraph.server.tokenizer import Tokenizer

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to what fits


def build_params(req: Any, prompt: list[int], tokenizer: Tokenizer, max_seq_len: int, vocab_size: int, *,
                 chat: bool) -> tuple[SamplingParams, list[str], set[int]]:
    """``(engine params, stop strings, stop token ids)`` for a parsed request whose prompt is ``prompt``.

    ``max_seq_len`` bounds prompt + output. Temperature defaults to 1 as OpenAI's does (0 is greedy); a sampled
    request without a seed gets a random one. The engine stops at one EOS id itself; other EOS ids of the
    tokenizer and ``stop_token_ids`` are applied by the server (``ignore_eos`` drops the EOS ids). The model's
    forced EOS (``generation_config.forced_eos_token_id``: the last token allowed, as transformers forces it) goes
    to the engine, unless ``ignore_eos``. ``top_p`` goes to the engine (nucleus sampling). Raises
    :class:`APIError` 400 naming the field.
    """
    prompt_field = "messages" if chat else "prompt"
    if len(prompt) >= max_seq_len:
        raise APIError(400, f"{prompt_field}: the prompt has {len(prompt)} tokens; this model's maximum context "
                       f"length is {max_seq_len} tokens, prompt and output together", param=prompt_field,
                       code="context_length_exceeded")
    room = max_seq_len - len(prompt)
    field, max_tokens = "max_tokens", req.max_tokens
    if chat and req.max_completion_tokens is not None:
        field, max_tokens = "max_completion_tokens", req.max_completion_tokens
    if max_tokens is None:
        max_tokens = room if chat else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    elif max_tokens > room:
        raise APIError(400, f"{field}: this model's maximum context length is {max_seq_len} tokens; the prompt has "
                       f"{len(prompt)}, so at most {room} can be generated, not {max_tokens}", param=field,
                       code="context_length_exceeded")
    temperature = 1.0 if req.temperature is None else req.temperature
    seed = req.seed if req.seed is not None else (secrets.randbelow(MAX_SEED) if temperature > 0 else 0)
    extra = _top_p(req.top_p, temperature)
    stop = _stop_strings(req.stop)
    stop_ids = set(req.stop_token_ids or ())
    bad = sorted(i for i in stop_ids if not 0 <= i < vocab_size)
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                       param="stop_token_ids")
    eos = None
    if not req.ignore_eos and tokenizer.eos_ids:
        eos = min(tokenizer.eos_ids)
        stop_ids |= set(tokenizer.eos_ids)
    forced = None if req.ignore_eos else getattr(tokenizer, "forced_eos_id", None)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, seed=seed, eos_token_id=eos,
                            forced_eos_token_id=forced, **extra)
    return params, stop, stop_ids


def _top_p(top_p: float | None, temperature: float) -> dict[str, Any]:
    # greedy ignores it, as OpenAI's API does
    return {} if top_p is None or top_p == 1.0 or temperature == 0 else {"top_p": float(top_p)}


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > MAX_STOP:
        raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise APIError(400, "stop: empty stop strings are not allowed", param="stop")
    return stops
