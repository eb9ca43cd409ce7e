"""Property: for a random signature (a random mix of the parameter kinds opaque() takes, positional or keyword-only,
hinted or not), ``opaque(fn)(*args, **kwargs) == fn(*args, **kwargs)``, on the first call and on later ones."""

import enum
from typing import Callable, List, Literal, Optional, Sequence, Tuple, Union

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from piecegraph.ops.opaque import opaque

T = torch.Tensor


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 3


class Scaler:
    """A constant: an object no schema can carry."""

    def __init__(self, factor: float) -> None:
        self.factor = factor


SCALER = Scaler(1.25)
tensors = st.integers(0, 2**16).map(lambda s: torch.randn(3, generator=torch.Generator().manual_seed(s)))
tensor_lists = st.lists(tensors, min_size=1, max_size=3)
numbers = st.floats(-4, 4, allow_nan=False, width=32)


def _tuple_sum(v):
    assert isinstance(v, tuple), type(v)  # the callable gets a tuple back, not the op's list
    return sum(v)


def _member(cls):
    def contrib(v):
        assert isinstance(v, cls), type(v)  # rebuilt from its value
        return len(str(v.value)) if cls is Color else int(v)
    return contrib


# kind: (annotation, default or "" for none, value strategy, contribution of the value to the result)
KINDS = {
    "tensor": (T, "", tensors, lambda v: v),
    "opt_tensor": (Optional[T], "None", st.one_of(st.none(), tensors), lambda v: 0 if v is None else v),
    "int": (int, "", st.integers(-3, 3), lambda v: v),
    "float": (float, "", numbers, lambda v: v),
    "bool": (bool, "", st.booleans(), lambda v: 1.5 if v else -1.0),
    "literal": (Literal["x", "yy", "zzz"], "'x'", st.sampled_from(["x", "yy", "zzz"]), len),
    "literal_int": (Optional[Literal[1, 2, 4]], "None", st.sampled_from([1, 2, 4, None]), lambda v: v or 0),
    "enum": (Color, "", st.sampled_from(list(Color)), _member(Color)),
    "int_enum": (Level, "Level.LOW", st.sampled_from(list(Level)), _member(Level)),
    "list": (List[T], "", tensor_lists, sum),
    "sequence": (Sequence[T], "", tensor_lists.map(tuple), sum),
    "tuple": (Tuple[T, ...], "", tensor_lists.map(tuple), _tuple_sum),
    "opt_list": (Optional[List[Optional[T]]], "None", st.one_of(st.none(), st.lists(st.one_of(st.none(), tensors),
                 min_size=1, max_size=3)), lambda v: sum(0 if t is None else t for t in v or ())),
    "int_tuple": (Tuple[int, ...], "(1, 2)", st.lists(st.integers(-2, 2), min_size=1, max_size=3).map(tuple),
                  _tuple_sum),
    "untyped_default": (None, "0.5", numbers, lambda v: v),
    "untyped_enum_default": (None, "Color.BLUE", st.sampled_from(list(Color)), _member(Color)),
    "untyped": (None, "", st.one_of(tensors, st.integers(-3, 3), numbers), lambda v: v),
    "union": (Union[T, int, float], "", st.one_of(tensors, st.integers(-3, 3), numbers), lambda v: v),
    "constant": (Scaler, "", st.just(SCALER), lambda v: v.factor),
    "callable": (Callable[[float], float], "", st.just(abs), lambda v: v(-2.0)),
}


@st.composite
def signatures(draw):
    """``(fn, first call's (args, kwargs), a later call's (args, kwargs))`` for a random signature."""
    kinds = draw(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=6))
    keyword_from = draw(st.integers(1, len(kinds) + 1))  # parameters from here on are keyword-only
    scope = {"T": T, "Color": Color, "Level": Level}
    params, terms = ["x: T"], ["x"]
    positional = kinds[: keyword_from - 1]
    for i, kind in enumerate(kinds, start=1):
        ann, default, _, contrib = KINDS[kind]
        if i <= len(positional) and not all(KINDS[k][1] for k in positional[i - 1:]):
            default = ""  # a positional default needs defaults after it; without, the kind types by its value
        if i == keyword_from:
            params.append("*")
        scope[f"ann{i}"], scope[f"c{i}"] = ann, contrib
        params.append(f"p{i}" + (f": ann{i}" if ann is not None else "") + (f" = {default}" if default else ""))
        terms.append(f"c{i}(p{i})")
    src = f"def target({', '.join(params)}) -> T:\n    return {' + '.join(terms)}\n"
    exec(compile(src, "<property target>", "exec"), scope)  # noqa: S102 - generated from the table above

    first = [draw(tensors)] + [draw(KINDS[k][2]) for k in kinds]
    same_type = {T: tensors, int: st.integers(-3, 3), float: numbers}
    later = [draw(tensors)] + [  # a later call passes the types the first call typed the untyped parameters with
        draw(same_type[T if isinstance(v, T) else type(v)] if k in ("untyped", "union") else KINDS[k][2])
        for k, v in zip(kinds, first[1:])]

    def split(values):
        cut = keyword_from if keyword_from <= len(kinds) else len(kinds) + 1
        return values[:cut], {f"p{i}": v for i, v in enumerate(values[cut:], start=cut)}

    return scope["target"], split(first), split(later)


def _check(op, fn, args, kwargs):
    torch.testing.assert_close(op(*args, **kwargs), fn(*args, **kwargs))


@settings(max_examples=60, deadline=None)
@given(signatures())
def test_opaque_equals_the_callable_for_random_signatures(case):
    fn, (args, kwargs), (later_args, later_kwargs) = case
    op = opaque(fn, fake="like:x")
    _check(op, fn, args, kwargs)  # the first call (types the untyped, binds the constants)
    _check(op, fn, later_args, later_kwargs)  # the typed code path
    _check(op, fn, args, kwargs)


@settings(max_examples=6, deadline=None)
@given(signatures())
def test_compiled_first_call_equals_the_callable_for_random_signatures(case):
    fn, (args, kwargs), _ = case
    op = opaque(fn, fake="like:x")
    torch._dynamo.reset()
    run = torch.compile(lambda *a, **k: op(*a, **k), fullgraph=True, backend="eager")
    torch.testing.assert_close(run(*args, **kwargs), fn(*args, **kwargs))
    _check(op, fn, args, kwargs)
