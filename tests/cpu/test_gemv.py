"""piecegraph.models.gemv on CPU: the small_linear op is F.linear there, traces as one node under torch.compile
(fullgraph, dynamic), SmallBatchLinear shares its Linear's parameters (tied weights stay tied), and
use_small_batch_kernels leaves CPU float32 models alone. The Triton kernel's logic is checked against a float64
product where Triton imports and runs (CUDA, or ``TRITON_INTERPRET=1`` on CPU tensors); CI has no Triton."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from triton_device import kernel_device

from piecegraph.models import gemv


class Tiny(nn.Module):
    """Embedding, two projections named as a decoder's, and a tied lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.q_proj = nn.Linear(16, 24, bias=True)
        self.down_proj = nn.Linear(24, 16, bias=False)
        self.lm_head = nn.Linear(16, 50, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.down_proj(torch.relu(self.q_proj(self.embed(ids)))))


@pytest.mark.parametrize("bias", [False, True])
def test_the_op_is_f_linear_on_cpu(bias):
    torch.manual_seed(0)
    x, w = torch.randn(3, 20), torch.randn(7, 20)
    b = torch.randn(7) if bias else None
    for kernel in gemv.KERNELS:
        assert torch.equal(gemv.small_linear(x, w, b, kernel), F.linear(x, w, b))
    assert gemv.pick_kernel(x, w, b, "triton") == "cublas"  # the kernel does not apply off CUDA: F.linear
    with pytest.raises(RuntimeError, match="size|shape"):  # a mismatch is torch's own error, never a wrong output
        gemv.small_linear(x, torch.randn(7, 19), b)


def test_a_wrong_kernel_name_is_refused_by_name(monkeypatch):
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with pytest.raises(ValueError, match="kernel='cuda'"):
        gemv.small_linear(x, w, None, "cuda")
    monkeypatch.setenv(gemv.ENV, "fast")
    with pytest.raises(ValueError, match=gemv.ENV):
        gemv.small_linear(x, w)
    with pytest.raises(ValueError, match="kernel='cuda'"):
        gemv.SmallBatchLinear.from_linear(nn.Linear(4, 3), kernel="cuda")


def test_the_op_traces_as_one_node_with_a_dynamic_row_count():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x, w, b):
        return gemv.small_linear(x, w, b) * 2

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    torch.manual_seed(0)
    w, b = torch.randn(5, 12), torch.randn(5)
    for rows in (2, 3, 7):
        x = torch.randn(rows, 12)
        assert torch.equal(compiled(x, w, b), F.linear(x, w, b) * 2)
    assert len(graphs) == 1  # one trace serves every row count
    op = torch.ops.piecegraph_models.small_linear
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and n.target in (op, op.default)]
    assert len(calls) == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])  # inductor: the op's lowering (an extern kernel)
def test_a_model_with_small_batch_linears_compiles_whole(backend):
    torch.manual_seed(0)
    model = gemv.use_small_batch_kernels(Tiny(), require_cuda_half=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for length in (3, 5):
            ids = torch.randint(0, 50, (2, length))
            assert torch.equal(compiled(ids), model(ids))
    torch._dynamo.reset()


def test_small_batch_linear_shares_parameters_and_equals_the_linear():
    torch.manual_seed(0)
    linear = nn.Linear(8, 6)
    small = gemv.SmallBatchLinear.from_linear(linear)
    assert small.weight is linear.weight and small.bias is linear.bias
    assert small.weight.data_ptr() == linear.weight.data_ptr()
    assert isinstance(small, nn.Linear) and (small.in_features, small.out_features) == (8, 6)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        assert torch.equal(small(x), linear(x))  # leading dims flattened to rows and restored
    x.requires_grad_(True)
    small(x).square().sum().backward()  # with gradients wanted: F.linear, which has a backward
    ref = x.detach().clone().requires_grad_(True)
    F.linear(ref, linear.weight, linear.bias).square().sum().backward()
    assert torch.equal(x.grad, ref.grad)
    assert gemv.SmallBatchLinear.from_linear(nn.Linear(8, 6, bias=False)).bias is None


def test_use_small_batch_kernels_is_a_no_op_on_cpu_float32_and_without_the_names():
    torch.manual_seed(0)
    model = Tiny()
    before = dict(model.named_modules())
    assert gemv.use_small_batch_kernels(model) is model
    assert dict(model.named_modules()) == before and type(model.q_proj) is nn.Linear
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # children "0", "1": no default name
    kept = list(seq)
    gemv.use_small_batch_kernels(seq, require_cuda_half=False)
    assert list(seq) == kept


def test_replacing_keeps_tied_weights_and_outputs():
    torch.manual_seed(0)
    model = Tiny()
    ids = torch.tensor([[1, 4, 9], [3, 3, 0]])
    with torch.no_grad():
        want = model(ids)
        gemv.use_small_batch_kernels(model, require_cuda_half=False)
        got = model(ids)
    assert type(model.q_proj) is gemv.SmallBatchLinear and type(model.lm_head) is gemv.SmallBatchLinear
    assert model.lm_head.weight is model.embed.weight  # tied: one Parameter
    assert len(list(model.parameters())) == 4  # embed (= lm_head), q weight and bias, down weight
    assert torch.equal(got, want)
    gemv.use_small_batch_kernels(model, require_cuda_half=False)  # again: SmallBatchLinear is no exact nn.Linear
    assert type(model.q_proj) is gemv.SmallBatchLinear
    only = Tiny()
    gemv.use_small_batch_kernels(only, names=["down_proj"], require_cuda_half=False)
    assert type(only.down_proj) is gemv.SmallBatchLinear and type(only.q_proj) is nn.Linear
    with pytest.raises(TypeError, match="collection"):
        gemv.use_small_batch_kernels(only, names="q_proj")


# ------------------------------------------------------------------------------------------- the Triton kernel
def test_every_row_bucket_keeps_configs_whose_tiles_share_one_layout():
    configs = [SimpleNamespace(kwargs={"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
               for n, k, w, s in gemv.CONFIGS]
    assert [gemv.row_bucket(r) for r in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
    for rows in (1, 2, 4, 8, 16):
        kept = gemv._prune(configs, {}, BLOCK_M=rows)
        assert kept, rows
        for c in kept:
            if rows < 16:  # lanes: 16 bytes a thread per weight row, at most 64 float32 lanes a thread
                assert c.kwargs["BLOCK_K"] == 256 * c.num_warps and rows * c.kwargs["BLOCK_N"] * 8 <= 64
            else:  # tl.dot needs 16 on every side
                assert c.kwargs["BLOCK_N"] >= 16 and c.kwargs["BLOCK_K"] >= 16


def _check_kernel(rows, dtype, device, config, n=37, k=83):
    """The kernel against a float64 product at ``n``, ``k`` not multiples of any block, with and without bias."""
    if device == "cpu" and dtype == torch.bfloat16 and rows == 16 and (config is None or config[0] >= 16):
        return  # the interpreter's tl.dot multiplies bfloat16's raw bits (checked on CUDA)
    gen = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(*s, generator=gen).to(dtype).to(device) for s in ((rows, k), (n, k), (n,)))
    for bias in (None, b):
        got = gemv.triton_linear(x, w, bias, config=config)
        assert got.dtype == dtype and got.shape == (rows, n)
        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
        size = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
        # one rounding to the output dtype (the interpreter truncates to bfloat16: a whole ulp) after a float32 sum
        bits = {torch.float16: 10, torch.bfloat16: 7}[dtype]
        excess = ((got.double() - want).abs() - 2.0**-bits * want.abs() - 2.0**-20 * size).max().item()
        assert excess <= 0, f"{config} at {rows} rows, bias {bias is not None}: beyond the bound by {excess:.3g}"


# (BLOCK_N, BLOCK_K, num_warps, num_stages), blocks smaller than the shape (several K steps, masked tails); (16, 32,
# ...) at 16 rows is tl.dot
SMALL_CONFIGS = [(4, 32, 4, 1), (16, 32, 4, 1), (8, 64, 4, 2)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_triton_kernel_equals_a_float64_product(rows, dtype):
    device = kernel_device()
    for config in SMALL_CONFIGS:
        _check_kernel(rows, dtype, device, config)
    configs = [SimpleNamespace(kwargs={"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w, _ in gemv.CONFIGS]
    kept = {(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps) for c in gemv._prune(configs, {}, BLOCK_M=rows)}
    for config in gemv.CONFIGS:  # every config the autotuner may pick for this row bucket
        if config[:3] in kept:
            _check_kernel(rows, dtype, device, config)


def test_the_autotuned_launch_equals_a_float64_product(monkeypatch):
    device = kernel_device()
    if device == "cpu":  # the interpreter cannot time: a stand-in timer that runs each config (the first wins)
        timings = []

        def bench(kernel_call, quantiles):
            kernel_call()
            timings.append(len(timings))
            return [float(len(timings))] * 3

        monkeypatch.setattr(gemv._kernels()[1], "_do_bench", bench)
    for rows in (1, 3, 16):
        _check_kernel(rows, torch.float16, device, None)


def test_the_triton_launcher_refuses_what_it_cannot_run():
    x, w = torch.randn(17, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="17 rows"):
        gemv.triton_linear(x, w)
    with pytest.raises(ValueError, match="bias"):
        gemv.triton_linear(x[:2], w, torch.randn(5))
    with pytest.raises(ValueError, match="contiguous"):
        gemv.triton_linear(x[:2], torch.randn(8, 4).T)


def test_an_engine_on_small_batch_linears_warms_its_lm_head_per_row_bucket_and_serves_the_same_tokens(monkeypatch):
    """The engine calls the LM head once per row bucket at start (1, 2, 4 rows for max_num_seqs 4: where the
    kernel choice is measured on CUDA), and a decoder on small-batch linears serves the tokens of the plain one."""
    from piecegraph.models import TINY, Decoder, fuse_projections
    from piecegraph.serve.config import EngineConfig
    from piecegraph.serve.engine import Engine
    from piecegraph.serve.request import SamplingParams

    config = EngineConfig(mode="eager", max_num_seqs=4, max_seq_len=64, attention_backend="torch")
    prompts, params = [[3, 5, 7, 9], [11, 2], [4] * 9], SamplingParams(max_new_tokens=6)
    plain = Engine(fuse_projections(Decoder.random(TINY, seed=3)), config).generate(prompts, params)
    model = gemv.use_small_batch_kernels(fuse_projections(Decoder.random(TINY, seed=3)), require_cuda_half=False)
    assert isinstance(model.lm_head, gemv.SmallBatchLinear)
    rows = []
    original = model.logits
    monkeypatch.setattr(model, "logits", lambda hidden: (rows.append(hidden.shape[0]), original(hidden))[1])
    engine = Engine(model, config)
    assert rows == [1, 2, 4]
    assert engine.generate(prompts, params) == plain


def test_a_triton_product_off_by_more_than_rounding_is_reported_so_it_is_never_chosen(monkeypatch):
    """The measurement's correctness check: the kernel's product within bf16 rounding of the float32 one passes;
    one that drops a K block (what a wrong mask would do) is named, so the measured choice keeps cuBLAS."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 96, generator=gen).to(torch.bfloat16)
    weight = torch.randn(40, 96, generator=gen).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16)

    def rounded(x, w, b=None):  # the right product, rounded to the kernel's output dtype
        return F.linear(x.float(), w.float(), b.float()).to(x.dtype)

    def dropped_block(x, w, b=None):
        return F.linear(x[:, :64].float(), w[:, :64].float(), b.float()).to(x.dtype)

    monkeypatch.setattr(gemv, "triton_linear", rounded)
    assert gemv._mismatch(rows, weight, bias) == ""
    monkeypatch.setattr(gemv, "triton_linear", dropped_block)
    assert "cuBLAS kept" in gemv._mismatch(rows, weight, bias)
