"""The pieces are compiled from fake values propagated under the Python dispatcher, as Dynamo and AOTAutograd
propagate them. Without it, a C++ composite kernel may read concrete sizes: torch 2.11's ``matmul`` did, in
transformers' rotary embedding, which pinned the token count of a Hugging Face Qwen2 to its first call's and
failed piecewise mode with a ConstraintViolationError on the H200. ``pg_fakeprobe::rows`` behaves like such a
kernel: its fake reads the concrete row count unless the Python dispatcher is on."""

from __future__ import annotations

import pytest
import torch
from toy import ToyModel

import piecegraph

_lib = torch.library.Library("pg_fakeprobe", "DEF")
_lib.define("rows(Tensor x) -> Tensor")
_lib.impl("rows", lambda x: x * 2.0, "CompositeExplicitAutograd")


def _rows_fake(x: torch.Tensor) -> torch.Tensor:
    if not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher):
        int(x.shape[0])  # what a C++ kernel calling sizes() does to a symbolic size: it specialises it
    return torch.empty_like(x)


_lib._register_fake("rows", _rows_fake)


class _ProbedToy(ToyModel):
    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.ops.pg_fakeprobe.rows(x), pos)


@pytest.mark.parametrize("mode", ["none", "piecewise"])
def test_a_kernel_reading_sizes_without_the_python_dispatcher_keeps_the_token_count_symbolic(mode):
    model = _ProbedToy().eval()
    graphed = piecegraph.compile(model, mode=mode, compiler="eager", capture_sizes=(4, 8, 16),
                                 emulate_graphs=True)
    for n in (7, 3, 16, 11):
        x, pos = torch.randn(n, 16), torch.arange(n)
        with torch.no_grad(), piecegraph.forward_context({"n": n}):
            want = model(x, pos)
            got = graphed(x, pos)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert graphed.stats()["recompiles"] == 0
