"""The cache key: everything that decides the compiled code, as plain JSON, and its sha256.

Material, not only a hash, is kept in the manifest: a lookup compares it field by field, so a stale entry (changed
model code, another torch) is named by what changed, and a hash collision can never load wrong code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import platform
from typing import Any

import torch

# Config fields that change no compiled code (where artifacts go, what is shown, memory policy, sharing).
_NOT_CODE = ("pool", "cache_dir", "progress", "graph_memory_limit", "verify", "verify_tol", "check_addresses",
             "copy_outputs", "warmup_runs", "aot_package", "aot_background")
# Distributions whose versions change generated code or the kernels it calls (read from metadata: FlashInfer
# and Triton are never imported for this).
_DISTRIBUTIONS = ("torch", "triton", "pytorch-triton", "flashinfer-python", "flashinfer", "transformers")


def key_material(model: torch.nn.Module, values: dict[str, Any], config: Any) -> dict[str, Any]:
    """What decides the compiled code of ``model`` called with ``values`` under ``config``: its classes' code,
    its config, its parameters' and buffers' shapes and dtypes, the call's argument specs (the token count
    excluded), the config's code-relevant fields, split ops, sizes, versions and the device."""
    from piecegraph.ops.split import split_op_names

    return {
        "piecegraph": _own_version(),
        "versions": _versions(),
        "python": platform.python_version(),
        "device": _device(),
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "code": _code_digest(model),
        "model_config": _model_config(model),
        "state": [[name, list(t.shape), str(t.dtype), t.device.type]
                  for name, t in (*model.named_parameters(), *model.named_buffers())],
        "arguments": _argument_specs(values, config.token_dim),
        "config": _config_fields(config),
        "split_ops": sorted(split_op_names(config.split_ops)),
        "sizes": list(config.sizes),
        "compile_sizes": list(config.static_compile_sizes),
    }


def cache_key(material: dict[str, Any]) -> str:
    """The sha256 of the material's canonical JSON (32 hex digits: a folder name)."""
    return hashlib.sha256(canonical(material).encode()).hexdigest()[:32]


def canonical(material: dict[str, Any]) -> str:
    return json.dumps(material, sort_keys=True, separators=(",", ":"), default=repr)


def _own_version() -> str:
    """piecegraph's installed version (from its metadata: the package itself sits above this stage)."""
    try:
        return importlib.metadata.version("piecegraph")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _versions() -> dict[str, str]:
    out = {}
    for dist in _DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    out["torch"] = torch.__version__  # the running one, whatever the metadata says
    out["cuda"] = str(torch.version.cuda)
    return out


def _device() -> str:
    if not torch.cuda.is_available():
        return f"cpu:{platform.machine()}"
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} sm{major}{minor}"


def _code_digest(model: torch.nn.Module) -> str:
    """sha256 over the code of every class among the model's modules and their bases outside torch: each
    method's bytecode, names and constants (nested functions too), so the key follows the code that runs, not
    the file on disk (which may have been edited since). Module-level helpers are not followed: Inductor's own
    cache keys the traced graph itself, so a change there costs a compile, never wrong code."""
    classes = {cls for module in model.modules() for cls in type(module).__mro__
               if cls.__module__ and not cls.__module__.startswith("torch.")}
    h = hashlib.sha256()
    for cls in sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        h.update(f"{cls.__module__}.{cls.__qualname__}\n".encode())
        for name, value in sorted(vars(cls).items()):
            for fn in _functions(value):
                h.update(name.encode())
                h.update(_code_bytes(fn.__code__))
    return h.hexdigest()


def _functions(value: Any) -> list[Any]:
    """The plain functions behind a class attribute (a method, static or class method, property)."""
    inner = [getattr(value, a, None) for a in ("__func__", "fget", "fset")] if not hasattr(value, "__code__") \
        else [value]
    return [f for f in inner if hasattr(f, "__code__")]


def _code_bytes(code: Any) -> bytes:
    parts = [code.co_code, repr(code.co_names).encode(), repr(code.co_varnames).encode()]
    for const in code.co_consts:  # a nested code object's repr holds its address: recurse instead
        parts.append(_code_bytes(const) if hasattr(const, "co_code") else repr(const).encode())
    return b"\x00".join(parts)


def _model_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "to_dict"):  # transformers' PretrainedConfig
        return json.loads(json.dumps(config.to_dict(), sort_keys=True, default=repr))
    if dataclasses.is_dataclass(config):
        return repr(config)
    return repr(config)


def _argument_specs(values: dict[str, Any], token_dim: int) -> dict[str, Any]:
    """Each argument's dtype, device and shape, the token count written ``T`` (the count the first tensor
    argument has in dim ``token_dim``: a static input of another length keeps its number)."""
    counts = [v.shape[token_dim] for v in values.values() if isinstance(v, torch.Tensor) and v.dim() > token_dim]
    tokens = counts[0] if counts else None
    out: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            shape = ["T" if i == token_dim and s == tokens else s for i, s in enumerate(value.shape)]
            out[name] = [shape, str(value.dtype), value.device.type]
        else:
            out[name] = repr(value)
    return out


def _config_fields(config: Any) -> dict[str, str]:
    return {f.name: repr(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in _NOT_CODE
            and f.name not in ("split_ops", "capture_sizes", "max_tokens", "compile_sizes")}
