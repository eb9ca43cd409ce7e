"""Shape rules for inferred fakes: what each output's shape, dtype and device are as functions of the inputs,
fitted to observed runs of the real function, and written as the ``fake=`` text :func:`piecegraph.opaque` takes.

A :class:`Shot` is one run: every tensor argument's shape, dtype and device, the other arguments' values, and
each output's shape, dtype and device. :func:`fit_fake` finds, for every output dimension, the first expression
of a small language that gives the observed value in *every* shot (several token counts, several call sites):

  * ``x.shape[i]`` (and ``x.shape[-i]``, ``xs[k].shape[i]`` for a list of tensors), in parameter order, the same
    dimension index first;
  * ``1`` for a dimension that is 1 in every shot (a per-tensor scale);
  * ``x.shape[i] // q`` and ``x.shape[i] * q`` (q in 2, 3, 4, 8), ``sum(t.shape[i] for t in xs)``, the sum of two
    dimensions, the product of two dimensions of one tensor;
  * a constant, when the value is the same in every shot.

dtype: a ``torch.dtype`` argument equal to it in every shot, else the dtype of a tensor argument, else a constant.
Device: the first tensor argument's (opaque's default), else another argument's, else a constant. An output shaped,
typed and placed like one contiguous argument in every shot is written ``"like:x"``.

Constraint: a rule is exact for the shots it was fitted to; a static dimension that coincides with another in
every shot (a square weight) may be read from either, which is right for every call seen and may not be for
shapes never seen. :mod:`piecegraph.ops.auto_opaque` therefore guards its fakes with the calls seen.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["OutMeta", "Shot", "RuleError", "FakeText", "fit_fake"]


class RuleError(ValueError):
    """No expression of the rule language fits every shot."""


@dataclass(frozen=True)
class OutMeta:
    """One returned tensor: shape, dtype, device, whether it is contiguous, and the argument it shares memory with."""

    shape: tuple
    dtype: torch.dtype
    device: str
    contiguous: bool
    alias: Optional[str] = None


@dataclass(frozen=True)
class Shot:
    """One run of the real function. ``shapes``: tensor arguments' shapes (a list of tensors: a tuple of shapes);
    ``dtypes``/``devices``: tensor arguments (a list: its first item's); ``contiguous``: plain tensors only;
    ``scalars``: every other argument; ``tensors``: the plain tensor arguments in parameter order (None ones left
    out); ``outs``: None when it returned None."""

    shapes: dict
    dtypes: dict
    devices: dict
    contiguous: dict
    scalars: dict
    tensors: tuple
    outs: Optional[tuple]
    written: frozenset = frozenset()
    lists: frozenset = frozenset()  # the arguments that are lists of tensors (dtypes/devices: their first item's)
    as_tuple: bool = False  # a one-tensor tuple, not a tensor


@dataclass(frozen=True)
class FakeText:
    """The fitted fake: its text for ``opaque(fake=...)`` (``"None"`` for a function returning None), the number of
    outputs (None: returns None) and, per output, how it was described (for messages)."""

    text: str
    outputs: Optional[int]
    parts: tuple


_Term = tuple  # (text, params used, value(shot) -> int | None)


def _dim(shot: Shot, name: str, i: int, item: Optional[int] = None) -> Optional[int]:
    shape = shot.shapes.get(name)
    if shape is None:
        return None
    if item is not None:
        if not isinstance(shape, tuple) or item >= len(shape) or not isinstance(shape[item], tuple):
            return None
        shape = shape[item]
    elif shape and isinstance(shape[0], tuple):
        return None
    return shape[i] if -len(shape) <= i < len(shape) else None


def _singles(shot: Shot) -> list[_Term]:
    terms = []
    for name, shape in shot.shapes.items():
        if shape and isinstance(shape[0], tuple):  # a list of tensors
            for k, item in enumerate(shape):
                terms += [(f"{name}[{k}].shape[{i}]", (name,), lambda s, n=name, i=i, k=k: _dim(s, n, i, k))
                          for i in range(len(item))]
        else:
            terms += [(f"{name}.shape[{i}]", (name,), lambda s, n=name, i=i: _dim(s, n, i))
                      for i in range(len(shape))]
            terms += [(f"{name}.shape[{i - len(shape)}]", (name,), lambda s, n=name, i=i - len(shape): _dim(s, n, i))
                      for i in range(len(shape))]
    return terms


def _apply(op: Callable, *terms: _Term) -> Callable:
    def value(shot: Shot) -> Optional[int]:
        vals = [t[2](shot) for t in terms]
        return None if any(v is None for v in vals) else op(*vals)

    return value


def _list_sums(shot: Shot) -> list[_Term]:
    terms = []
    for name, shape in shot.shapes.items():
        if shape and isinstance(shape[0], tuple):
            for i in range(min(len(s) for s in shape)):
                def value(s: Shot, n: str = name, i: int = i) -> Optional[int]:
                    items = s.shapes.get(n)
                    if not items or not isinstance(items[0], tuple) or any(len(t) <= i for t in items):
                        return None
                    return sum(t[i] for t in items)

                terms.append((f"sum(t.shape[{i}] for t in {name})", (name,), value))
    return terms


def _derived(singles: list[_Term], shot: Shot) -> list[_Term]:
    plain = [t for t in singles if "-" not in t[0] and "[" not in t[0].split(".")[0]]  # x.shape[i] only
    terms = []
    for q in (2, 3, 4, 8):
        terms += [(f"{t[0]} // {q}", t[1], _apply(lambda v, q=q: v // q, t)) for t in plain]
        terms += [(f"{t[0]} * {q}", t[1], _apply(lambda v, q=q: v * q, t)) for t in plain]
    terms += _list_sums(shot)
    for a, b in itertools.combinations(plain, 2):
        terms.append((f"{a[0]} + {b[0]}", tuple(dict.fromkeys(a[1] + b[1])), _apply(lambda x, y: x + y, a, b)))
        if a[1] == b[1]:
            terms.append((f"{a[0]} * {b[0]}", a[1], _apply(lambda x, y: x * y, a, b)))
    return terms


def _fits(term: _Term, shots: list[Shot], k: int, j: int) -> bool:
    return all(term[2](s) == s.outs[k].shape[j] for s in shots)


def _fit_dim(shots: list[Shot], k: int, j: int, singles: list[_Term], derived: list[_Term]) -> _Term:
    """Same-index dimensions first, then 1, the other dimensions, derived expressions, a constant (see the module
    docstring): a constant last, since a static dimension it equals is the rule that holds for other shapes."""
    values = {s.outs[k].shape[j] for s in shots}
    same_index = [t for t in singles if t[0].endswith(f".shape[{j}]")]
    ones = [("1", (), lambda s: 1)] if values == {1} else []
    for term in itertools.chain(same_index, ones, singles, derived):
        if _fits(term, shots, k, j):
            return term
    if len(values) == 1 and derived:
        value = next(iter(values))
        return (str(value), (), lambda s: value)
    seen = sorted((s.outs[k].shape[j] for s in shots))
    raise RuleError(f"output {k} dim {j} ({seen[0]}..{seen[-1]} over the runs) is no function of the input shapes "
                    f"that piecegraph can write (a dimension, its multiple or fraction, a sum, a product, a constant)")


def _attr(shots: list[Shot], k: int, field: str) -> Optional[str]:
    """``"like:x"`` (a tensor argument) or ``lambda xs, **_: xs[0].<field>`` (a list of tensors) whose ``field``
    (dtype or device) equals output ``k``'s in every shot."""
    table = "dtypes" if field == "dtype" else "devices"
    for name in getattr(shots[0], table):
        if all(getattr(s, table).get(name) == getattr(s.outs[k], field) for s in shots):
            return f"lambda {name}, **_: {name}[0].{field}" if name in shots[0].lists else f'"like:{name}"'
    return None


def _fit_dtype(shots: list[Shot], k: int) -> str:
    first = shots[0]
    for name, value in first.scalars.items():
        if isinstance(value, torch.dtype) and all(s.scalars.get(name) == s.outs[k].dtype for s in shots):
            return f"lambda {name}, **_: {name}"
    return _follow(shots, k, "dtype", str)


def _fit_device(shots: list[Shot], k: int) -> Optional[str]:
    if all(s.tensors and s.devices[s.tensors[0]] == s.outs[k].device for s in shots):
        return None  # opaque's default: the first tensor argument's device
    return _follow(shots, k, "device", repr)


def _follow(shots: list[Shot], k: int, field: str, spell: Callable[[Any], str]) -> str:
    """Output ``k``'s ``field`` (dtype or device): an argument's, else one constant (written by ``spell``)."""
    values = {getattr(s.outs[k], field) for s in shots}
    found = _attr(shots, k, field) or (spell(next(iter(values))) if len(values) == 1 else None)
    if found is None:
        raise RuleError(f"output {k}'s {field} ({', '.join(sorted(map(str, values)))}) follows no argument")
    return found


def _like(shots: list[Shot], k: int) -> Optional[str]:
    """The first argument output ``k`` is like in every shot (shape, dtype, device; the argument contiguous)."""
    for name in shots[0].tensors:
        if all(s.shapes.get(name) == s.outs[k].shape and s.dtypes.get(name) == s.outs[k].dtype
               and s.devices.get(name) == s.outs[k].device and s.contiguous.get(name) for s in shots):
            return name
    return None


def _one_output(shots: list[Shot], k: int) -> str:
    like = _like(shots, k)
    if like is not None:
        return f'"like:{like}"'
    ranks = {len(s.outs[k].shape) for s in shots}
    if len(ranks) != 1:
        raise RuleError(f"output {k} has rank {sorted(ranks)} in different runs and is like no argument")
    singles, derived = _singles(shots[0]), None
    dims = []
    for j in range(ranks.pop()):
        try:
            dims.append(_fit_dim(shots, k, j, singles, []))
        except RuleError:
            derived = derived if derived is not None else _derived(singles, shots[0])
            dims.append(_fit_dim(shots, k, j, singles, derived))
    used = [n for n in shots[0].shapes if any(n in t[1] for t in dims)]
    head = f"lambda {', '.join(used)}, **_" if used else "lambda **_"
    shape = ", ".join(t[0] for t in dims) + ("," if len(dims) == 1 else "")
    fields = [f'"shape": {head}: ({shape})', f'"dtype": {_fit_dtype(shots, k)}']
    device = _fit_device(shots, k)
    if device is not None:
        fields.append(f'"device": {device}')
    return "{" + ", ".join(fields) + "}"


def fit_fake(shots: list[Shot]) -> FakeText:
    """The fake spec text that reproduces every shot's outputs (see the module docstring); :class:`RuleError`
    when the shots disagree on the output structure or some output has no rule."""
    counts = {None if s.outs is None else len(s.outs) for s in shots}
    if len(counts) != 1:
        raise RuleError(f"it returns {sorted(map(str, counts))} outputs in different runs (None: returns None)")
    count = counts.pop()
    if count is None:
        return FakeText("None", None, ())
    for s in shots:
        bad = [k for k, o in enumerate(s.outs) if not o.contiguous]
        if bad:
            raise RuleError(f"output {bad[0]} is not contiguous (shape {s.outs[bad[0]].shape}); a fake spec makes "
                            f"contiguous tensors, so the compiled graph would read it with the wrong strides")
    parts = tuple(_one_output(shots, k) for k in range(count))
    text = parts[0] if count == 1 and not shots[0].as_tuple else "[" + ", ".join(parts) + "]"
    return FakeText(text, count, parts)


def evaluate(text: str) -> Any:
    """The fake spec object of a :func:`fit_fake` text (evaluated with ``torch`` in scope)."""
    return eval(text, {"torch": torch, "__builtins__": {"sum": sum}})  # noqa: S307 - text written by fit_fake
