"""FlashInfer adapter on CPU: the fakes give the documented shapes, install() explains a missing FlashInfer, and
install() on a stand-in package shaped like FlashInfer 0.5.x makes its ops trace with zero graph breaks."""

import importlib.util
import inspect
import sys
import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from piecegraph.adapters import flashinfer as adapter
from piecegraph.ops.freeze import unfreeze

HAVE_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def fake(name, *args, **kwargs):
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        return adapter.fake_specs()[name].fake(*fake_args, **kwargs)


def test_spec_table_covers_the_serving_ops():
    specs = adapter.fake_specs()
    for name in ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm", "silu_and_mul",
                 "gelu_and_mul", "gelu_tanh_and_mul", "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids",
                 "apply_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache",
                 "apply_rope_with_cos_sin_cache_inplace", "fp4_quantize"):
        assert name in specs and specs[name].shape
    assert specs["fused_add_rmsnorm"].mutates == ("input", "residual")
    assert specs["apply_rope_with_cos_sin_cache_inplace"].mutates == ("query", "key")


@pytest.mark.parametrize("shape", [(7, 64), (7, 4, 64)])
def test_norm_fakes_are_like_input(shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    for name in ("rmsnorm", "gemma_rmsnorm"):
        out = fake(name, x, torch.empty(shape[-1]))
        assert out.shape == shape and out.dtype == torch.bfloat16
    assert fake("fused_add_rmsnorm", x, x, torch.empty(shape[-1])) is None


@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"])
def test_act_and_mul_fakes_halve_the_last_dim(name):
    out = fake(name, torch.empty(3, 5, 256, dtype=torch.float16))
    assert out.shape == (3, 5, 128) and out.dtype == torch.float16


def test_rope_fakes_are_like_q_and_k():
    q, k = torch.empty(9, 8, 64, dtype=torch.bfloat16), torch.empty(9, 2, 64, dtype=torch.bfloat16)
    qr, kr = fake("apply_rope_pos_ids", q, k, torch.zeros(9, dtype=torch.int32))
    assert qr.shape == q.shape and kr.shape == k.shape and qr.dtype == torch.bfloat16
    query, key = torch.empty(9, 512), torch.empty(9, 128)
    qo, ko = fake("apply_rope_with_cos_sin_cache", torch.zeros(9, dtype=torch.long), query, key, 64,
                  torch.empty(100, 64))
    assert qo.shape == (9, 512) and ko.shape == (9, 128)


@pytest.mark.parametrize(
    "m, k, kwargs, sf_shape",
    [
        (5, 256, {}, (128, 16)),  # swizzled 128x4: rows padded to 128
        (130, 256, {}, (256, 16)),
        (5, 256, {"is_sf_8x4_layout": True}, (8, 16)),  # 8x4: rows padded to 8
        (5, 256, {"is_sf_swizzled_layout": False}, (5, 16)),  # linear: no padding
        (5, 32, {}, (256, 2)),  # 128 * round_up(2, 4) bytes viewed as [-1, k/16] (FlashInfer 0.5.x)
        (5, 32, {"pad_sf_cols": True}, (128, 4)),  # newer releases view with padded columns
        (5, 256, {"sf_vec_size": 32, "sf_use_ue8m0": True}, (128, 8)),  # MXFP4
    ],
)
def test_fp4_quantize_fake_shapes(m, k, kwargs, sf_shape):
    x_q, sf = fake("fp4_quantize", torch.empty(m, k, dtype=torch.bfloat16), None, **kwargs)
    assert x_q.shape == (m, k // 2) and x_q.dtype == torch.uint8
    assert sf.shape == sf_shape and sf.dtype == torch.uint8


def test_fp4_quantize_fake_column_major_input():
    # [256, 64] column-major: quantized as its [64, 256] transpose, outputs transposed back
    x_q, sf = fake("fp4_quantize", torch.empty(64, 256, dtype=torch.bfloat16).t())
    assert x_q.shape == (128, 64) and x_q.stride() == (1, 128)
    assert sf.shape == (16, 128)


@pytest.mark.skipif(HAVE_FLASHINFER, reason="FlashInfer is installed here")
def test_install_without_flashinfer_says_how_to_get_it():
    with pytest.raises(ImportError, match=r"pip install piecegraph\[flashinfer\]"):
        adapter.install()


# A stand-in with FlashInfer's names, signatures and output shapes (0.5.x; fp4_quantize as 0.7 has it: a new
# argument before enable_pdl, backend "auto", a config object, a keyword-only flag), whose loaders stop Dynamo
# the same way.
STUB = {
    "norm.py": """
        import functools, os, tempfile, torch
        @functools.cache
        def get_norm_module():
            os.stat(tempfile.gettempdir())
            return "norm"
        def _rms(x, w, eps):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
        def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
            get_norm_module()
            out = torch.empty_like(input) if out is None else out
            out.copy_(_rms(input, weight, eps))
            return out
        def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
            get_norm_module()
            residual.add_(input)
            input.copy_(_rms(residual, weight, eps))
    """,
    "activation.py": """
        import functools, os, tempfile, torch
        @functools.cache
        def get_act_and_mul_module(name):
            os.stat(tempfile.gettempdir())
            return name
        def silu_and_mul(input, out: torch.Tensor = None, enable_pdl=None):
            get_act_and_mul_module("silu")
            d = input.shape[-1] // 2
            out = input.new_empty((*input.shape[:-1], d)) if out is None else out
            out.copy_(torch.nn.functional.silu(input[..., :d]) * input[..., d:])
            return out
    """,
    "fp4_quantization.py": """
        import functools, threading, torch
        @functools.cache
        def get_fp4_quantization_module(backend="100"):
            with threading.Lock():
                return backend
        class Config:
            pass
        def fp4_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False,
                         is_sf_swizzled_layout=True, is_sf_8x4_layout=False, is_global_scale_inversed=False,
                         enable_pdl=None, backend="auto", config: Config = Config(), *, batch_invariant=False):
            get_fp4_quantization_module()
            if batch_invariant and backend != "auto":
                raise ValueError("batch_invariant=True requires backend='auto'")
            k = input.shape[-1]; m = input.numel() // k
            scale = 0.25 if is_global_scale_inversed else 4
            x_q = (input.abs() * scale).clamp(max=255).to(torch.uint8)[..., : k // 2].contiguous()
            rows = 8 if is_sf_8x4_layout else 128
            size = ((m + rows - 1) // rows * rows) * ((k // sf_vec_size + 3) // 4 * 4)
            sf = torch.zeros(size if is_sf_swizzled_layout else m * k // sf_vec_size, dtype=torch.uint8)
            return x_q, sf.reshape((-1, k // sf_vec_size))
    """,
    "__init__.py": """
        from .norm import rmsnorm, fused_add_rmsnorm
        from .activation import silu_and_mul
        from .fp4_quantization import fp4_quantize
    """,
}


@pytest.fixture
def stub_flashinfer(tmp_path, monkeypatch):
    if HAVE_FLASHINFER:
        pytest.skip("a real FlashInfer is installed; the stand-in would shadow it")
    package = tmp_path / "flashinfer"
    package.mkdir()
    for name, source in STUB.items():
        (package / name).write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    import flashinfer

    yield flashinfer
    adapter.uninstall()
    unfreeze()
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        del sys.modules[name]


def model(x, residual, weight):
    import flashinfer

    h = flashinfer.rmsnorm(x, weight)
    flashinfer.fused_add_rmsnorm(h, residual, weight)
    act = flashinfer.silu_and_mul(torch.cat([h, h], dim=-1))
    q, sf = flashinfer.fp4_quantize(act)
    return act * 2, q, sf


def test_install_makes_the_stand_in_trace_with_zero_graph_breaks(stub_flashinfer):
    import flashinfer.norm

    x, res, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    with pytest.raises(Exception):  # noqa: B017  plain Dynamo stops at the loaders (its error types vary)
        torch.compile(model, fullgraph=True, backend="eager")(x, res.clone(), w)
    model(x, res.clone(), w)  # warm, as piecegraph.prewarm would
    done = adapter.install()
    assert {"rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "fp4_quantize"} <= set(done.ops)
    assert "gelu_and_mul" in done.missing and "flashinfer.norm.get_norm_module" in done.frozen
    assert flashinfer.rmsnorm is flashinfer.norm.rmsnorm and hasattr(flashinfer.rmsnorm, "__piecegraph_adapter__")
    assert adapter.install().ops == done.ops and flashinfer.rmsnorm is flashinfer.norm.rmsnorm  # idempotent

    res_eager, res_compiled = res.clone(), res.clone()
    expected = model(x, res_eager, w)
    assert torch._dynamo.explain(model)(x, res.clone(), w).graph_break_count == 0
    got = torch.compile(model, fullgraph=True, backend="eager")(x, res_compiled, w)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(res_compiled, res_eager)  # fused_add_rmsnorm's write to residual is kept


def test_out_argument_keeps_flashinfer_semantics(stub_flashinfer):
    adapter.install(freeze_probes=False)
    x = torch.randn(3, 32)
    out = torch.empty(3, 16)
    result = stub_flashinfer.silu_and_mul(x, out=out)
    assert result is out  # the adapter returns the caller's buffer, the op never aliases
    torch.testing.assert_close(out, torch.nn.functional.silu(x[:, :16]) * x[:, 16:])

    def f(a, buf):
        return stub_flashinfer.silu_and_mul(a, out=buf) + 1

    buf = torch.zeros(3, 16)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x, buf), out + 1)
    torch.testing.assert_close(buf, out)


def test_fakes_match_the_stand_in_outputs(stub_flashinfer):
    originals = {n: getattr(stub_flashinfer, n) for n in ("rmsnorm", "silu_and_mul", "fp4_quantize")}
    x = torch.randn(5, 64)
    for name, args in (("rmsnorm", (x, torch.randn(64))), ("silu_and_mul", (x,)), ("fp4_quantize", (x,))):
        real = originals[name](*args)
        faked = fake(name, *args)
        for r, f in zip(real if isinstance(real, tuple) else (real,), faked if isinstance(faked, tuple) else (faked,)):
            assert r.shape == f.shape and r.dtype == f.dtype, name


def test_uninstall_restores_the_originals(stub_flashinfer):
    original = stub_flashinfer.silu_and_mul
    adapter.install()
    assert stub_flashinfer.silu_and_mul is not original
    assert "silu_and_mul" in adapter.uninstall()
    assert stub_flashinfer.silu_and_mul is original and stub_flashinfer.activation.silu_and_mul is original


def test_adapters_take_the_installed_signature(stub_flashinfer):
    original = stub_flashinfer.fp4_quantize
    adapter.install(freeze_probes=False)
    adapted = stub_flashinfer.fp4_quantize
    params = inspect.signature(adapted).parameters
    assert list(params) == [n for n in inspect.signature(original).parameters if n != "config"]
    assert params["backend"].default == "auto"
    x = torch.randn(5, 64) * 8
    calls = [((x, None, 16, False, True, False, True), {}),  # is_global_scale_inversed=True, by position
             ((x,), {"batch_invariant": True}), ((x,), {"is_global_scale_inversed": True, "backend": "cuda"})]
    for args, kwargs in calls:
        for got, want in zip(adapted(*args, **kwargs), original(*args, **kwargs)):
            torch.testing.assert_close(got, want)
    compiled = torch.compile(lambda a: adapted(a, None, 16, False, True, False, True), fullgraph=True,
                             backend="eager")
    torch.testing.assert_close(compiled(x)[0], original(x, is_global_scale_inversed=True)[0])
    with pytest.raises(TypeError, match="config"):
        adapted(x, config=None)


def test_fp4_refusal_names_flashinfers_reason_and_passes_other_errors(stub_flashinfer, monkeypatch):
    assert adapter.fp4_refusal("cpu") is None  # the stand-in quantizes on any device

    def refuses(*args, **kwargs):
        raise RuntimeError("fp4_quantize requires SM100 or newer; got SM90")

    monkeypatch.setattr(stub_flashinfer, "fp4_quantize", refuses)
    assert adapter.fp4_refusal("cpu") == "fp4_quantize requires SM100 or newer; got SM90"
    monkeypatch.setattr(stub_flashinfer, "fp4_quantize", lambda *a: torch.ones(2) + torch.ones(3))
    with pytest.raises(RuntimeError, match="size of tensor"):
        adapter.fp4_refusal("cpu")
