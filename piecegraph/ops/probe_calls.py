"""The calls a library function's fake is inferred from (:mod:`piecegraph.ops.probe_fake`), and their tokens.

Input: :class:`Call` records, each one call the model made (arguments by parameter name, tensors cloned *before*
the call) at ``tokens`` tokens, and optionally the same call's argument shapes at another token count (``twin``).
The token dimensions of each argument (:func:`token_dims`) are those that changed between the two (``a * tokens +
b``); without a twin, those equal to ``tokens`` in arguments that are not the model's parameters or buffers
(``tokens >= 2`` needed: with one token every size-1 dimension would qualify). Without a twin (a model run in a
forward context, whose metadata fixes the token count) a dimension of ``k * tokens`` rows (``2 <= k <=``
:data:`ROWS_PER_TOKEN`: a mixture of experts' top-k (token, expert) rows) may be tried as a token dimension
(``multiples``). :func:`at_tokens` remakes a call at another token count: token dimensions cut or tiled from the
recorded data (fresh tensors: the recorded ones are never written), everything else as recorded.

A static size taken for a token dimension is caught by the guard (:class:`Case`): every token dimension of a traced
call must be the same count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from piecegraph.ops.converters import differs

__all__ = ["Call", "Case", "ProbeRefused", "at_tokens", "kind_of", "probe_sizes", "shape_of", "token_dims"]


class ProbeRefused(Exception):
    """The function cannot get an inferred fake; the message says why (it is shown to the user as is)."""


@dataclass
class Call:
    """One recorded call: every parameter by name (defaults applied; tensors cloned before the call), the model's
    token count, (optionally) the argument shapes of the same call at ``twin_tokens``, and the arguments that are
    the model's own parameters or buffers (static, whatever their sizes)."""

    values: dict[str, Any]
    tokens: int
    twin: Optional[dict[str, Any]] = None
    twin_tokens: int = 0
    static: frozenset = frozenset()  # arguments that are the model's parameters or buffers: never token-sized


def kind_of(value: Any) -> str:
    """``"tensor"``, ``"tensors"`` (a non-empty list or tuple of tensors), or ``"value"``; :class:`ProbeRefused` for
    tensors inside anything else (a dict, a list mixing tensors and other values)."""
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
        return "tensors"
    if isinstance(value, (list, tuple, dict)) and any(isinstance(v, torch.Tensor) for v in
                                                        (value.values() if isinstance(value, dict) else value)):
        raise ProbeRefused(f"an argument holds tensors in a {type(value).__name__} that is not a list of tensors")
    return "value"


def shape_of(value: Any) -> Any:
    """A tensor's shape, a list of tensors' shapes (a tuple of tuples), or None."""
    kind = kind_of(value)
    if kind == "tensor":
        return tuple(value.shape)
    return tuple(tuple(t.shape) for t in value) if kind == "tensors" else None


# ------------------------------------------------------------------------------------------- token dimensions
ROWS_PER_TOKEN = 8  # the most rows per token a dimension without a twin is tried as (top-k of a mixture of experts)


def _untwinned(s: int, t: int, multiples: bool) -> Optional[tuple]:
    if s == t:
        return (1, 0)
    if multiples and s % t == 0 and 2 <= s // t <= ROWS_PER_TOKEN:
        return (s // t, 0)
    return None


def _dims(name: str, shape: tuple, twin: Optional[tuple], t: int, t2: int, multiples: bool = False) -> tuple:
    if twin is None:
        return tuple(_untwinned(s, t, multiples) for s in shape)
    if len(twin) != len(shape):
        raise ProbeRefused(f"argument {name!r} has rank {len(shape)} at {t} tokens and {len(twin)} at {t2}")
    dims = []
    for s, s2 in zip(shape, twin):
        a, rest = divmod(s2 - s, t2 - t)
        if s2 != s and (rest or a < 1):
            raise ProbeRefused(f"a dimension of argument {name!r} is {s} at {t} tokens and {s2} at {t2}: not a "
                               f"multiple of the token count plus a constant")
        dims.append(None if s2 == s else (a, s - a * t))
    return tuple(dims)


def token_dims(call: Call, multiples: bool = False) -> dict[str, Any]:
    """Per tensor argument, per dimension: ``(a, b)`` when it is ``a * tokens + b``, None when static.
    ``multiples``: without a twin, also take ``k * tokens`` sizes as token dims (module docstring)."""
    if call.twin is None and call.tokens < 2:
        raise ProbeRefused("the model ran with one token, where every size-1 dimension looks like the token one; "
                           "call it first with two or more tokens")
    out = {}
    for name, value in call.values.items():
        shape = shape_of(value)
        twin = None if call.twin is None else call.twin.get(name, ())
        if shape is None:
            continue
        if twin is None and name in call.static:
            twin = shape  # a weight: static, even where a size equals the token count
        if kind_of(value) == "tensors":
            twins = twin if twin is not None and len(twin) == len(shape) else [None] * len(shape)
            twins = shape if name in call.static and call.twin is None else twins
            if twin is not None and len(twin) != len(shape):
                raise ProbeRefused(f"list argument {name!r} has {len(shape)} tensors at {call.tokens} tokens and "
                                   f"{len(twin)} at {call.twin_tokens}")
            out[name] = tuple(_dims(name, s, w, call.tokens, call.twin_tokens, multiples)
                              for s, w in zip(shape, twins))
        else:
            out[name] = _dims(name, shape, twin, call.tokens, call.twin_tokens, multiples)
    return out


def _resize(t: torch.Tensor, dims: tuple, n: int) -> torch.Tensor:
    """``t`` with each token dimension made ``a * n + b`` long (cut, or tiled from its own rows); a fresh tensor."""
    out = t
    for d, rule in enumerate(dims):
        if rule is None:
            continue
        m, size = rule[0] * n + rule[1], out.shape[d]
        if m > size and size == 0:
            raise ProbeRefused("a token dimension is empty in the recorded call; nothing to tile from")
        index = torch.arange(m, device=t.device) % size
        out = out.index_select(d, index)
    return out.clone(memory_format=torch.preserve_format) if out is t else out


def at_tokens(call: Call, dims: dict[str, Any], n: int) -> dict[str, Any]:
    """``call``'s arguments at ``n`` tokens: each tensor's token dimensions (``dims``, from :func:`token_dims`)
    made ``a * n + b`` long, cut or tiled from its own rows (fresh tensors), every other argument as recorded."""
    values = {}
    for name, value in call.values.items():
        kind = kind_of(value)
        if kind == "tensor":
            values[name] = _resize(value, dims[name], n)
        elif kind == "tensors":
            values[name] = type(value)(_resize(v, d, n) for v, d in zip(value, dims[name]))
        else:
            values[name] = value
    return values


def probe_sizes(tokens: int) -> tuple[int, int, int, int, int]:
    """The token counts probed (the recorded one first; three) and the check sizes (two)."""
    return tokens, tokens + 3, 2 * tokens + 5, 3 * tokens + 7, 2 * tokens + 263


# ------------------------------------------------------------------------------------------------- the guard
@dataclass
class Case:
    """A call the inferred fake holds for: per tensor argument its dtype and dims (a static size, or ``(a, b)``
    for ``a * tokens + b``), per other argument its value. :meth:`accepts` tells whether a traced call is one of
    these: static sizes equal (a symbolic size there is not), every token dim the same token count."""

    key: dict[str, tuple]
    fake: Optional[Callable] = field(default=None, repr=False)  # the spec fake (positional) this case uses

    @staticmethod
    def of(values: dict[str, Any], dims: dict[str, Any]) -> "Case":
        def tensor(t: torch.Tensor, d: tuple) -> tuple:
            return ("T", t.dtype, tuple(r if r is not None else s for s, r in zip(t.shape, d)))

        key = {}
        for name, v in values.items():
            kind = kind_of(v)
            key[name] = tensor(v, dims[name]) if kind == "tensor" else \
                ("L", tuple(tensor(t, d) for t, d in zip(v, dims[name]))) if kind == "tensors" else \
                ("V", tuple(v) if isinstance(v, list) else v)
        return Case(key)

    @staticmethod
    def _tensor_ok(t: Any, spec: tuple, tokens: list) -> bool:
        if not isinstance(t, torch.Tensor) or t.dtype != spec[1] or t.dim() != len(spec[2]):
            return False
        for size, want in zip(t.shape, spec[2]):
            if isinstance(want, tuple):
                tokens.append((size, *want))
            elif isinstance(size, torch.SymInt) or size != want:
                return False
        return True

    @staticmethod
    def _one_count(tokens: list) -> bool:
        """Every token dim is ``a * n + b`` of one ``n`` (a static size taken for a token dim fails here)."""
        if not tokens:
            return True
        size, a, b = tokens[0]
        if a > 1 and (size - b) % a != 0:
            return False
        n = (size - b) // a
        return all(other == a2 * n + b2 for other, a2, b2 in tokens[1:])

    def accepts(self, values: dict[str, Any]) -> bool:
        tokens: list = []
        for name, spec in self.key.items():
            v = values.get(name)
            if spec[0] == "T" and not self._tensor_ok(v, spec, tokens):
                return False
            if spec[0] == "L" and not (isinstance(v, (list, tuple)) and len(v) == len(spec[1])
                                       and all(self._tensor_ok(t, s, tokens) for t, s in zip(v, spec[1]))):
                return False
            if spec[0] == "V":
                v = tuple(v) if isinstance(v, list) else v
                if isinstance(v, torch.Tensor) or (v is not spec[1] and differs(v, spec[1])):
                    return False
        return self._one_count(tokens)
