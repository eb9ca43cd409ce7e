"""A traced :class:`~piecegraph.graphed.binding.Binding` as data, and back on another process's model.

The binding maps a call's arguments and the model's tensors to the program's inputs. The model's tensors are
named by Dynamo's source names (``L['model']._modules['layers']._modules['0']._parameters['weight']``), which
:func:`resolve_source` follows on the model of a later start; the snapshot is refused (``None``) where a source
is of another form, or names another tensor than the one the trace bound (checked at the cold start).
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch

from ..program import ArgSpec
from ..runner.outputs import packer_of
from .binding import Binding, Bound, Source

_ROOT = "L['model']"
_STEP = re.compile(r"\.(\w+)|\['([^']*)'\]|\[(\d+)\]")


@dataclass
class BindingSnapshot:
    inputs: list[tuple[str, str | None, str]]  # (source kind, argument name for a caller's input, source name)
    module_meta: dict[int, tuple[tuple[int, ...], torch.dtype, str]]  # each module tensor's shape, dtype, device
    pack_spec: tuple[str, Any]
    constants: bytes  # the traced non-tensor arguments, pickled
    known_args: list[str]
    specs: dict[str, ArgSpec]


def resolve_source(source: str, model: torch.nn.Module) -> Any:
    """The object Dynamo's ``source`` names, read off ``model``; ``LookupError`` for another form of source."""
    if not source.startswith(_ROOT):
        raise LookupError(f"{source} is not read off the model")
    obj, rest, pos = model, source[len(_ROOT):], 0
    while pos < len(rest):
        step = _STEP.match(rest, pos)
        if step is None:
            raise LookupError(f"{source}: cannot follow {rest[pos:]!r}")
        attr, key, index = step.groups()
        try:
            obj = getattr(obj, attr) if attr is not None else obj[key] if key is not None else obj[int(index)]
        except (AttributeError, KeyError, IndexError, TypeError) as err:
            raise LookupError(f"{source}: {err}") from None
        pos = step.end()
    return obj


def snapshot_binding(binding: Binding, model: torch.nn.Module) -> BindingSnapshot | None:
    """``binding`` as data, or ``None`` when part of it cannot be stated so (see the module docstring); constants
    compared by identity (no ``__eq__``) cannot be compared in another process either."""
    if binding.pack_spec is None:
        return None
    inputs, meta = [], {}
    for i, bound in enumerate(binding.inputs):
        if bound.source is Source.MODULE:
            try:
                if resolve_source(bound.name, model) is not bound.value:
                    return None
            except LookupError:
                return None
            meta[i] = (tuple(bound.value.shape), bound.value.dtype, str(bound.value.device))
        inputs.append((bound.source.value, bound.value if bound.source is Source.CALLER else None, bound.name))
    constants = {}
    for key, (original, copied) in binding.constants.items():
        if copied is original and type(original).__eq__ is object.__eq__:
            return None
        constants[key] = copied
    try:
        blob = pickle.dumps(constants)
    except Exception:  # noqa: BLE001  (an argument that does not pickle: trace with Dynamo instead)
        return None
    return BindingSnapshot(inputs, meta, binding.pack_spec, blob, sorted(binding.known_args), dict(binding.specs))


def restore_binding(snapshot: BindingSnapshot, model: torch.nn.Module) -> Binding:
    """The binding of ``snapshot`` on ``model``; ``LookupError`` when a module tensor is missing or is not the
    shape, dtype or device it was (the model is not the one snapshotted: trace it anew)."""
    inputs = []
    for i, (kind, arg, name) in enumerate(snapshot.inputs):
        source = Source(kind)
        if source is Source.MODULE:
            tensor = resolve_source(name, model)
            shape, dtype, device = snapshot.module_meta[i]
            if not isinstance(tensor, torch.Tensor) or (tuple(tensor.shape), tensor.dtype, str(tensor.device)) != (
                    shape, dtype, device):
                raise LookupError(f"{name} is not the {dtype} tensor of shape {shape} on {device} it was")
            inputs.append(Bound(source, tensor, name))
        else:
            inputs.append(Bound(source, arg, name))
    constants = {k: (v, v) for k, v in pickle.loads(snapshot.constants).items()}  # compared by value
    binding = Binding(inputs, packer_of(snapshot.pack_spec), constants, frozenset(snapshot.known_args),
                      dict(snapshot.specs))
    binding.pack_spec = snapshot.pack_spec
    return binding
