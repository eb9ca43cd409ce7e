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
from typing import Any, Callable, Optional

import torch

from piecegraph.ops.freeze import freeze_package, replace_everywhere
from piecegraph.ops.opaque import opaque
from piecegraph.ops.signature import hints_of, schema_type

from .flashinfer_specs import REQUIRED, OpSpec, P, T, all_specs, fake_fp4_quantize, fake_specs

__all__ = ["install", "uninstall", "fake_specs", "fp4_refusal", "OpSpec", "Installed", "NAMESPACE"]

log = logging.getLogger(__name__)
NAMESPACE = "piecegraph_flashinfer"
_HINT = "pip install piecegraph[flashinfer]"
_MARK = "__piecegraph_adapter__"

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
        default = REQUIRED if p.default is p.empty else p.default
        if tp is None and default is REQUIRED:
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
    adapter.__defaults__ = tuple(p.default for p in params if p.default is not REQUIRED)
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
    for spec in all_specs():
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
