"""FlashInfer adapter: its serving ops become opaque custom ops with correct fakes; its warm probes are frozen.

Measured with FlashInfer 0.5.3 and torch 2.11 after a warm-up: ``rmsnorm`` and ``silu_and_mul`` stop Dynamo at
``posix.stat`` inside their module loader, ``fp4_quantize`` at the lock of ``subprocess.check_output([nvcc,
"--version"])`` and then at the tvm-ffi kernel call. ``install()`` wraps each public entry (loader and kernel
together) into one op and rebinds it where users find it (``flashinfer.X``, ``flashinfer.norm.X``, and any module
that imported it by name).

The ops never return an alias of an input: a function with ``out=`` becomes two ops, a functional one (new
output) and an ``out`` variant that mutates ``out`` and returns nothing; the Python adapter picks one and
returns ``out`` itself, exactly as FlashInfer does. Shapes follow FlashInfer 0.5.x (see :func:`fake_specs`);
each adapter takes the installed function's parameters, in its order and with its defaults, so calls mean the same
across releases (0.7 moved ``fp4_quantize``'s ``enable_pdl`` back a place and made ``backend`` default to "auto").
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

import torch

from piecegraph.ops.freeze import freeze_package, replace_everywhere
from piecegraph.ops.opaque import opaque
from piecegraph.ops.signature import hints_of, schema_type

__all__ = ["install", "uninstall", "fake_specs", "fp4_refusal", "OpSpec", "Installed", "NAMESPACE"]

log = logging.getLogger(__name__)
NAMESPACE = "piecegraph_flashinfer"
_HINT = "pip install piecegraph[flashinfer]"
_MARK = "__piecegraph_adapter__"
T, OT, OB = torch.Tensor, Optional[torch.Tensor], Optional[bool]
_REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class P:
    """One parameter of an adapted function: name, type, default (``_REQUIRED`` for none)."""

    name: str
    type: Any
    default: Any = _REQUIRED


@dataclass(frozen=True)
class OpSpec:
    """How one FlashInfer function is adapted.

    ``kind``: ``"out"`` (returns a new tensor or writes ``out=``), ``"functional"`` (returns new tensors) or
    ``"inplace"`` (writes ``mutates``, returns None). ``fake`` has the public signature and gives the outputs
    FlashInfer documents (``shape`` says it in words).
    """

    name: str
    module: str  # the flashinfer submodule that defines it
    params: tuple
    kind: str
    fake: Callable
    shape: str
    mutates: tuple = ()
    returns: Any = T


def _round_up(x: Any, m: int) -> Any:
    return (x + m - 1) // m * m


# ----------------------------------------------------------------------------- fakes (the documented shapes)
def fake_like_input(input: T, *args: Any, **kwargs: Any) -> T:
    """rmsnorm, gemma_rmsnorm, layernorm: like ``input`` (2D or 3D)."""
    return torch.empty_like(input)


def fake_none(*args: Any, **kwargs: Any) -> None:
    """In-place ops: nothing new."""
    return None


def fake_act_and_mul(input: T, *args: Any, **kwargs: Any) -> T:
    """silu/gelu/gelu_tanh_and_mul: ``[..., 2d] -> [..., d]``, dtype of ``input``."""
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


def fake_rope(q: T, k: T, *args: Any, **kwargs: Any) -> Tuple[T, T]:
    """apply_rope / apply_rope_pos_ids / apply_llama31_rope*: ``(like q, like k)``."""
    return torch.empty_like(q), torch.empty_like(k)


def fake_rope_cos_sin(positions: T, query: T, key: T, *args: Any, **kwargs: Any) -> Tuple[T, T]:
    """apply_rope_with_cos_sin_cache: ``(like query, like key)``."""
    return torch.empty_like(query), torch.empty_like(key)


def fake_fp4_quantize(input: T, global_scale: OT = None, sf_vec_size: int = 16, sf_use_ue8m0: bool = False,
                      is_sf_swizzled_layout: bool = True, is_sf_8x4_layout: bool = False, enable_pdl: OB = None,
                      backend: str = "cuda", *, pad_sf_cols: bool = False, **newer: Any) -> Tuple[T, T]:
    """fp4_quantize: ``(packed uint8 [..., k/2], scale factors uint8)``, mirroring FlashInfer 0.5.x.

    Scale factors: swizzled -> ``round_up(m, 128 or 8 for 8x4) * round_up(k/sf_vec_size, 4)`` bytes viewed as
    ``[-1, k/sf_vec_size]`` (``pad_sf_cols``: ``[-1, round_up(k/sf_vec_size, 4)]``, newer releases); linear ->
    ``[m, k/sf_vec_size]``. A column-major input (``stride(-2) == 1``) is quantized transposed and both outputs
    are transposed back, as FlashInfer does. Arguments of newer releases (``newer``) do not change the shapes.
    """
    column_major = input.stride(-2) == 1
    if column_major:
        input = input.transpose(-2, -1)
    k = input.shape[-1]
    m = input.numel() // k
    cols = k // sf_vec_size
    x_q = input.new_empty((*input.shape[:-1], k // 2), dtype=torch.uint8)
    if is_sf_swizzled_layout:
        size = _round_up(m, 8 if is_sf_8x4_layout else 128) * _round_up(cols, 4)
        width = _round_up(cols, 4) if pad_sf_cols else cols
    else:
        size, width = m * cols, cols
    sf = input.new_empty((size // width, width), dtype=torch.uint8)
    if column_major:
        x_q, sf = x_q.transpose(-2, -1), sf.transpose(-2, -1)
    return x_q, sf


# ---------------------------------------------------------------------------------------------- the op table
_NORM = (P("input", T), P("weight", T), P("eps", float, 1e-6), P("out", OT, None), P("enable_pdl", OB, None))
_FUSED = (P("input", T), P("residual", T), P("weight", T), P("eps", float, 1e-6), P("enable_pdl", OB, None))
_ACT = (P("input", T), P("out", OT, None), P("enable_pdl", OB, None))
_TAIL = (P("rotary_dim", Optional[int], None), P("interleave", bool, False))
_ROPE_TAIL = _TAIL + (P("rope_scale", float, 1.0), P("rope_theta", float, 1e4))
_LLAMA_TAIL = _TAIL + (P("rope_scale", float, 8.0), P("rope_theta", float, 5e5), P("low_freq_factor", float, 1.0),
                       P("high_freq_factor", float, 4.0), P("old_context_len", int, 8192))
_INDPTR = (P("q", T), P("k", T), P("indptr", T), P("offsets", T))
_POS = (P("q", T), P("k", T), P("pos_ids", T))
_COS_SIN = (P("positions", T), P("query", T), P("key", T), P("head_size", int), P("cos_sin_cache", T),
            P("is_neox", bool, True))
_FP4 = (P("input", T), P("global_scale", OT, None), P("sf_vec_size", int, 16), P("sf_use_ue8m0", bool, False),
        P("is_sf_swizzled_layout", bool, True), P("is_sf_8x4_layout", bool, False), P("enable_pdl", OB, None),
        P("backend", str, "cuda"))
_QK = "(like q, like k)"


def _rope_specs() -> list[OpSpec]:
    specs = []
    for name, params in (("apply_rope", _INDPTR + _ROPE_TAIL), ("apply_rope_pos_ids", _POS + _ROPE_TAIL),
                         ("apply_llama31_rope", _INDPTR + _LLAMA_TAIL),
                         ("apply_llama31_rope_pos_ids", _POS + _LLAMA_TAIL)):
        specs.append(OpSpec(name, "rope", params, "functional", fake_rope, _QK, returns=Tuple[T, T]))
        specs.append(OpSpec(name + "_inplace", "rope", params, "inplace", fake_none, "writes q, k", ("q", "k"), None))
    specs.append(OpSpec("apply_rope_with_cos_sin_cache", "rope", _COS_SIN, "functional", fake_rope_cos_sin,
                        "(like query, like key)", returns=Tuple[T, T]))
    specs.append(OpSpec("apply_rope_with_cos_sin_cache_inplace", "rope", _COS_SIN, "inplace", fake_none,
                        "writes query, key", ("query", "key"), None))
    return specs


def _all_specs() -> list[OpSpec]:
    like = "like input"
    half = "[..., 2d] -> [..., d], dtype of input"
    fused = "writes input (normed) and residual (input + residual)"
    return [
        OpSpec("rmsnorm", "norm", _NORM, "out", fake_like_input, like),
        OpSpec("gemma_rmsnorm", "norm", _NORM, "out", fake_like_input, like),
        OpSpec("fused_add_rmsnorm", "norm", _FUSED, "inplace", fake_none, fused, ("input", "residual"), None),
        OpSpec("gemma_fused_add_rmsnorm", "norm", _FUSED, "inplace", fake_none, fused, ("input", "residual"), None),
        OpSpec("layernorm", "norm", (P("input", T), P("gemma", T), P("beta", T), P("eps", float, 1e-6)),
               "functional", fake_like_input, like),
        OpSpec("silu_and_mul", "activation", _ACT, "out", fake_act_and_mul, half),
        OpSpec("gelu_and_mul", "activation", _ACT, "out", fake_act_and_mul, half),
        OpSpec("gelu_tanh_and_mul", "activation", _ACT, "out", fake_act_and_mul, half),
        *_rope_specs(),
        OpSpec("fp4_quantize", "fp4_quantization", _FP4, "functional", fake_fp4_quantize,
               "(uint8 [..., k/2], uint8 scale factors, swizzled: [round_up(m, 128) * round_up(k/16, 4) / (k/16), "
               "k/16])", returns=Tuple[T, T]),
    ]


def fake_specs() -> dict[str, OpSpec]:
    """The adapted ops by name, each with its fake (public signature) and documented shape. Needs no FlashInfer."""
    return {s.name: s for s in _all_specs()}


# ---------------------------------------------------------------------------------------------------- install
_MODULES = {
    "norm": ("flashinfer.norm",),
    "activation": ("flashinfer.activation",),
    "rope": ("flashinfer.rope",),
    "fp4_quantization": ("flashinfer.fp4_quantization", "flashinfer.quantization.fp4_quantization",
                         "flashinfer.quantization"),
}
# The adapter registry: id(original) -> adapter (built once per original, so ops are defined once), and the
# adapters in place now (name -> (original, adapter)) for idempotent install() and exact uninstall().
_STATE: dict[str, dict] = {"built": {}, "active": {}}


@dataclass
class Installed:
    """What :func:`install` did: ops adapted, names absent from this FlashInfer, probes and loaders frozen."""

    ops: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)


def _import_flashinfer() -> Any:
    if importlib.util.find_spec("flashinfer") is None:
        raise ImportError(f"piecegraph.adapters.flashinfer needs FlashInfer, which is not installed: {_HINT}")
    try:
        return importlib.import_module("flashinfer")
    except Exception as err:
        raise ImportError(f"FlashInfer is installed but failed to import ({type(err).__name__}: {err}); "
                          f"check that it matches this torch and CUDA ({_HINT})") from err


def _original(spec: OpSpec) -> Optional[Callable]:
    """The FlashInfer function ``spec`` adapts (looked up in its defining module, then ``flashinfer``)."""
    active = _STATE["active"].get(spec.name)
    if active is not None:
        return active[0]
    for mod_name in _MODULES[spec.module] + ("flashinfer",):
        try:
            fn = getattr(importlib.import_module(mod_name), spec.name, None)
        except Exception:  # a submodule that this version lacks or cannot import here
            continue
        if callable(fn) and not hasattr(fn, _MARK):
            return fn
    return None


def _typed(fn: Callable, params: tuple, ret: Any, name: str) -> Callable:
    """Give ``fn(*args)`` the declared signature and hints that opaque() reads."""
    fn.__signature__ = inspect.Signature(
        [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=p.default, annotation=p.type)
         for p in params], return_annotation=ret)
    fn.__annotations__ = {**{p.name: p.type for p in params}, "return": ret}
    fn.__name__ = fn.__qualname__ = name
    return fn


def _installed_params(spec: OpSpec, orig: Callable) -> tuple:
    """The adapter's parameters: the installed function's, in its order and with its defaults.

    Types come from the spec for the names it knows (it knows that ``out: Tensor = None`` is optional), else from
    the installed hints. A parameter no op schema can express (a config object) is left out when it has a
    default, which the original then keeps (passing it is a TypeError), and makes the op unadaptable when it has
    none. A signature hidden behind ``*args, **kwargs`` falls back to the spec's parameters.
    """
    installed = inspect.signature(orig).parameters.values()
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in installed):
        return spec.params
    known, hints, params = {p.name: p for p in spec.params}, hints_of(inspect.unwrap(orig)), []
    for p in installed:
        tp = known[p.name].type if p.name in known else schema_type(p, hints)
        default = _REQUIRED if p.default is p.empty else p.default
        if tp is None and default is _REQUIRED:
            raise LookupError(f"this FlashInfer's {spec.name} needs {p.name!r}, which no op schema can express")
        if tp is not None:
            params.append(P(p.name, tp, default))
    names = {p.name for p in params}
    lacking = [n for n in spec.mutates + (("out",) if spec.kind == "out" else ()) if n not in names]
    if lacking:
        raise LookupError(f"this FlashInfer's {spec.name} has no argument {lacking[0]!r}")
    return tuple(params)


def _caller(orig: Callable, params: tuple, name: str, fixed: tuple = (), fresh: bool = False) -> Callable:
    """``def name(p1, p2, ...): return orig(p1=p1, p2=p2, ...)`` plus the ``fixed`` keywords (``"out=None"``),
    generated: one frame, no argument packing.

    ``fresh``: FlashInfer allocates every tensor it returns, so opaque() may skip its alias check.
    """
    names = [p.name for p in params]
    if not all(n.isidentifier() for n in names):
        raise LookupError(f"this FlashInfer's {name} has parameter names that are not identifiers: {names}")
    passed = ", ".join([f"{n}={n}" for n in names] + list(fixed))
    scope: dict[str, Any] = {"_orig": orig}
    src = f"def {name}({', '.join(names)}):\n    return _orig({passed})\n"
    exec(compile(src, f"<piecegraph flashinfer {name}>", "exec"), scope)  # noqa: S102 - identifiers only
    call = scope[name]
    call.__piecegraph_fresh_outputs__ = fresh
    return call


def _op_name(base: str) -> str:
    name, n = base, 1
    while hasattr(getattr(torch.ops, NAMESPACE), name):  # a reloaded FlashInfer gets fresh op names
        n += 1
        name = f"{base}_v{n}"
    return f"{NAMESPACE}::{name}"


def _spec_fake(spec: OpSpec, orig: Callable) -> Callable:
    if spec.name != "fp4_quantize":
        return spec.fake
    try:  # newer releases view swizzled scale factors with padded columns
        pad = "round_up(input.shape[-1] // sf_vec_size, 4)" in inspect.getsource(inspect.unwrap(orig))
    except (OSError, TypeError):
        pad = False
    return lambda *a, **kw: fake_fp4_quantize(*a, pad_sf_cols=pad, **kw)


def _build(spec: OpSpec, orig: Callable, params: tuple) -> Callable:
    """The drop-in adapter for ``orig``: one opaque op, or for ``out=`` functions a functional op + out op."""
    fake = _spec_fake(spec, orig)
    if spec.kind != "out":
        names = [p.name for p in params]
        impl = _typed(_caller(orig, params, spec.name, fresh=spec.kind == "functional"), params, spec.returns,
                      spec.name)
        op_fake = (lambda *a: fake(**dict(zip(names, a)))) if spec.kind == "functional" else None
        return opaque(impl, fake=op_fake, mutates=spec.mutates, name=_op_name(spec.name))
    func_params = tuple(p for p in params if p.name != "out")
    into_params = tuple(P(p.name, T if p.name == "out" else p.type) for p in params)
    func_names = [p.name for p in func_params]
    functional = opaque(
        _typed(_caller(orig, func_params, spec.name, ("out=None",), fresh=True), func_params, T, spec.name),
        fake=lambda *a: fake(**dict(zip(func_names, a))), name=_op_name(spec.name))
    into = opaque(_typed(_caller(orig, params, spec.name + "_out"), into_params, None, spec.name + "_out"),
                  mutates=("out",), name=_op_name(spec.name + "_out"))
    names = ", ".join(p.name for p in params)
    src = (f"def {spec.name}({names}):\n    if out is None:\n        return _functional({', '.join(func_names)})\n"
           f"    _into({names})\n    return out\n")
    scope: dict[str, Any] = {"_functional": functional, "_into": into}
    exec(compile(src, f"<piecegraph flashinfer {spec.name}>", "exec"), scope)  # noqa: S102 - fixed identifiers
    adapter = scope[spec.name]
    adapter.__defaults__ = tuple(p.default for p in params if p.default is not _REQUIRED)
    return adapter


def _adapter(spec: OpSpec, orig: Callable) -> Callable:
    built = _STATE["built"].get(id(orig))
    if built is None or built[0] is not orig:
        params = _installed_params(spec, orig)
        adapter = _build(spec, orig, params)
        functools.update_wrapper(adapter, orig)  # FlashInfer's name and docstring
        adapter.__signature__ = _typed(lambda: None, params, spec.returns, spec.name).__signature__
        setattr(adapter, _MARK, spec.name)
        built = _STATE["built"][id(orig)] = (orig, adapter)
    return built[1]


def install(*, freeze_probes: bool = True) -> Installed:
    """Make FlashInfer's serving ops opaque custom ops with correct fakes, where users find them.

    Adapts norms (rmsnorm, fused_add_rmsnorm, gemma variants, layernorm), activations (silu/gelu/gelu_tanh
    _and_mul), RoPE (apply_rope*, apply_llama31_rope*, apply_rope_with_cos_sin_cache*, in-place variants as
    mutating ops) and fp4_quantize; functions this version lacks are listed in ``missing``. Each adapter is
    bound in every loaded module that holds the original (``flashinfer.X``, ``flashinfer.norm.X``, your own
    ``from flashinfer import X``). With ``freeze_probes`` the warm functools caches of ``flashinfer.*``
    (capability probes, module loaders, ``nvcc --version``) are frozen, so wrapper code around the ops traces
    too; run the model once first (``piecegraph.prewarm``) so they are warm. Idempotent.
    Raises ImportError with ``pip install piecegraph[flashinfer]`` when FlashInfer is not installed.
    """
    _import_flashinfer()
    result, mapping = Installed(), {}
    for spec in _all_specs():
        orig = _original(spec)
        if orig is None:
            result.missing.append(spec.name)
            continue
        try:
            adapter = _adapter(spec, orig)
        except (LookupError, ValueError) as err:  # a signature this adapter does not know: leave it alone
            log.warning("flashinfer adapter: skipped %s: %s", spec.name, err)
            result.missing.append(spec.name)
            continue
        mapping[id(orig)] = (orig, adapter)
        _STATE["active"][spec.name] = (orig, adapter)
        result.ops.append(spec.name)
    replace_everywhere(mapping)
    if freeze_probes:
        result.frozen = freeze_package("flashinfer")
    log.info("flashinfer adapter: %d ops opaque, %d missing, %d loaders frozen",
             len(result.ops), len(result.missing), len(result.frozen))
    return result


def uninstall() -> list[str]:
    """Put FlashInfer's original functions back everywhere and unfreeze its loaders; returns the op names."""
    from piecegraph.ops.freeze import unfreeze

    active = _STATE["active"]
    replace_everywhere({id(adapter): (adapter, orig) for orig, adapter in active.values()})
    if "flashinfer" in sys.modules:
        unfreeze("flashinfer")
    names = list(active)
    active.clear()
    return names


def fp4_refusal(device: Any = "cuda") -> Optional[str]:
    """Why this FlashInfer will not run ``fp4_quantize`` on ``device`` (0.7+ refuses below SM100), or None.

    Runs it once on a small tensor, so the first call builds its JIT module. Other errors propagate.
    """
    flashinfer = _import_flashinfer()
    try:
        flashinfer.fp4_quantize(torch.randn(128, 64, device=device, dtype=torch.bfloat16),
                                torch.tensor([1.0], device=device))
    except RuntimeError as err:
        if "SM100" not in str(err):
            raise
        return str(err)
    return None
