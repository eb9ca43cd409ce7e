"""opaque(): a JIT library entry (loader and kernel) becomes one custom-op node that Dynamo traces."""

import inspect
import sys
from pathlib import Path
from typing import Dict, Literal, Optional, Tuple

import pytest
import torch

try:
    import jitlib  # noqa: F401 - the package import is the point (a folder on sys.path)
except ImportError:  # pytest's importlib mode does not put the test folder on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import jitlib  # noqa: F401
from jitlib import kernels

from piecegraph.ops import OpaqueError, is_opaque, opaque
from piecegraph.ops.split import split_op_names

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler (cc) on this machine")


def half_shape(x, **_):
    return (*x.shape[:-1], x.shape[-1] // 2)


scaled_add = opaque(kernels.scaled_add, fake="like:x")
rmsnorm = opaque(kernels.rmsnorm, fake=("like", "x"), mutates=("out",))
scale_ = opaque(kernels.scale_, mutates=("x",))
halves = opaque(kernels.halves, fake=[{"shape": half_shape, "dtype": "like:x"}, {"shape": half_shape}])


def compile_counting(fn):
    """torch.compile(fullgraph=True) with an eager backend that counts graphs (fullgraph: breaks are errors)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    return torch.compile(fn, fullgraph=True, backend=backend), graphs


def test_plain_dynamo_fails_on_the_jit_library():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    kernels.scaled_add(x, y)  # warm: Dynamo traces through functools.cache anyway
    with pytest.raises(Exception, match="(?i)stat|getuid|subprocess|lock|skip|unsupported"):
        torch.compile(lambda a, b: kernels.scaled_add(a, b) * 2, fullgraph=True, backend="eager")(x, y)


def test_opaque_op_traces_as_one_node_and_equals_eager():
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def f(a, b):
        return torch.relu(scaled_add(a, b, 2.5)) + scaled_add(a, b)  # keyword default and explicit scalar

    compiled, graphs = compile_counting(f)
    torch.testing.assert_close(compiled(x, y), f(x, y))
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("piecegraph_opaque" in t for t in targets) == 2


def test_opaque_under_inductor():
    x, y = torch.randn(3, 16), torch.randn(3, 16)

    def f(a, b):
        return scaled_add(a * 2, b).sin() + 1

    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x, y), f(x, y))


def test_tuple_outputs_dict_spec_and_dtype_default():
    x = torch.randn(2, 3, 8)

    def f(a):
        lo, hi = halves(a, alpha=3.0)
        return lo - hi

    compiled, graphs = compile_counting(f)
    torch.testing.assert_close(compiled(x), f(x))
    torch.testing.assert_close(f(x), 3 * (x[..., :4] - x[..., 4:]))


def test_optional_tensor_and_mutated_out_are_copy_correct():
    x, w = torch.randn(5, 16), torch.randn(16)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def f(a, weight, out: Optional[torch.Tensor]):
        return rmsnorm(a, weight, out=out) + 0

    compiled, _ = compile_counting(f)
    torch.testing.assert_close(compiled(x, w, None), ref, rtol=1e-4, atol=1e-5)
    out = torch.zeros(5, 16)
    result = compiled(x, w, out)
    torch.testing.assert_close(result, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)  # the mutation reached the caller's buffer
    eager = rmsnorm(x, w, out=out)
    assert eager is not out and eager.data_ptr() != out.data_ptr()  # an opaque op never returns an input alias


def test_mutating_op_with_no_return():
    x = torch.randn(6)

    def f(a):
        b = a.clone()
        scale_(b, 4.0)
        return b + 1

    compiled, _ = compile_counting(f)
    torch.testing.assert_close(compiled(x), 4 * x + 1)
    y = x.clone()

    def g(a):
        scale_(a, 2.0)  # mutation of a graph input must be visible outside
        return a.sum()

    compile_counting(g)[0](y)
    torch.testing.assert_close(y, 2 * x)


def test_drop_in_signature_docstring_and_idempotency():
    assert inspect.signature(scaled_add) == inspect.signature(kernels.scaled_add)
    assert scaled_add.__doc__ == kernels.scaled_add.__doc__ and scaled_add.__name__ == "scaled_add"
    assert opaque(kernels.scaled_add, fake="like:x") is scaled_add
    assert opaque(scaled_add) is scaled_add and is_opaque(scaled_add) and not is_opaque(kernels.scaled_add)


def test_split_flag_declares_a_split_op():
    def attention_like(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)

    op = opaque(attention_like, mutates=["out"], split=True, name="pg_test_split_attention")
    assert "piecegraph_opaque::pg_test_split_attention" in split_op_names()
    out = torch.empty(3)
    op(torch.ones(3), out)
    assert out.sum() == 3


def test_decorator_form_and_explicit_name():
    @opaque(fake={"shape": lambda x, n, **_: (x.shape[0] * n,), "dtype": torch.float64}, name="pg_test_repeat")
    def repeat(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.repeat(n).double()

    x = torch.randn(3)
    compiled, _ = compile_counting(lambda a: repeat(a, 2))
    torch.testing.assert_close(compiled(x), x.repeat(2).double())
    assert repeat.op is torch.ops.piecegraph_opaque.pg_test_repeat.default


def _fresh_add():
    def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # a new function each time: opaque() caches by fn
        return x + y

    return add


def _fresh_inplace():
    def scale(x: torch.Tensor, alpha: float) -> None:
        x.mul_(alpha)

    return scale


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (lambda: (lambda *xs: xs[0]), {"fake": "like:x"}, "xs"),
        (_fresh_add, {"fake": "like:nope"}, "nope"),
        (_fresh_add, {"fake": 3}, "bad fake spec"),
        (_fresh_add, {"fake": {"dtype": torch.float32}}, "shape"),
        (_fresh_add, {"fake": ["like:x", "like:y"]}, "2"),
        (_fresh_inplace, {"mutates": ["alpha"]}, "alpha"),
        (_fresh_inplace, {"mutates": ["missing"]}, "missing"),
    ],
)
def test_clear_errors(make, kwargs, match):
    with pytest.raises(OpaqueError, match=match):
        opaque(make(), **kwargs)


def test_unsupported_types_name_the_argument():
    def tensor_or_float(x: torch.Tensor, scale: Dict[str, torch.Tensor]) -> torch.Tensor:
        return x  # neither a schema type nor a constant (it holds tensors)

    def mixed_literal(x: torch.Tensor, mode: Literal["a", 1]) -> torch.Tensor:
        return x

    def no_return(x: torch.Tensor):
        return x

    def needs_fake(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x, x

    for fn, match in ((tensor_or_float, "'scale'"), (mixed_literal, "'mode'"), (no_return, "return"),
                      (needs_fake, "fake")):
        with pytest.raises(OpaqueError, match=match):
            opaque(fn)


class JitAndSplit(torch.nn.Module):
    """The JIT fixture's kernel (made opaque) and a split op (the toy's mixing op) in one model."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x, pos):
        h = scaled_add(self.a(x).contiguous(), pos[:, None].expand(-1, 16).contiguous(), 0.5)
        out = torch.empty_like(h)
        torch.ops.pg_toy.mix(h, out)
        return self.b(out)


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_opaque_jit_kernel_inside_piecegraph_compile_with_a_split_op(compiler):
    import toy  # noqa: F401 - registers the split op pg_toy::mix

    import piecegraph

    model = JitAndSplit().eval()
    graphed = piecegraph.compile(model, compiler=compiler, capture_sizes=(4, 8), emulate_graphs=True)
    for n in (3, 8, 5):
        x, pos = torch.randn(n, 16), torch.rand(n)
        with piecegraph.forward_context({"n": n}), torch.no_grad():
            torch.testing.assert_close(graphed(x, pos), model(x, pos))
    stats = graphed.stats()  # one fullgraph trace (a break would have failed it), cut at the split op
    assert stats["pieces"] == 2 and stats["split_ops"] == 1 and stats["recompiles"] == 0
    assert stats["sizes"] == [4, 8] and stats["replays"] == 1
