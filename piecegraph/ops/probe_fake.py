"""Infer a library function's fake by running it: the outputs' shapes as functions of the input shapes, their
dtype and device, which tensor arguments it writes, which output is an argument it returned.

Input: recorded :class:`~piecegraph.ops.probe_calls.Call` records, all at one token count, whose token dimensions
:func:`~piecegraph.ops.probe_calls.token_dims` finds (a twin at another count, else sizes equal to the count).
Without a twin a dimension of ``k * tokens`` rows (a mixture of experts' top-k rows) is tried as a token dimension
first, and taken as static if probing it so fails.

Probing: each distinct call runs at ``t``, ``t + 3`` and ``2t + 5`` tokens (``t`` the recorded count; token
dimensions cut or tiled from the recorded data, everything else as recorded), once more at ``t + 3`` on other
data of the same shapes (output shapes that change there depend on data: refused), and the fitted rules
(:mod:`piecegraph.ops.shape_rules`) are checked against runs at ``3t + 7`` and ``2t + 263`` (far enough to
cross a block boundary of 128 tokens, where a padded size that looked constant changes); any difference (shape,
dtype, device, an argument written only there) refuses the function, with the reason. Each call's
:class:`~piecegraph.ops.probe_calls.Case` is the guard of the calls the fake holds for.

Constraints: every run gets fresh copies, so the recorded tensors (and the caller's) are never written; random
data comes from a private generator (the global RNG is untouched); the function must accept token counts other
than the recorded one (one that needs a multiple of 16 is refused, named). A dimension that is constant over
every probed count but not beyond (``round_up(tokens, 512)``) cannot be told from a constant.
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from piecegraph.ops.probe_calls import Call, Case, ProbeRefused, at_tokens, kind_of, probe_sizes, shape_of, token_dims
from piecegraph.ops.shape_rules import FakeText, OutMeta, RuleError, Shot, evaluate, fit_fake
from piecegraph.ops.signature import make_fake

__all__ = ["Inferred", "infer_fake"]


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
        runs = [_shot(fn, params, at_tokens(call, dims, n), n) for n in sizes[:3]]
        written |= _same_shapes_for_other_data(fn, params, at_tokens(call, dims, sizes[1]), runs[1], sizes[1])
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
            values = at_tokens(call, dims, n)
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
