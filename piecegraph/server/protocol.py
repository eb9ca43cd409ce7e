"""The OpenAI wire format: request models (unknown fields refused), parsing that names the bad field, and
OpenAI's error shape.

Parsing is done here rather than by FastAPI's body injection so that every refusal (malformed JSON, an unknown
field, a value out of range) becomes a 400 whose message starts with the field's dotted path, in the
``{"error": {"message", "type", "param", "code"}}`` shape the official clients read.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

# Extensions beyond OpenAI's fields, as vLLM spells them so the same benchmark clients work against both:
# ignore_eos (run to max_tokens), stop_token_ids, return_token_ids (the ids next to the text).
MAX_STOP = 16
MAX_SEED = 2**32  # the engine derives a generator seed from (seed, token index): keep it far from overflow


class APIError(Exception):
    """A refusal in OpenAI's shape: HTTP ``status``, a ``message`` that names ``param`` (the field) when there is
    one, the error ``type`` and ``code``; ``headers`` (e.g. ``Retry-After``) go with the response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Sampling(_Strict):
    """Fields both endpoints share. Fields OpenAI defines that this server cannot honour are accepted only at
    their neutral value (so clients that send defaults work) and refused otherwise, naming the field."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: StrictInt | None = Field(None, ge=0, lt=MAX_SEED)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: StrictStr | None = None
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0)
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=0)
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    return_token_ids: StrictBool = False


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text or token ids (a one-element batch is unwrapped)."""

    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    echo: Literal[False] = False
    logprobs: StrictInt | None = Field(None, le=-1)  # any value is refused: the server returns no logprobs
    best_of: Literal[1] | None = None
    suffix: None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered by the tokenizer's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: Literal[False] | None = None
    top_logprobs: None = None


def parse(raw: bytes, model: type[BaseModel]) -> Any:
    """``raw`` (a request body) as ``model``, or an :class:`APIError` 400 naming what is wrong: not JSON, not an
    object, an unknown field (listing the accepted ones), a missing field or a value out of range."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise _validation_error(err, model) from None


def _validation_error(err: ValidationError, model: type[BaseModel]) -> APIError:
    first = err.errors(include_url=False)[0]
    # Unions report one error per member, with the member's type in the path: keep the field names only.
    loc = [str(p) for p in first["loc"] if isinstance(p, int) or not _is_type_name(str(p))]
    param = ".".join(loc) or None
    if first["type"] == "extra_forbidden":
        if len(loc) == 1:
            known = ", ".join(sorted(model.model_fields))
            return APIError(400, f"{param}: unknown field; this endpoint accepts {known}", param=param,
                            code="unknown_field")
        return APIError(400, f"{param}: unknown field", param=param, code="unknown_field")
    if first["type"] == "missing":
        return APIError(400, f"{param}: a required field is missing", param=param)
    if loc and loc[0] == "prompt" and len(loc) <= 2:  # a union: pydantic reports its last member's complaint
        return APIError(400, "prompt: must be text or a list of int token ids (got "
                        f"{json.dumps(first.get('input'), default=str)[:80]})", param="prompt")
    if loc and loc[0] in _UNSUPPORTED:
        return APIError(400, f"{param}: {_UNSUPPORTED[loc[0]]}", param=param, code="unsupported_value")
    return APIError(400, f"{param}: {first['msg']} (got {json.dumps(first.get('input'), default=str)[:80]})",
                    param=param)


def _is_type_name(part: str) -> bool:
    """A union member's tag in a pydantic error path (``str``, ``list[int]``, ``literal['text']``), not a field."""
    return "[" in part or part in ("str", "int", "float", "bool", "none", "dict", "list")


_UNSUPPORTED = {
    "n": "only n=1 is supported (send one request per completion)",
    "echo": "echo is not supported",
    "logprobs": "logprobs are not supported by this server",
    "best_of": "only best_of=1 is supported",
    "presence_penalty": "presence_penalty is not supported (only 0)",
    "frequency_penalty": "frequency_penalty is not supported (only 0)",
    "logit_bias": "logit_bias is not supported",
    "suffix": "suffix is not supported",
    "top_logprobs": "top_logprobs are not supported by this server",
}
