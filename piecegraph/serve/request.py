"""A request and its life: waiting, running (prefill chunks, then decode), finished; preempted ones wait again."""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

from piecegraph.program import describe


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens.

    ``temperature`` 0 (default) is greedy (argmax). Above 0, tokens are sampled from ``softmax(logits / t)``,
    each with a generator seeded by ``(seed, index of the token)``: the same request with the same seed gives
    the same tokens whatever it is batched with, and after a preemption. ``top_p`` in (0, 1]: sample only from
    the most likely tokens whose probabilities sum to at least ``top_p`` (nucleus sampling; 1: all of them).
    ``eos_token_id``: stop after emitting it (it is the last output token); ``None`` never stops early.
    ``forced_eos_token_id``: the last output token a request may have (its ``max_new_tokens``-th) is this id
    whatever was sampled, as transformers' ``ForcedEOSTokenLogitsProcessor`` forces it (BART, Marian, Pegasus...
    set it in their ``generation_config``); ``None``: nothing forced.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int = 0
    eos_token_id: int | None = None
    top_p: float = 1.0
    forced_eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature!r} must be a number >= 0 (0: greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p!r} must be a number in (0, 1] (1: no nucleus cut)")
        for name in ("eos_token_id", "forced_eos_token_id"):
            eos = getattr(self, name)
            if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int)):
                raise TypeError(f"SamplingParams.{name}={eos!r} must be an int token id or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(eq=False)
class Request:
    """One generation request and its progress.

    ``num_computed`` counts the tokens of :attr:`tokens` (prompt, then outputs) whose k/v are in the cache. A
    running request with ``num_computed < len(tokens) - 1`` is still prefilling (chunked), one with exactly one
    token left is decoding. Preemption frees its pages and sets ``num_computed`` to 0: its prompt and the
    outputs so far are prefilled again (recompute), and generation continues where it stopped.
    Times are ``time.perf_counter()`` seconds: ``arrival``, ``first_token`` and each output token's.
    ``finish_reason`` once finished: ``"eos"``, ``"length"`` or ``"aborted"`` (``Engine.abort``: its output is
    whatever it had emitted, a prefix of what it would have emitted).

    ``inflight`` counts output tokens sampled on the device but not yet known to the host (the overlapped engine
    learns a step's tokens one step later): they count in :attr:`num_tokens` (their k/v are scheduled like any
    other token), not in :attr:`output` or :attr:`tokens`, which hold only what the host knows.

    ``cached_tokens``: prompt tokens found in the prefix cache when it was first admitted (not computed then);
    ``prefix_entries``: the prefix cache's entries of its full pages so far (``serve/prefix_cache.py``).
    """

    id: Hashable
    prompt: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival: float = 0.0
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    finish_reason: str | None = None
    inflight: int = 0
    cached_tokens: int = 0
    prefix_entries: list[int] = field(default_factory=list)

    @classmethod
    def make(cls, id: Hashable, prompt: Sequence[int], params: SamplingParams | None = None,
             arrival: float = 0.0) -> "Request":
        """Validate and build; ``prompt``: a sequence of int token ids (not a string, not floats or bools, at least
        one); ``params``: a :class:`SamplingParams` or ``None`` (defaults). Raises ``TypeError``/``ValueError``
        naming the argument (the vocabulary and the cache are checked by the engine)."""
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
            raise TypeError(f"request {describe(id)}: prompt must be a sequence of int token ids, got "
                            f"{type(prompt).__name__}")
        prompt = _tokens(id, prompt)
        if not prompt:
            raise ValueError(f"request {describe(id)}: the prompt needs at least one token")
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"request {describe(id)}: params must be a SamplingParams or None, got "
                            f"{type(params).__name__}")
        return cls(id=id, prompt=prompt, params=params or SamplingParams(), arrival=arrival)

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.output]

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, the ones still in flight on the device included."""
        return len(self.prompt) + len(self.output) + self.inflight

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, known to the host or not: the index of the next one."""
        return len(self.output) + self.inflight

    @property
    def fully_scheduled(self) -> bool:
        """Every token up to ``max_new_tokens`` is sampled (some may be in flight): nothing left to schedule,
        it finishes when the host learns its last token."""
        return self.num_generated >= self.params.max_new_tokens

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``tokens[start:stop]`` without building the whole list (a decode row reads one token); host-known
        tokens only (``stop`` at most ``len(prompt) + len(output)``)."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p:stop - p]
        return [*self.prompt[start:stop], *self.output[:max(0, stop - p)]]

    @property
    def max_len(self) -> int:
        """The most tokens this request can hold in the cache (the last output is never written)."""
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def pending(self) -> int:
        """Tokens still to run through the model before the next output token."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def append(self, token: int, now: float) -> int:
        """Record an output token (the oldest in flight, if any) and return the token recorded: the params'
        ``forced_eos_token_id`` instead when this is the last token allowed. Finishes the request on EOS or at
        ``max_new_tokens`` (``"length"``, a forced EOS included: the answer was cut, not ended by the model)."""
        if self.inflight:
            self.inflight -= 1
        last = len(self.output) + 1 >= self.params.max_new_tokens
        forced = last and self.params.forced_eos_token_id is not None
        if forced:
            token = self.params.forced_eos_token_id
        self.output.append(token)
        self.token_times.append(now)
        if self.params.eos_token_id is not None and token == self.params.eos_token_id and not forced:
            self.finish_reason = "eos"
        elif last:
            self.finish_reason = "length"
        return token


def _tokens(id: Hashable, prompt: Iterable[object]) -> tuple[int, ...]:
    """The prompt as a tuple of ints: a list or tuple of plain ints as is (one C-level pass over the types: a
    server takes 1000+ prompts of 500+ tokens at once, and the per-token check cost ~35 us per 512 tokens on a
    CPU), anything else token by token (:func:`_token`, which converts int-likes and names what is not an int)."""
    if type(prompt) in (list, tuple) and set(map(type, prompt)) <= {int}:
        return tuple(prompt)
    return tuple(_token(id, t) for t in prompt)


def _token(id: Hashable, t: object) -> int:
    """One prompt token as an int: ints and int-like scalars (numpy, 0-d integer tensors); no bools or floats."""
    try:
        if isinstance(t, bool):
            raise TypeError
        return operator.index(t)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"request {describe(id)}: prompt token {describe(t)} ({type(t).__name__}) is not an int "
                        "token id") from None
