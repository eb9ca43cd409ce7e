"""Tokenizers the server speaks through: a byte-level one built here (the tiny model, random-weight presets: no
download), and a model directory's own through transformers.

Both offer ``encode(text)``, ``decode(ids)`` (special tokens skipped), ``chat(messages) -> ids`` (raising
:class:`NoChatTemplate` when there is no template) and ``eos_ids``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence

# The byte tokenizer's own chat template: plain role markers, so a newcomer can try chat on the tiny model. Its
# vocabulary has no special tokens (256 ids are the 256 bytes), so the markers are ordinary text.
BYTE_CHAT_ROLE = "<|{role}|>\n{content}\n"
BYTE_CHAT_REPLY = "<|assistant|>\n"


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template: ``/v1/chat/completions`` cannot render messages (a 400)."""


class Tokenizer(Protocol):
    name: str
    eos_ids: frozenset[int]
    forced_eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: Sequence[tuple[str, str]]) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids ``0..255``; for a model with a larger vocabulary, ids ``>= 256`` (never produced by
    ``encode``) decode as the marker ``<|id|>``, so a random-weight model's output is still text. Invalid UTF-8
    decodes with replacement characters. ``chat_template=False`` builds one without a template (tests the 400).
    No EOS: the tiny model stops at ``max_tokens`` or a stop string.
    """

    name = "bytes"
    eos_ids: frozenset[int] = frozenset()
    forced_eos_id: int | None = None

    def __init__(self, vocab_size: int = 256, chat_template: bool = True) -> None:
        if vocab_size < 256:
            raise ValueError(f"ByteTokenizer needs a vocabulary of at least 256 ids (one per byte), got {vocab_size}")
        self.vocab_size, self.has_chat_template = vocab_size, chat_template

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        if all(i < 256 for i in ids):
            return bytes(ids).decode("utf-8", errors="replace")
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            parts.append(bytes(run).decode("utf-8", errors="replace"))
            parts.append(f"<|{i}|>")
            run = []
        parts.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(parts)

    def chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """``messages`` as ``(role, text)`` pairs rendered with :data:`BYTE_CHAT_ROLE`, then the reply marker."""
        if not self.has_chat_template:
            raise NoChatTemplate("this tokenizer has no chat template; use /v1/completions with a prompt")
        text = "".join(BYTE_CHAT_ROLE.format(role=role, content=content) for role, content in messages)
        return self.encode(text + BYTE_CHAT_REPLY)


class HFTokenizer:
    """A local directory's tokenizer through ``transformers.AutoTokenizer`` (local files only, never the hub).
    ``encode`` adds the model's special tokens (a BOS where it has one), as the model was trained; ``chat`` uses
    the directory's chat template. ``eos_ids``: those Hugging Face's ``generate`` stops at (:func:`_eos_ids`);
    ``forced_eos_id``: the last token it forces on an answer cut by its length limit (:func:`_forced_eos_id`)."""

    def __init__(self, path: str | Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ImportError("a model directory's tokenizer needs transformers: pip install 'piecegraph[hf]'"
                              ) from err
        self.path = Path(path)
        self.tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.name = self.path.name
        self.eos_ids = frozenset(_eos_ids(self.tok, self.path))
        self.forced_eos_id = _forced_eos_id(self.path)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise NoChatTemplate(f"the tokenizer of {self.path} has no chat template; use /v1/completions")
        text = self.tok.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                            add_generation_prompt=True)
        return list(self.tok.encode(text, add_special_tokens=False))  # the template already wrote them


def _eos_ids(tok: Any, path: Path) -> set[int]:
    """The ids Hugging Face's ``generate`` stops at: ``generation_config.json``'s ``eos_token_id`` (one id or a
    list) when it names any, else ``config.json``'s (what transformers builds the generation config from), else
    the tokenizer's EOS (a folder whose configs name none)."""
    import json

    for name in ("generation_config.json", "config.json"):
        file = path / name
        value = json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
        if isinstance(value, int):
            return {value}
        if isinstance(value, list) and value:
            return {int(v) for v in value}
    return {int(tok.eos_token_id)} if getattr(tok, "eos_token_id", None) is not None else set()


def _forced_eos_id(path: Path) -> int | None:
    """The ``forced_eos_token_id`` of the generation config transformers builds for the directory:
    ``generation_config.json``'s when that file exists (absent there: none), else ``config.json``'s. A list gives
    its smallest id, the one greedy decoding picks among the logits transformers' processor leaves equal."""
    import json

    for name in ("generation_config.json", "config.json"):
        file = path / name
        if file.is_file():
            value = json.loads(file.read_text()).get("forced_eos_token_id")
            if isinstance(value, list):
                return min((int(v) for v in value), default=None)
            return None if value is None else int(value)
    return None


def load_tokenizer(model: str, vocab_size: int) -> Tokenizer:
    """The tokenizer for ``model``: a directory's own (``tokenizer.json`` or ``tokenizer_config.json`` there), else
    the byte tokenizer over ``vocab_size`` (presets such as ``tiny`` and directories without a tokenizer)."""
    folder = Path(model)
    if folder.is_dir() and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return HFTokenizer(folder)
    return ByteTokenizer(vocab_size)
