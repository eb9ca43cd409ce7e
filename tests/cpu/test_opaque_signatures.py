"""opaque() takes the signatures real kernel libraries have: Literal, Enum, lists and tuples of tensors, Optional of
those, parameters without hints (typed by their default or the first call), and constants bound at the first call.

Each case is a real function whose result depends on the argument in question; the opaque op must give the same
result eagerly and through torch.compile(fullgraph=True), as one graph node.
"""

import dataclasses
import enum
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, Union

import pytest
import torch

from piecegraph.ops.opaque import OpaqueArgumentError, OpaqueError, opaque

T = torch.Tensor


def compiled(fn, backend="aot_eager"):
    """torch.compile(fullgraph=True) that records the graphs (fullgraph: a break is an error). Resets Dynamo first:
    the helpers' lambdas share one code object, whose compiled variants would add up to the recompile limit."""
    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm if backend == "eager" else torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    return torch.compile(fn, fullgraph=True, backend=record), graphs


def opaque_nodes(graphs):
    return [n for g in graphs for n in g.graph.nodes
            if n.op == "call_function" and "piecegraph_opaque" in str(n.target)]


def same(op, fn, *args, **kwargs):
    """``op(*args, **kwargs) == fn(...)`` eagerly and compiled (one opaque node, no break)."""
    expected = fn(*args, **kwargs)
    torch.testing.assert_close(op(*args, **kwargs), expected)
    run, graphs = compiled(lambda *a, **k: op(*a, **k))
    torch.testing.assert_close(run(*args, **kwargs), expected)
    assert len(graphs) == 1 and len(opaque_nodes(graphs)) == 1


# ------------------------------------------------------------------------------------------------------ Literal
def gemm(a: T, b: T, backend: Literal["cudnn", "cublas", "cutlass", "auto"] = "cublas",
         transpose: Literal[True, False] = False, bits: Optional[Literal[4, 8]] = None) -> T:
    """bmm_fp8-like: the result says which backend, layout and width were asked for."""
    out = a @ (b.t() if transpose else b)
    return out * {"cudnn": 1.0, "cublas": 2.0, "cutlass": 3.0, "auto": 4.0}[backend] + (bits or 0)


def test_literal_values_pass_through_and_are_typed_by_the_schema():
    op = opaque(gemm, fake={"shape": lambda a, b, transpose, **_: (a.shape[0], b.shape[0 if transpose else 1])})
    assert "str backend, bool transpose, int? bits" in str(op.op._schema)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    for backend in ("cudnn", "cublas", "cutlass", "auto"):
        same(op, gemm, a, b, backend)
    same(op, gemm, a, b.t().contiguous(), "cutlass", True, 8)
    same(op, gemm, a, b, bits=None)


def test_a_bad_literal_value_is_refused_naming_the_allowed_values():
    op = opaque(gemm, fake={"shape": lambda a, b, **_: (a.shape[0], b.shape[1])})
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with pytest.raises(OpaqueArgumentError, match="'backend' is 'cuda', not one of .*'cudnn', 'cublas', 'cutlass', "
                                                  "'auto'"):
        op(a, b, "cuda")
    with pytest.raises(ValueError, match="'bits' is 16, not one of .*4, 8, None"):
        op(a, b, bits=16)
    run, _ = compiled(lambda x, y: op(x, y, "tensorrt"))
    with pytest.raises(Exception, match="'backend' is 'tensorrt', not one of"):
        run(a, b)


def test_a_literal_of_mixed_types_is_refused_naming_the_argument():
    def mixed(x: T, mode: Literal["a", 1]) -> T:
        return x

    with pytest.raises(OpaqueError, match="'mode'.*one type"):
        opaque(mixed, fake="like:x")


# --------------------------------------------------------------------------------------------------------- Enum
class Activation(enum.Enum):
    SILU = "silu"
    GELU = "gelu"


class Routing(enum.IntEnum):
    DEFAULT = 0
    RENORMALIZE = 1


def moe(x: T, activation: Activation = Activation.SILU, routing: Optional[Routing] = None) -> T:
    """cutlass_fused_moe-like: the callable gets the Enum members back (is, not ==)."""
    assert isinstance(activation, Activation) and (routing is None or isinstance(routing, Routing))
    y = torch.nn.functional.silu(x) if activation is Activation.SILU else torch.nn.functional.gelu(x)
    return y.softmax(-1) if routing is Routing.RENORMALIZE else y


def test_enum_members_round_trip_by_value():
    op = opaque(moe, fake="like:x")
    assert "str activation, int? routing" in str(op.op._schema)
    x = torch.randn(4, 8)
    for act in Activation:
        for routing in (None, *Routing):
            same(op, moe, x, act, routing)
    torch.testing.assert_close(op(x, "gelu", 1), moe(x, Activation.GELU, Routing.RENORMALIZE))  # values work too
    with pytest.raises(ValueError, match="'relu' is not a valid Activation"):
        op(x, "relu")


def test_an_enum_of_objects_is_a_constant():
    class Table(enum.Enum):
        SMALL = (1, 2)
        LARGE = (3, 4)

    def lookup(x: T, table: Table) -> T:
        return x * table.value[1]

    op = opaque(lookup, fake="like:x")
    same(op, lookup, torch.randn(3), Table.LARGE)
    assert "table" not in str(op.op._schema)
    with pytest.raises(OpaqueArgumentError, match="'table'"):
        op(torch.randn(3), Table.SMALL)


# ------------------------------------------------------------------------------------------- lists and tuples
def merge(x: T, scales: Sequence[T], pair: Tuple[T, Optional[T]], extra: Optional[List[Optional[T]]] = None,
          window: Tuple[int, ...] = (-1, -1)) -> T:
    """Tuples come back as tuples (the op passes lists), None items stay None."""
    assert isinstance(pair, tuple) and isinstance(window, tuple), (type(pair), type(window))
    out = x * sum(scales) + pair[0] * (1 if pair[1] is None else pair[1]) + sum(window)
    for t in extra or ():
        out = out + (0 if t is None else t)
    return out


def test_lists_and_tuples_of_tensors_and_optional_items():
    op = opaque(merge, fake="like:x")
    schema = str(op.op._schema)
    assert "Tensor[] scales, Tensor?[] pair, Tensor?[]? extra, SymInt[] window" in schema
    x = torch.randn(5)
    same(op, merge, x, [x, x + 1], (x, None))
    same(op, merge, x, (x,), (x, x * 2), [x, None, x], window=(2, 3))
    same(op, merge, x, [x], (x, None), None)


def test_a_tuple_of_mutated_tensors():
    def scale_all_(xs: Tuple[T, ...], alpha: float) -> None:
        assert isinstance(xs, tuple)
        for t in xs:
            t.mul_(alpha)

    op = opaque(scale_all_, mutates=("xs",))
    a, b = torch.ones(2), torch.ones(3)
    run, _ = compiled(lambda p, q: (op((p, q), 3.0), p + q.sum())[1])
    torch.testing.assert_close(run(a, b), torch.full((2,), 12.0))
    torch.testing.assert_close(a, torch.full((2,), 3.0))


def _sampling():
    def top_k_sampling(probs: T, top_k: Union[T, int], top_p: Union[T, float] = 1.0) -> T:
        """FlashInfer's sampling signature: a per-row tensor or one value for every row."""
        k = top_k if isinstance(top_k, T) else torch.full((probs.shape[0],), top_k)
        return probs.sort(dim=1, descending=True).values.cumsum(1).gather(1, k[:, None] - 1)[:, 0] * top_p

    return top_k_sampling


def test_a_union_of_schema_types_is_typed_by_the_first_call():
    fn, fake = _sampling(), {"shape": lambda probs, **_: (probs.shape[0],)}
    scalar, per_row = opaque(fn, fake=fake), opaque(_sampling(), fake=fake)
    probs = torch.rand(4, 6)
    same(scalar, fn, probs, 3, 1)  # an int for Union[Tensor, float] is typed float
    assert "SymInt top_k, float top_p" in str(scalar.op._schema)
    same(per_row, fn, probs, torch.tensor([1, 2, 3, 4]), torch.full((4,), 0.5))
    assert "Tensor top_k, Tensor top_p" in str(per_row.op._schema)
    with pytest.raises(Exception, match="top_k"):  # later calls keep the first call's type
        scalar(probs, torch.tensor([1, 2, 3, 4]))


def test_a_hint_that_may_hold_tensors_the_schema_cannot_say_is_refused_naming_it():
    def scaled(x: T, scales: Dict[str, T]) -> T:
        return x * scales["a"]

    def configured(x: T, extra: Union[T, Config]) -> T:
        return x

    for fn, name in ((scaled, "scales"), (configured, "extra")):
        with pytest.raises(OpaqueError, match=f"'{name}'.*cannot be bound as a constant either"):
            opaque(fn, fake="like:x")


# --------------------------------------------------------------------------------------------- without hints
def test_parameters_without_hints_are_typed_by_their_defaults_at_once():
    def norm(x: T, eps=1e-6, groups=1, mode=Activation.GELU, window=(0, 2), fast=True) -> T:
        assert isinstance(mode, Activation) and isinstance(window, tuple)
        y = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * groups
        return (torch.nn.functional.gelu(y) if mode is Activation.GELU else y) + sum(window) * fast

    op = opaque(norm, fake="like:x")
    assert op.op is not None  # registered by opaque() itself: every type is known
    assert "float eps, SymInt groups, str mode, SymInt[] window, bool fast" in str(op.op._schema)
    x = torch.randn(3, 8)
    same(op, norm, x)
    same(op, norm, x, 1e-3, 2, Activation.SILU, (1, 1), False)


def _untyped():
    def rope(q, k, positions, theta=None, interleave=False, scale=None):  # a wrapper written without hints
        rot = positions[:, None].float() / (theta or 1e4)
        q2, k2 = (q * rot.cos(), k * rot.sin()) if not interleave else (q * rot.sin(), k * rot.cos())
        return q2 * (scale or 1.0), k2

    return rope


def test_parameters_without_hints_are_typed_by_the_first_call():
    rope = _untyped()
    op = opaque(rope, fake=["like:q", "like:k"])  # no return hint either: the fake spec says two tensors
    assert op.op is None  # nothing says what q, k, positions, theta are until a call
    q, k, pos = torch.randn(4, 8), torch.randn(4, 8), torch.arange(4)
    torch.testing.assert_close(op(q, k, pos, 500.0), rope(q, k, pos, 500.0))
    assert "(Tensor q, Tensor k, Tensor positions, float? theta, bool interleave) -> (Tensor, Tensor)" in \
        str(op.op._schema)  # scale got None: bound as a constant, out of the schema
    same(op, rope, q * 2, k, pos + 1, None, True)
    same(op, rope, q, k, pos, 10.0)
    with pytest.raises(OpaqueArgumentError, match="'scale'.*first call passed None.*annotate it"):
        op(q, k, pos, 500.0, False, 2.0)


def test_the_first_call_may_be_compiled():
    rope = _untyped()
    op = opaque(rope, fake=["like:q", "like:k"])
    q, k, pos = torch.randn(4, 8), torch.randn(4, 8), torch.arange(4)
    run, graphs = compiled(lambda a, b, p: op(a, b, p, 100.0, True))
    torch.testing.assert_close(run(q, k, pos), rope(q, k, pos, 100.0, True))  # registered while tracing
    assert len(opaque_nodes(graphs)) == 1 and op.op is not None and "Tensor q, Tensor k" in str(op.op._schema)
    torch.testing.assert_close(run(q + 1, k, pos), rope(q + 1, k, pos, 100.0, True))
    assert len(graphs) == 1  # the same graph again
    other, _ = compiled(lambda a, b, p: op(a, b, p, 100.0, True, 4.0))  # traced against the first call's types
    with pytest.raises(Exception, match="'scale'.*neither `is` nor `==`"):
        other(q, k, pos)
    torch.testing.assert_close(op(q, k, pos, 7.0), rope(q, k, pos, 7.0))  # eager after


# ------------------------------------------------------------------------------------------------- constants
@dataclasses.dataclass
class Config:
    """An object no schema can carry; equal configs count as the same constant."""

    gain: float
    act: Callable[[T], T] = torch.tanh


def apply(x: T, cfg: Config, post: Callable[[T], T], tag: Any = "f") -> T:
    return post(cfg.act(x) * cfg.gain)


def test_objects_and_callables_are_bound_as_constants_and_a_different_one_is_refused():
    op = opaque(apply, fake="like:x")
    cfg, x = Config(2.0), torch.randn(6)
    same(op, apply, x, cfg, torch.relu)
    schema = str(op.op._schema)
    assert "cfg" not in schema and "post" not in schema and "str tag" in schema  # Any: typed by the first call
    torch.testing.assert_close(op(x, Config(2.0), torch.relu), apply(x, cfg, torch.relu))  # == counts as the same
    with pytest.raises(OpaqueArgumentError, match="'cfg' was bound as a constant.*new opaque op"):
        op(x, Config(3.0), torch.relu)
    with pytest.raises(OpaqueArgumentError, match="'post'.*Pass the same object on every call"):
        op(x, cfg, torch.sigmoid)
    run, _ = compiled(lambda a: op(a, cfg, torch.sigmoid))
    with pytest.raises(Exception, match="'post'"):
        run(x)


def test_a_constant_hint_given_a_tensor_on_the_first_call_is_refused():
    def weird(x: T, table: Any, extra: Callable) -> T:
        return x

    op = opaque(weird, fake="like:x")
    with pytest.raises(OpaqueError, match="'extra'.*first call passed Tensor"):
        op(torch.randn(2), 1, torch.randn(2))


# ---------------------------------------------------------------------------------------- call conventions
def test_keyword_only_parameters_reach_the_callable_by_keyword():
    def silu_and_mul(x: T, *, out: Optional[T] = None, enable_pdl: Optional[bool] = None) -> T:
        return torch.nn.functional.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:]

    op = opaque(silu_and_mul, fake={"shape": lambda x, **_: (*x.shape[:-1], x.shape[-1] // 2)})
    x = torch.randn(3, 8)
    same(op, silu_and_mul, x)
    same(op, silu_and_mul, x, enable_pdl=True)


def test_a_fake_function_sees_what_the_callable_sees():
    seen = []

    def fake(x, act, *, pair):
        seen.append((type(act), type(pair)))
        return torch.empty_like(x)

    def kernel(x: T, act: Activation, *, pair: Tuple[T, T]) -> T:
        return x * pair[0] + (1 if act is Activation.SILU else 2)

    op = opaque(kernel, fake=fake)
    x = torch.randn(3)
    same(op, kernel, x, Activation.GELU, pair=(x, x))
    assert seen and all(s == (Activation, tuple) for s in seen)
