"""Infer a library function's fake by running it: the outputs' shapes as functions of the input shapes, their
dtype and device, which tensor arguments it writes, which output is an argument it returned.

Input: :class:`Call` records, each one call the model made (arguments by parameter name, tensors cloned *before*
the call) at ``tokens`` tokens, and optionally the same call's argument shapes at another token count (``twin``).
The token dimensions of each argument are those that changed between the two (``a * tokens + b``); without a
twin, those equal to ``tokens`` in arguments that are not the model's parameters or buffers (``tokens >= 2``
needed: with one token every size-1 dimension would qualify). Without a twin (a model run in a forward context,
whose metadata fixes the token count) a dimension of ``k * tokens`` rows (``2 <= k <= 8``: a mixture of experts'
top-k (token, expert) rows) is tried as a token dimension first, and taken as static if probing it so fails. A
static size taken for a token dimension this way is caught by the guard (:class:`Case`): every token dimension of
a traced call must be the same count.

Probing: each distinct call runs at ``t``, ``t + 3`` and ``2t + 5`` tokens (``t`` the recorded count; token
dimensions cut or tiled from the recorded data, everything else as recorded), once more at ``t + 3`` on other
data of the same shapes (output shapes that change there depend on data: refused), and the fitted rules
(:mod:`piecegraph.ops.shape_rules`) are checked against runs at ``3t + 7`` and ``2t + 263`` (far enough to
cross a block boundary of 128 tokens, where a padded size that looked constant changes); any difference (shape,
dtype, device, an argument written only there) refuses the function, with the reason.

Constraints: every run gets fresh copies, so the recorded tensors (and the caller's) are never written; random
data comes from a private generator (the global RNG is untouched); the function must accept token counts other
than the recorded one (one that needs a multiple of 16 is refused, named). A dimension that is constant over
every probed count but not beyond (``round_up(tokens, 512)``) cannot be told from a constant.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from piecegraph.ops.converters import differs
from piecegraph.ops.shape_rules import FakeText, OutMeta, RuleError, Shot, evaluate, fit_fake
from piecegraph.ops.signature import make_fake

__all__ = ["Call", "Case", "Inferred", "ProbeRefused", "infer_fake", "kind_of", "probe_sizes"]


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


def _at(call: Call, dims: dict[str, Any], n: int) -> dict[str, Any]:
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


# -------------------------------------------------------------------------------------------------- one run
def _call(fn: Callable, params: list[inspect.Parameter], values: dict[str, Any]) -> Any:
    """``fn`` called as opaque calls it: keyword-only parameters by keyword, the others positionally."""
    args = [values[p.name] for p in params if p.kind != p.KEYWORD_ONLY]
    kwargs = {p.name: values[p.name] for p in params if p.kind == p.KEYWORD_ONLY}
    return fn(*args, **kwargs)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _changed(now: Any, before: Any) -> bool:
    if isinstance(now, torch.Tensor):
        return now.shape != before.shape or not torch.equal(_bytes(now), _bytes(before))
    return any(_changed(a, b) for a, b in zip(now, before))


def _alias(t: torch.Tensor, values: dict[str, Any]) -> Optional[str]:
    if t.numel() == 0:
        return None
    ptr = t.untyped_storage().data_ptr()
    for name, value in values.items():
        items = [value] if isinstance(value, torch.Tensor) else value if kind_of(value) == "tensors" else []
        if any(v.numel() and v.untyped_storage().data_ptr() == ptr for v in items):
            return name
    return None


def _outputs(out: Any, values: dict[str, Any]) -> tuple[Optional[tuple], bool]:
    if out is None:
        return None, False
    if isinstance(out, torch.Tensor) or (type(out) is tuple and out and all(isinstance(o, torch.Tensor) for o in out)):
        items = (out,) if isinstance(out, torch.Tensor) else out
        metas = tuple(OutMeta(tuple(o.shape), o.dtype, str(o.device), o.is_contiguous(), _alias(o, values))
                      for o in items)
        return metas, not isinstance(out, torch.Tensor)
    raise ProbeRefused(f"it returns {type(out).__name__}{' of ' + str(len(out)) if isinstance(out, list) else ''}, "
                       f"not a tensor, a tuple of tensors or None")


def _shot(fn: Callable, params: list[inspect.Parameter], values: dict[str, Any], n: int) -> Shot:
    kinds = {k: kind_of(v) for k, v in values.items()}
    before = {k: v.clone() if kinds[k] == "tensor" else [t.clone() for t in v]
              for k, v in values.items() if kinds[k] != "value"}
    try:
        out = _call(fn, params, values)
    except Exception as err:  # noqa: BLE001  (any failure of the real function refuses it, named)
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ProbeRefused(f"running it at {n} tokens raised {type(err).__name__}: {first}") from err
    outs, as_tuple = _outputs(out, values)
    plain = [k for k in values if kinds[k] == "tensor"]
    first = {k: v if kinds[k] == "tensor" else v[0] for k, v in values.items() if kinds[k] != "value"}
    return Shot(shapes={k: shape_of(v) for k, v in values.items() if kinds[k] != "value"},
                dtypes={k: t.dtype for k, t in first.items()}, devices={k: str(t.device) for k, t in first.items()},
                contiguous={k: values[k].is_contiguous() for k in plain}, lists=frozenset(first) - set(plain),
                scalars={k: v for k, v in values.items() if kinds[k] == "value"},
                tensors=tuple(plain), outs=outs, as_tuple=as_tuple,
                written=frozenset(k for k in before if _changed(values[k], before[k])))


# None: the recorded data negated; then seeded draws. One draw can tie by chance (a filter keeping as many rows of
# other data); the negation cannot for a sign filter over an odd number of rows.
OTHER_DATA_SEEDS = (None, 20240, 20241, 20242, 20243)


def _same_shapes_for_other_data(fn: Callable, params: list, values: dict[str, Any], shot: Shot, n: int) -> set:
    """Run ``fn`` on other data of the shapes of ``values`` (one per entry of :data:`OTHER_DATA_SEEDS`) and
    refuse, naming it, a function whose output shapes change with them; returns the arguments those runs wrote."""
    written: set = set()
    for seed in OTHER_DATA_SEEDS:
        try:
            other = _shot(fn, params, _other_data(values, seed), n)
        except ProbeRefused:  # data it does not take (indices out of range...): no evidence either way
            continue
        if _out_shapes(other) != _out_shapes(shot):
            raise ProbeRefused(f"its output shapes depend on the data, not on the input shapes: at {n} tokens it "
                               f"returned {_out_shapes(shot)} for one input and {_out_shapes(other)} for another "
                               "of the same shapes")
        written |= other.written
    return written


def _other_data(values: dict[str, Any], seed: int | None) -> dict[str, Any]:
    """The same shapes, other data: for a ``seed``, floating tensors random normal and integer ones random in their
    own range (sorted along the last dimension where the recorded one is: see :func:`_sorted`); for ``None``,
    floating tensors negated (the rest copied)."""
    gen: dict[str, torch.Generator] = {}

    def redo(t: torch.Tensor) -> torch.Tensor:
        if seed is None:
            return t.float().neg().to(t.dtype) if t.is_floating_point() else t.clone()  # float8 has no neg
        g = gen.setdefault(str(t.device), torch.Generator(device=t.device).manual_seed(seed))
        if t.is_floating_point():
            return torch.randn(t.shape, generator=g, device=t.device).to(t.dtype)
        if t.dtype == torch.bool:
            return torch.randint(0, 2, t.shape, generator=g, device=t.device).bool()
        if t.numel() and not t.is_complex():
            low, high = int(t.min()), int(t.max())
            drawn = torch.randint(low, high + 1, t.shape, generator=g, device=t.device).to(t.dtype)
            return drawn.sort(dim=-1).values if _sorted(t) else drawn
        return t.clone()

    return {k: redo(v) if kind_of(v) == "tensor" else type(v)(redo(t) for t in v) if kind_of(v) == "tensors" else v
            for k, v in values.items()}


def _sorted(t: torch.Tensor) -> bool:
    """Whether an integer tensor is non-decreasing along its last dimension (offsets: ``indptr``, ``cu_seqlens``).

    Its random draw stays sorted: a kernel handed unsorted offsets computes negative segment lengths, and on a GPU
    that is a device fault (an illegal instruction in FlashInfer's sm90 grouped GEMM), which no ``except`` catches
    and which ends the process's CUDA context."""
    return t.dim() > 0 and t.shape[-1] > 1 and bool((t.diff(dim=-1) >= 0).all())


def _out_shapes(shot: Shot) -> Any:
    return None if shot.outs is None else [o.shape for o in shot.outs]


# -------------------------------------------------------------------------------------------------- inference
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


@dataclass
class Inferred:
    """The result: the fake (text and spec), the arguments written, the outputs that are a written argument, the
    calls it holds for, and the token counts probed (the check size last)."""

    fake: FakeText
    spec: Any
    ret: Any
    mutates: tuple
    returns_argument: dict
    cases: list
    sizes: tuple


def _ret(fake: FakeText, as_tuple: bool) -> Any:
    if fake.outputs is None:
        return None
    if fake.outputs == 1 and not as_tuple:
        return torch.Tensor
    return typing.Tuple[(torch.Tensor,) * fake.outputs]


def _check(fake_impl: Callable, names: list[str], real: Shot, values: dict[str, Any], sizes: tuple, n: int
           ) -> None:
    got = fake_impl(*[values[k] for k in names])
    got = () if got is None else (got,) if isinstance(got, torch.Tensor) else tuple(got)
    want = real.outs or ()
    described = [(tuple(g.shape), g.dtype, str(g.device)) for g in got]
    real_described = [(o.shape, o.dtype, o.device) for o in want]
    if described != real_described:
        raise ProbeRefused(f"the fake inferred at {sizes[:3]} tokens gives {described} at {n} tokens, and the "
                           f"real function {real_described}")


def infer_fake(fn: Callable, calls: list[Call]) -> Inferred:
    """Probe ``fn`` on ``calls`` (all at one token count) and return the checked fake (see the module docstring);
    :class:`ProbeRefused` naming the reason when no fake can be trusted."""
    if not calls:
        raise ProbeRefused("it was not called in the recorded forward")
    if any(token_dims(c, multiples=True) != token_dims(c) for c in calls):
        try:  # k * tokens rows taken for token dims; when probing them so fails, they are static after all
            return _infer(fn, calls, multiples=True)
        except ProbeRefused:
            pass
    return _infer(fn, calls, multiples=False)


def _infer(fn: Callable, calls: list[Call], multiples: bool) -> Inferred:
    params = list(inspect.signature(fn).parameters.values())
    t = calls[0].tokens
    sizes = probe_sizes(t)
    shots, layouts, written = [], [], set()
    for call in calls:
        dims = token_dims(call, multiples)
        runs = [_shot(fn, params, _at(call, dims, n), n) for n in sizes[:3]]
        written |= _same_shapes_for_other_data(fn, params, _at(call, dims, sizes[1]), runs[1], sizes[1])
        shots += runs
        layouts.append((call, dims))
    try:
        fake = fit_fake(shots)
    except RuleError as err:
        raise ProbeRefused(str(err)) from None
    written |= {k for s in shots for k in s.written}
    mutates = tuple(p.name for p in params if p.name in written)
    ret = _ret(fake, shots[0].as_tuple)
    spec, names = evaluate(fake.text), [p.name for p in params]
    fake_impl = make_fake(spec, names, ret, getattr(fn, "__name__", "fn"))
    cases = []
    for call, dims in layouts:
        for n in sizes[3:]:
            values = _at(call, dims, n)
            real = _shot(fn, params, dict(values), n)
            _check(fake_impl, names, real, values, sizes, n)
            extra = real.written - set(mutates)
            if extra:
                raise ProbeRefused(f"it writes {sorted(extra)} at {n} tokens but not at {sizes[:3]}")
        case = Case.of(call.values, dims)
        case.fake = fake_impl
        cases.append(case)
    aliases = {k: o.alias for s in shots for k, o in enumerate(s.outs or ()) if o.alias is not None}
    return Inferred(fake, spec, ret, mutates, aliases, cases, sizes)
