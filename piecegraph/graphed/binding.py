"""How a GraphedModule meets Dynamo: the traced entry, the trace's argument copies, and the binding of a call's
arguments (by name) to the program's flat inputs and of its flat outputs to the model's output (runner/outputs.py packs
them)."""

from __future__ import annotations

import copy
import enum
import inspect
import itertools
import logging
import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..program import ArgSpec, InputKind, describe, token_arguments
from ..runner.outputs import pack_spec, packer_of, side_outputs, unpack_single
from ..trace.inputs import UnsupportedGraph

log = logging.getLogger("piecegraph")


def _entry(model: torch.nn.Module, kwargs: dict[str, Any]) -> Any:
    return model(**kwargs)


_ENTRIES = itertools.count()


def fresh_entry() -> Callable[..., Any]:
    """A new code object per GraphedModule: Dynamo caches by code object, and we trace each model once, so
    separate models must not share (and exhaust) one cache entry list."""
    code = _entry.__code__.replace(co_name=f"piecegraph_entry_{next(_ENTRIES)}")
    return types.FunctionType(code, _entry.__globals__, code.co_name)


def arguments_by_name(signature: inspect.Signature, owner: str, args: tuple, kwargs: dict[str, Any]
                      ) -> dict[str, Any]:
    """A call's arguments by name under ``signature`` (``owner``'s forward, named in errors); a ``**kwargs``
    parameter's entries are arguments of their own (the model is called as ``model(**values)``), and ``*args`` is
    refused: it has no names to bind."""
    bound = signature.bind(*args, **kwargs)
    values = dict(bound.arguments)
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in values:
            values.update(values.pop(name))
        elif param.kind is inspect.Parameter.VAR_POSITIONAL and values.pop(name, ()):
            raise TypeError(
                f"{owner}.forward takes *{name}, which piecegraph cannot bind by name; pass those tensors as named "
                "arguments (wrap the model in a module whose forward names them)"
            )
    return values


def positional_names(signature: inspect.Signature) -> tuple[str, ...] | None:
    """The parameter names a call that passes every argument by position binds, in order; ``None`` when the
    signature has ``*args`` / ``**kwargs`` or keyword-only parameters (such calls go through ``bind``)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind not in kinds for p in signature.parameters.values()):
        return None
    return tuple(signature.parameters)


def trace_copies(values: dict[str, Any], td: int, static_inputs: tuple[str, ...]) -> dict[str, Any]:
    """The arguments to trace with: each token input (:func:`~piecegraph.program.token_arguments`) a copy with
    its token dim marked dynamic; every other tensor a plain copy (static: its sizes are specialised), so the
    trace run writes none of the caller's tensors; non-tensor arguments as they are (Dynamo guards on them)."""
    tokens = token_arguments(values, td, static_inputs)
    return {k: trace_copy(v, td) if k in tokens else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in values.items()}


def static_suspect(err: BaseException, values: dict[str, Any], token_dim: int, static_inputs: tuple[str, ...]
                   ) -> str | None:
    """The argument to blame when the trace found a token input that is not token-aligned (a (D,) scale whose D
    equals the first call's token count): a token argument other than the first, else None."""
    inner = getattr(err, "inner_exception", err)  # Dynamo wraps the backend's error
    match = re.fullmatch(r"L\['kwargs'\]\['(\w+)'\]", getattr(inner, "input", None) or "")
    if not isinstance(inner, UnsupportedGraph) or match is None:
        return None
    tokens = [k for k in values if k in token_arguments(values, token_dim, static_inputs)]
    return match.group(1) if match.group(1) in tokens[1:] else None


def scratch_arguments(values: dict[str, Any]) -> dict[str, Any]:
    """Copies of a call's arguments for piecegraph's own runs (prewarm, the breakable probe): tensors cloned,
    other objects deep-copied where they can be (an object that cannot be copied is passed as it is)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.clone()
        else:
            try:
                out[k] = copy.deepcopy(v)
            except Exception:  # noqa: BLE001
                out[k] = v
    return out


def trace_copy(value: Any, td: int) -> Any:
    """Mark the token dim dynamic; a call with fewer than 2 tokens is traced on a zero-padded copy."""
    if not isinstance(value, torch.Tensor) or value.dim() <= td:
        return value
    value = value.clone()  # marking dynamic tags the tensor: tag a copy, not the caller's
    if value.shape[td] < 2:
        pad_shape = list(value.shape)
        pad_shape[td] = 2 - value.shape[td]
        value = torch.cat([value, torch.zeros(pad_shape, dtype=value.dtype, device=value.device)], dim=td)
    torch._dynamo.mark_dynamic(value, td)
    return value


class Source(enum.Enum):
    """Where a program input's value comes from on each call. Not :class:`InputKind`, which says how the runner
    stages an input: a caller's argument may be a token input or a caller static."""

    CALLER = "caller"  # the call's argument of that name
    COUNT = "count"  # the token count (the runner sets it)
    MODULE = "module"  # a parameter, buffer or constant the trace read off the model: the same object each call


@dataclass
class Bound:
    """One program input: its source, the argument name (CALLER) or the module's tensor (MODULE), its Dynamo
    source name."""

    source: Source
    value: Any
    name: str


@dataclass
class Binding:
    """The map from a call's arguments (by name) to the program's flat inputs, and back from its flat outputs.

    Tensor arguments are checked against the trace (dtype, device, rank, non-token dims) once per distinct
    signature; non-tensor arguments must equal their traced values (compared with a copy taken at trace time, so
    an in-place change to a dict is seen); an argument the trace did not see, or one missing, is an error."""

    inputs: list[Bound]
    pack: Callable[[tuple[Any, ...]], Any]
    constants: dict[str, tuple[Any, Any]]
    known_args: frozenset[str]
    specs: dict[str, ArgSpec] = field(default_factory=dict)
    accepted: set[tuple] = field(default_factory=set)
    pack_spec: tuple[str, Any] | None = None  # what ``pack`` does, as data (a traced binding's: see snapshot)

    def __post_init__(self) -> None:
        # Where each call's own values go (the rest are read off ``inputs``, which a weight refresh updates).
        self._caller_slots = [(i, b.value) for i, b in enumerate(self.inputs) if b.source is Source.CALLER]
        self._count_slots = [i for i, b in enumerate(self.inputs) if b.source is Source.COUNT]

    @classmethod
    def from_trace(cls, example_inputs: list[Any], names: list[str], kinds: list[InputKind],
                   trace_values: dict[str, Any], result: Any, outputs: tuple[Any, ...] | None,
                   token_dim: int) -> Binding | None:
        """Bind a traced program's inputs; ``None`` when an input or the output cannot be bound directly (then
        calls go through Dynamo)."""
        inputs = []
        for example, name in zip(example_inputs, names):
            arg = next((k for k, v in trace_values.items() if v is example), None)
            if arg is not None:
                inputs.append(Bound(Source.CALLER, arg, name))
            elif isinstance(example, (int, torch.SymInt)) and name.endswith(f".size()[{token_dim}]"):
                inputs.append(Bound(Source.COUNT, None, name))
            elif isinstance(example, torch.Tensor):
                inputs.append(Bound(Source.MODULE, example, name))
            else:
                log.info("piecegraph: graph input %s cannot be bound directly; calls go through Dynamo", name)
                return None
        spec = pack_spec(result, outputs)
        if spec is not None and side_outputs(result, outputs):
            log.info("piecegraph: the graph also returns values the model stores elsewhere (an attribute assigned "
                     "in forward); calls go through Dynamo, which applies them")
            return None
        if spec is None:
            log.info("piecegraph: the model's output is not a tensor or tuple of tensors; calls go through Dynamo")
            return None
        specs = {b.value: ArgSpec.of(b.value, trace_values[b.value], token_dim if kind is InputKind.TOKENS else None)
                 for b, kind in zip(inputs, kinds)
                 if b.source is Source.CALLER and isinstance(trace_values[b.value], torch.Tensor)}
        binding = cls(inputs, packer_of(spec), _constants(trace_values), frozenset(trace_values), specs)
        binding.pack_spec = spec
        return binding

    @classmethod
    def of_arguments(cls, values: dict[str, Any], single_output: bool) -> Binding:
        """Every argument is an input, in order (a breakable program's binding)."""
        return cls([Bound(Source.CALLER, name, name) for name in values], unpack_single if single_output else tuple,
                   _constants(values), frozenset(values))

    def labels(self) -> list[str]:
        """Each input's name for messages: the argument's name, else its Dynamo source name."""
        return [b.value if b.source is Source.CALLER else b.name for b in self.inputs]

    def caller_indices(self) -> list[int]:
        return [i for i, b in enumerate(self.inputs) if b.source is Source.CALLER]

    def module_inputs(self) -> dict[int, Bound]:
        return {i: b for i, b in enumerate(self.inputs) if b.source is Source.MODULE}

    def flatten(self, values: dict[str, Any]) -> list[Any]:
        """The program's flat inputs for a call's arguments, each checked (see the class docstring)."""
        for key, traced in self.constants.items():
            if not _same_constant(values.get(key, traced[0]), traced):
                _refuse_constant(key, values.get(key), traced[1])
        flat = [b.value for b in self.inputs]
        for i in self._count_slots:
            flat[i] = 0  # the runner sets the count
        for i, name in self._caller_slots:
            if name not in values:
                raise TypeError(f"argument {name!r} was given when the model was traced and is missing now")
            flat[i] = self._checked(name, values[name])
        if not self.known_args.issuperset(values):
            extra = sorted(set(values) - self.known_args)
            raise TypeError(f"arguments {extra} were not given when the model was traced")
        return flat

    def _checked(self, name: str, value: Any) -> Any:
        """``value`` checked against the traced argument (once per distinct dtype/device/shape), contiguous."""
        spec = self.specs.get(name)
        if spec is None:
            return value
        if not isinstance(value, torch.Tensor):
            spec.check(value)
        key = (name, *spec.key(value))
        if key not in self.accepted:
            spec.check(value)
            self.accepted.add(key)
        if spec.contiguous and not value.is_contiguous():
            value = value.contiguous()  # compiled code assumed the traced strides; a copy, never the caller's
        return value


def _constants(values: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: _snapshot(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}


def _snapshot(value: Any) -> tuple[Any, Any]:
    """``(the argument, a copy of it as traced)``, so a later in-place change (a dict updated) is seen. Objects
    compared by identity (no ``__eq__`` of their own) or that cannot be copied keep only themselves."""
    if type(value).__eq__ is object.__eq__:
        return value, value
    try:
        return value, copy.deepcopy(value)
    except Exception:  # noqa: BLE001
        return value, value


def _refuse_constant(key: str, value: Any, traced: Any) -> None:
    # A container's tensors are specialised with it and compared by value, which a tensor of more than one element
    # never passes: "differs" would be wrong even for the very same dict.
    if _holds_tensor(traced):
        raise TypeError(
            f"argument {key}={describe(value)} holds tensors inside a {type(traced).__name__}; piecegraph takes "
            "tensors as arguments of their own (other arguments keep their traced value): pass each one separately"
        )
    raise ValueError(
        f"argument {key}={describe(value)} differs from the traced {key}={describe(traced)}; piecegraph "
        "specialises non-tensor arguments. Pass a tensor, or compile one model per value."
    )


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return any(_holds_tensor(v) for v in items)


def _same_constant(value: Any, traced: tuple[Any, Any]) -> bool:
    original, copied = traced
    if value is original and copied is original:
        return True
    try:
        return bool(value == copied)
    except Exception:  # noqa: BLE001  (== that raises or returns a tensor: not provably the same)
        return False


def capture_inputs(make_inputs: Callable[[int], Any], n: int) -> tuple[tuple[Any, ...], Any]:
    """``make_inputs(n)`` as ``(args, context)``, refused naming what it returned when it is not that shape."""
    got = make_inputs(n)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise TypeError(
            f"make_inputs({n}) returned {describe(got)}; it must return (args, context): a tuple of the forward's "
            f"arguments for {n} tokens and the forward context (None for none), e.g. ((input_ids, positions), meta)"
        )
    args, meta = got
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"make_inputs({n}) returned args {describe(args)}; args must be a tuple (or list) of the forward's "
            "arguments, e.g. return ((x,), None) for a forward that takes one tensor"
        )
    return tuple(args), meta


def check_capture_tokens(values: dict[str, Any], n: int, config: Any) -> None:
    """The first token argument of ``make_inputs(n)``'s args has ``n`` rows (another count would capture, and
    report, another size)."""
    td = config.token_dim
    static = tuple(name for name in config.static_inputs if name in values)
    tokens = token_arguments(values, td, static)
    first = next((k for k in values if k in tokens), None)
    if first is not None and values[first].shape[td] != n:
        raise ValueError(
            f"make_inputs({n}) returned {first} as {describe(values[first])}: its dim token_dim={td} is "
            f"{values[first].shape[td]}, not {n}. make_inputs(n) must return the arguments of n tokens"
        )
