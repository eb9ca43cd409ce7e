"""Ops that mix rows over the token dimension: found in the trace, named with their source
line, and never run on padded rows: graphs only for exact capture sizes (or refused), equal to eager at every
token count; ``verify`` compares against the unpadded run, so it catches what detection is told to ignore."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.models import TINY, Decoder, dummy_inputs
from piecegraph.trace.mixing import find_token_mixing

SIZES = (4, 8, 16)
MIXING = {  # name -> (forward on x [T, 16], the op the finding must name)
    "mean_over_tokens": (lambda x: x - x.mean(0, keepdim=True), "mean"),
    "sum_scalar": (lambda x: x * x.sum(), "sum"),
    "softmax_over_tokens": (lambda x: torch.softmax(x, dim=0), "softmax"),
    "cumsum_over_tokens": (lambda x: x.cumsum(0), "cumsum"),
    "self_attention_in_graph": (lambda x: torch.softmax(x @ x.T, -1) @ x, "matmul"),
    "sdpa_over_tokens": (lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None])[0],
                         "scaled_dot_product_attention"),
    "conv_over_tokens": (lambda x: F.conv1d(x.T[None], torch.ones(16, 16, 3) / 48, padding=1)[0].T, "conv1d"),
    "flip": (lambda x: x.flip(0) + x, "flip"),
    "last_row": (lambda x: x + x[-1], "getitem"),
    "gram": (lambda x: x @ (x.T @ x), "matmul"),
    "einsum_over_tokens": (lambda x: x * torch.einsum("td,td->d", x, x), "einsum"),
    "cat_tokens": (lambda x: torch.cat([x, x], 0)[: x.shape[0]] * 2, "cat"),
    "sum_of_flattened": (lambda x: x * x.reshape(-1).sum(), "sum"),
    "repeat_tokens": (lambda x: x.repeat(2, 1)[1:].view(-1)[: x.numel()].view(x.shape), "repeat"),
    # writes at per-token row indices: a pad row's index can name a real row
    "index_copy_rows": (lambda x: x.clone().index_copy_(0, (x[:, 0] > 0).long(), x * 2), "index_copy_"),
    "index_add_rows": (lambda x: torch.zeros_like(x).index_add_(0, (x[:, 0] > 0).long(), x), "index_add_"),
    "scatter_add_rows": (lambda x: torch.zeros_like(x).scatter_add_(0, (x > 0).long(), x), "scatter_add_"),
    "setitem_rows": (lambda x: _set_rows(x.clone(), (x[:, 0] > 0).long(), x), "setitem"),
}


def _set_rows(y, index, value):
    y[index] = value
    return y


def _set_masked(y, mask):
    y[mask] = 0.0
    return y

TOKEN_WISE = {
    "softmax_last": lambda x: torch.softmax(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, (16,)),
    "sum_features": lambda x: x * x.sum(-1, keepdim=True),
    "first_row": lambda x: x + x[0],
    "matmul_weights": lambda x: x @ torch.ones(16, 16),
    "einsum_per_token": lambda x: torch.einsum("td,de->te", x, torch.ones(16, 16)),
    "reshape_heads": lambda x: (x.view(x.shape[0], 4, 4).softmax(-1)).reshape(x.shape[0], 16),
    "flatten_rows": lambda x: (x.reshape(-1) * 2).view(x.shape[0], 16),
    "index_copy_features": lambda x: x.clone().index_copy_(1, torch.arange(16).flip(0), x),
    "masked_rows_in_place": lambda x: _set_masked(x.clone(), x > 0),
}


class _Net(torch.nn.Module):
    def __init__(self, body):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.body = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), body

    def forward(self, x):
        return self.b(self.body(self.a(x)))


def _findings(body) -> list:
    found = []

    def backend(gm, example_inputs):
        fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        symbols = {t.shape[0].node.expr for t in fakes if isinstance(t, torch.Tensor) and t.dim() > 0
                   and isinstance(t.shape[0], torch.SymInt)}
        assert symbols
        found.extend(find_token_mixing(gm, symbols))
        return gm

    torch._dynamo.reset()
    x = torch.randn(5, 16)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(_Net(body), backend=backend, fullgraph=True)(x)
    return found


@pytest.mark.parametrize("name", sorted(MIXING))
def test_each_mixing_op_is_found_with_its_source_line(name):
    body, op = MIXING[name]
    found = _findings(body)
    assert found, f"{name}: nothing found"
    assert any(f.op == op for f in found), [str(f) for f in found]
    assert any("test_token_mixing.py:" in f.where for f in found), [f.where for f in found]


@pytest.mark.parametrize("name", sorted(TOKEN_WISE))
def test_token_wise_ops_are_not_flagged(name):
    assert _findings(TOKEN_WISE[name]) == []


def test_the_reference_decoder_is_token_wise():
    model = Decoder.random(TINY)
    cache = KVCache.for_sequences(TINY, 2, 64)
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    args, meta = dummy_inputs(model, cache, 5)
    with piecegraph.forward_context(meta):
        graphed(*args)
    assert graphed.stats()["token_mixing"] == []


@pytest.mark.parametrize("mode", ["piecewise", "full"])
@pytest.mark.parametrize("name", ["mean_over_tokens", "self_attention_in_graph", "conv_over_tokens"])
def test_mixing_models_equal_eager_at_every_token_count(mode, name):
    model = _Net(MIXING[name][0]).eval()
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=SIZES, emulate_graphs=True)
    with pytest.warns(UserWarning, match="mixes rows over the token dimension"):
        graphed(torch.randn(3, 16))
    for n in (1, 3, 4, 5, 8, 11, 16, 20):
        x = torch.randn(n, 16)
        with torch.no_grad():
            torch.testing.assert_close(graphed(x), model(x), rtol=1e-5, atol=1e-5)
    stats = graphed.stats()
    assert stats["token_mixing"] and stats["sizes"] == [4, 8, 16]  # exact sizes still replay graphs


def test_token_mixing_error_refuses_naming_the_op():
    model = _Net(MIXING["mean_over_tokens"][0])
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=SIZES, emulate_graphs=True,
                                 token_mixing="error")
    with pytest.raises(Exception, match=r"mean at test_token_mixing.py:\d+ \(reduces over the token dimension\)"):
        graphed(torch.randn(3, 16))


def test_verify_compares_with_the_unpadded_run():
    """Told to pad anyway, ``verify`` still sees the difference and drops the size: the answer stays right."""
    model = _Net(MIXING["mean_over_tokens"][0]).eval()
    graphed = piecegraph.compile(model, compiler="eager", capture_sizes=SIZES, emulate_graphs=True,
                                 token_mixing="pad", verify=True)
    graphed(torch.randn(3, 16))
    x = torch.randn(5, 16)
    with pytest.warns(UserWarning, match="without padding"):
        got = graphed(x)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    assert 8 in graphed.stats()["dropped_sizes"]


def test_the_torch_compile_backend_runs_mixing_models_right():
    torch._dynamo.reset()
    model = _Net(MIXING["softmax_over_tokens"][0]).eval()
    compiled = torch.compile(model, backend="piecegraph", dynamic=True,
                             options={"compiler": "eager", "capture_sizes": SIZES, "emulate_graphs": True})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (3, 4, 6, 16):
            x = torch.randn(n, 16)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
