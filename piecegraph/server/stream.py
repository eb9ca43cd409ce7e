"""One request's output as text, incrementally: detokenization that never splits a character, stop token ids and
stop strings (the engine knows neither beyond one EOS id, so they are applied here and the request aborted)."""

from __future__ import annotations

from typing import Collection, Sequence

from piecegraph.server.tokenizer import Tokenizer


class TextStream:
    """Feed output token ids as they arrive; read back the text safe to send.

    The text sent so far, concatenated with :meth:`finish`'s remainder, equals ``tokenizer.decode`` of the kept
    ids (for the byte tokenizer exactly; for subword tokenizers as vLLM's incremental detokenizer does): text
    ending in an incomplete character (U+FFFD) is held until the next token completes it, and text that could
    be the start of a stop string is held until it cannot. A stop token id ends the output (kept in
    :attr:`ids`, not in the text); a stop string ends it (not included; tokens after the one that completed it
    are dropped). After a stop, :attr:`stopped` is true and further tokens are ignored.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), stop_ids: Collection[int] = ()) -> None:
        self.tok, self.stop, self.stop_ids = tokenizer, tuple(s for s in stop if s), frozenset(stop_ids)
        self.ids: list[int] = []  # output ids kept, a stop id included
        self.text = ""  # decoded text of the kept ids (minus a stop string and what follows it)
        self.sent = 0  # characters of ``text`` handed out
        self.stopped = False
        self._text_ids: list[int] = []  # the ids that make text (a stop id excluded)
        self._prefix = self._read = 0  # detokenization window: ids[prefix:read] produced the last text piece
        self._longest_stop = max(map(len, self.stop), default=0)

    def feed(self, ids: Sequence[int]) -> tuple[str, list[int]]:
        """Add output ids; returns ``(text delta to send, ids kept from these)``."""
        if self.stopped:
            return "", []
        kept: list[int] = []
        # With stop strings, one id at a time: the id that completes one must be the last kept.
        chunks = [[i] for i in ids] if self.stop else [list(ids)]
        for chunk in chunks:
            for n, i in enumerate(chunk if self.stop_ids else ()):  # no stop ids (the common case): no scan
                if i in self.stop_ids:
                    chunk, self.stopped = chunk[:n + 1], True
                    break
            kept += chunk
            self.ids += chunk
            self._text_ids += chunk[:-1] if self.stopped else chunk
            self._detokenize(final=self.stopped)
            if self.stopped:
                break
        return self._take(), kept

    def finish(self) -> str:
        """The generation ended: flush held text (an incomplete character, a partial stop string)."""
        self._detokenize(final=True)
        self.stopped = True
        return self._take()

    def _detokenize(self, final: bool) -> None:
        before = self.tok.decode(self._text_ids[self._prefix:self._read])
        after = self.tok.decode(self._text_ids[self._prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            start = max(0, len(self.text) - self._longest_stop + 1)
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._text_ids)
            self._cut_at_stop(start)

    def _cut_at_stop(self, start: int) -> None:
        hits = [p for p in (self.text.find(s, start) for s in self.stop) if p >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def _take(self) -> str:
        end = len(self.text) if self.stopped else len(self.text) - self._held()
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent += len(delta)
        return delta

    def _held(self) -> int:
        """Characters at the end of ``text`` that begin some stop string (they may still complete it)."""
        for n in range(min(self._longest_stop - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
