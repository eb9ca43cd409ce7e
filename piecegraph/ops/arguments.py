"""What each parameter of an :func:`~piecegraph.opaque` callable becomes at the op boundary.

A torch op schema says ``Tensor``, ``SymInt``, ``float``, ``bool``, ``str``, ``ScalarType``, ``Device``, lists of
some of those, and ``?`` for optional. Real library signatures say more, so each parameter is classified once, at
``opaque()`` time (an :class:`Arg`), into one of:

* a schema type, as is (``Tensor``, ``int`` -> ``SymInt``, ``List[Tensor]`` / ``Sequence[Tensor]`` ->
  ``Tensor[]``, ``Tuple[Tensor, Optional[Tensor]]`` -> ``Tensor?[]``, ``Tuple[int, ...]`` -> ``SymInt[]``; tuples
  come back as tuples before the call);
* ``Literal[...]`` of str, int or bool: the schema type of its values, the value checked on every call;
* an ``Enum`` with str or int values: passed as its value, rebuilt before the call;
* a constant (an object, a callable, an enum of objects): left out of the schema and bound to the value of the
  first call; a later call with another object (neither ``is`` nor ``==``) is refused;
* not typed yet (no hint and no telling default, ``Any``, or a ``Union`` of schema types such as ``Union[Tensor,
  int]``): typed from the value of the first call, by the same rules (a ``None`` there is bound as a constant);
  a Union's first value must have one of its member types, and later calls the same one.

Refused, with the parameter named: ``*args`` / ``**kwargs``, and hints that may hold tensors in a shape the schema
cannot say (``Dict[str, Tensor]``, ``Union[Tensor, MyObject]``), which could not be constants either.
"""

from __future__ import annotations

import collections.abc
import enum
import inspect
import types
import typing
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch


class OpaqueError(TypeError):
    """A callable cannot be made opaque as asked: its signature, its fake or its name. The message says the fix."""


class OpaqueArgumentError(OpaqueError, ValueError):
    """A call passed a value the op cannot take: a ``Literal`` value it does not list, or another object than the
    constant bound at the first call. Also a ``ValueError``."""


SCALARS: dict[Any, str] = {
    torch.Tensor: "Tensor", int: "SymInt", float: "float", bool: "bool", str: "str",
    torch.dtype: "ScalarType", torch.device: "Device",
}
_LISTABLE = ("Tensor", "SymInt", "float", "bool", "ScalarType")  # element types a schema list may have here
_SEQUENCES = (list, tuple, collections.abc.Sequence, collections.abc.MutableSequence)
_UNTYPED_HINTS = (typing.Any, object, list, tuple, inspect.Parameter.empty)
SUPPORTED = ("supported: Tensor, int, float, bool, str, torch.dtype, torch.device, Literal[...] of str/int/bool, "
             "an Enum of str/int values, List/Sequence/Tuple of Tensor (or Optional[Tensor]), int, float or bool, "
             "Optional of those, a Union of those (typed by the first call); other objects are bound as constants")


@dataclass(frozen=True)
class Arg:
    """One parameter of an opaque callable: its schema type, or how it crosses the op boundary instead.

    ``base``: schema type without ``?`` (None for a constant or a parameter not typed yet). ``allowed``: the
    ``Literal`` values (``None`` among them when optional). ``enum``: the Enum class passed by value. ``as_tuple``:
    the op hands a list, the callable gets a tuple. ``const``: left out of the schema, bound at the first call.
    """

    name: str
    kind: Any = inspect.Parameter.POSITIONAL_OR_KEYWORD
    base: Optional[str] = None
    optional: bool = False
    allowed: Optional[tuple] = None
    enum: Optional[type] = None
    as_tuple: bool = False
    const: bool = False
    union: Optional[tuple] = None  # a Union hint's member types: the first call picks one

    @property
    def lazy(self) -> bool:
        """Typed by the first call (no hint, and no default that says the type)."""
        return self.base is None and not self.const

    @property
    def checked(self) -> bool:
        """The wrapper checks or converts this argument on every call (Literal, Enum, constant)."""
        return self.allowed is not None or self.enum is not None or self.const

    @property
    def rebuilt(self) -> bool:
        """The kernel side converts this argument back before calling (Enum, tuple, constant)."""
        return self.enum is not None or self.as_tuple or self.const

    def schema(self, alias: Optional[str] = None) -> str:
        """``"Tensor? name"``-style schema argument; ``alias`` marks a mutated tensor (``Tensor(a!)``)."""
        base = self.base or ""
        if alias is not None:
            if not base.startswith("Tensor"):
                raise OpaqueError(f"opaque: mutates names {self.name!r}, but it is a {base or 'constant'}, "
                                  "not a Tensor")
            base = base.replace("Tensor", f"Tensor({alias}!)", 1)
        return f"{base}{'?' if self.optional else ''} {self.name}"


# ------------------------------------------------------------------------------------------------------ hints
def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``Optional[X]`` / ``X | None`` -> (X, True) (X a Union when several remain); anything else -> (tp, False)."""
    if typing.get_origin(tp) is typing.Union or isinstance(tp, types.UnionType):
        members = typing.get_args(tp)
        rest = tuple(a for a in members if a is not type(None))
        if len(rest) < len(members):
            return (rest[0] if len(rest) == 1 else typing.Union[rest]), True
    return tp, False


_CONTAINERS = _SEQUENCES + (dict, set, frozenset, collections.abc.Mapping, collections.abc.Iterable,
                             collections.abc.Collection, collections.abc.Set)


def _mentions_tensor(tp: Any) -> bool:
    """Whether a value of type ``tp`` may be or hold a tensor (a Callable taking tensors is not one)."""
    if isinstance(tp, type) and issubclass(tp, torch.Tensor):
        return True
    origin = typing.get_origin(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType) or origin in _CONTAINERS:
        return any(_mentions_tensor(a) for a in typing.get_args(tp) if a is not Ellipsis)
    return False


def _literal(name: str, tp: Any, values: tuple) -> dict[str, Any]:
    optional = None in values
    values = tuple(v for v in values if v is not None)
    kinds = {type(v) for v in values}
    base = {frozenset({str}): "str", frozenset({bool}): "bool", frozenset({int}): "int"}.get(frozenset(kinds))
    if base is None:
        raise OpaqueError(f"opaque: argument {name!r} has type {tp!r}; a Literal must list values of one type, str, "
                          f"int or bool, for the schema to type it ({SUPPORTED})")
    return {"base": base, "optional": optional, "allowed": values + ((None,) if optional else ())}


def _enum(cls: type) -> dict[str, Any]:
    """An Enum of str or of int values goes by value; any other Enum is a constant."""
    kinds = {type(m.value) for m in cls}
    base = {frozenset({str}): "str", frozenset({int}): "int"}.get(frozenset(kinds))
    return {"base": base, "enum": cls} if base else {"const": True}


def _item_base(tp: Any) -> tuple[Optional[str], bool]:
    inner, optional = _unwrap_optional(tp)
    if isinstance(inner, type) and issubclass(inner, torch.Tensor):
        return "Tensor", optional
    return SCALARS.get(inner), optional


def _sequence(name: str, tp: Any, origin: Any) -> Optional[dict[str, Any]]:
    items = [a for a in typing.get_args(tp) if a is not Ellipsis]
    if not items:
        return None  # a bare List / Sequence: typed by the first call
    bases = {_item_base(a) for a in items}
    kinds, optional_items = {b for b, _ in bases}, any(o for _, o in bases)
    base = next(iter(kinds)) if len(kinds) == 1 else None
    if base in _LISTABLE and (not optional_items or base == "Tensor"):  # only tensors may be None in a schema list
        return {"base": base + ("?[]" if optional_items else "[]"), "as_tuple": origin is tuple}
    if _mentions_tensor(tp):
        raise OpaqueError(f"opaque: argument {name!r} has type {tp!r}: a list whose items are not all of one schema "
                          f"type, and it holds tensors, so it cannot be a constant either ({SUPPORTED}). Wrap the "
                          f"callable in a def that takes the tensors as a List[Tensor].")
    return {"const": True}


def _union(name: str, tp: Any) -> Optional[dict[str, Any]]:
    """``Union[Tensor, int]`` and the like: typed by the first call, which must pass one of the members (each a
    plain schema type); None when some member is not one."""
    bases = []
    for member in typing.get_args(tp):
        try:
            fields = classify_hint(name, member)
        except OpaqueError:
            return None
        if not fields or set(fields) - {"base", "as_tuple"}:
            return None
        bases.append(fields["base"])
    return {"union": tuple(dict.fromkeys(bases))}


def classify_hint(name: str, tp: Any) -> Optional[dict[str, Any]]:
    """:class:`Arg` fields for a parameter hinted ``tp``; None when the hint does not say (typed by the first call).

    Raises :class:`OpaqueError` for a Literal of mixed values or a hint that may hold tensors the schema cannot
    carry (``Union[float, Tensor]``): such a value could be neither an op argument nor a constant.
    """
    inner, optional = _unwrap_optional(tp)
    origin = typing.get_origin(inner)
    if inner in _UNTYPED_HINTS or inner in (typing.List, typing.Tuple, typing.Sequence) or \
            isinstance(inner, (str, typing.ForwardRef)):  # no hint, Any, or one that did not resolve
        fields: Optional[dict[str, Any]] = None
    elif isinstance(inner, type) and issubclass(inner, torch.Tensor):
        fields = {"base": "Tensor"}
    elif inner in SCALARS:
        fields = {"base": SCALARS[inner]}
    elif origin is typing.Literal:
        return _literal(name, tp, typing.get_args(inner) + ((None,) if optional else ()))
    elif isinstance(inner, type) and issubclass(inner, enum.Enum):
        fields = _enum(inner)
    elif origin in _SEQUENCES:
        fields = _sequence(name, inner, origin)
    elif (origin is typing.Union or isinstance(inner, types.UnionType)) and _union(name, inner):
        fields = _union(name, inner)
    elif _mentions_tensor(inner):
        raise OpaqueError(f"opaque: argument {name!r} has type {tp!r}, which a torch op schema cannot express, and "
                          f"it may hold tensors, so it cannot be bound as a constant either ({SUPPORTED}). Wrap the "
                          f"callable in a def that takes supported types (e.g. always a tensor).")
    else:
        fields = {"const": True}  # an object, a callable, a config: bound at the first call
    if fields is not None and optional and not fields.get("const"):
        fields["optional"] = True
    return fields


def classify_default(default: Any) -> Optional[dict[str, Any]]:
    """:class:`Arg` fields told by the default of a parameter without hint (``eps=1e-6`` is a float, ``mode=
    Mode.FAST`` an Enum, ``window=(-1, -1)`` a tuple of ints); None when it does not tell (``None``, an object)."""
    if type(default) in SCALARS:
        return {"base": SCALARS[type(default)]}
    if isinstance(default, enum.Enum):
        return _enum(type(default))
    if type(default) in (list, tuple) and default:
        kinds = {SCALARS.get(type(v)) for v in default}
        if len(kinds) == 1 and next(iter(kinds)) in ("SymInt", "float", "bool"):
            return {"base": next(iter(kinds)) + "[]", "as_tuple": type(default) is tuple}
    return None


# --------------------------------------------------------------------------- values of the first call (traced)
_VALUE_BASES = {bool: "bool", int: "SymInt", float: "float", str: "str", torch.dtype: "ScalarType",
                torch.device: "Device", type(None): "None"}
_ITEM_BASES = {bool: "bool", int: "SymInt", float: "float"}


def _items_code(values: Any) -> Optional[str]:
    code = None
    for v in values:
        item = "Tensor" if isinstance(v, torch.Tensor) else _ITEM_BASES.get(type(v))
        if item is None or (code is not None and item != code):
            return None
        code = item
    return code


def value_code(value: Any) -> str:
    """The schema type a first-call value says: ``"Tensor"``, ``"SymInt"``, ..., ``"Tensor[]"`` (a list),
    ``"Tensor()"`` (a tuple), ``"None"``, or ``"obj"`` (an Enum member or an object: see :func:`value_fields`).

    Plain isinstance/type tests, so Dynamo traces it on fake tensors and SymInts when the first call is compiled.
    """
    if isinstance(value, torch.Tensor):
        return "Tensor"
    kind = type(value)
    if kind in _VALUE_BASES:
        return _VALUE_BASES[kind]
    if kind is list or kind is tuple:
        item = _items_code(value)
        if item is not None:
            return item + ("[]" if kind is list else "()")
    return "obj"


def value_codes(values: tuple) -> tuple:
    """:func:`value_code` of each value (traced by Dynamo on a compiled first call)."""
    return tuple(value_code(v) for v in values)


def value_objects(values: tuple) -> tuple:
    """Each value, or None for a tensor or list of tensors: only these cross into the (real, untraced) first-call
    registration, so a compiled first call never materializes a tensor there."""
    return tuple(None if value_code(v).startswith("Tensor") else v for v in values)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    return False


def value_fields(name: str, code: str, obj: Any) -> dict[str, Any]:
    """:class:`Arg` fields of a parameter typed by its first call (``code`` from :func:`value_code`)."""
    if code == "None":
        return {"const": True}  # nothing says what else it may be: a later non-None value is refused, named
    if code != "obj":
        base = code.replace("()", "[]")
        return {"base": base, "as_tuple": code.endswith("()")}
    if isinstance(obj, enum.Enum):
        return _enum(type(obj))
    if _holds_tensor(obj):
        raise OpaqueError(f"opaque: argument {name!r} has no type hint and its first value ({type(obj).__name__}) "
                          f"holds tensors in a shape the op schema cannot say, so it cannot be bound as a constant "
                          f"either; annotate it ({SUPPORTED}) or wrap the callable in a def that takes the tensors")
    return {"const": True}


# ------------------------------------------------------------------------------------------------- parameters
def parameters(fn: Callable) -> list[inspect.Parameter]:
    """``fn``'s parameters; :class:`OpaqueError` for an unreadable signature or ``*args`` / ``**kwargs``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as err:
        raise OpaqueError(f"opaque: cannot read the signature of {fn!r}; wrap it in a def with type hints") from err
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise OpaqueError(f"opaque: argument {p.name!r} is *{p.name} / **{p.name}; a torch op needs a fixed "
                              f"argument list. Wrap the callable in a def that names each argument.")
    return params


def hints_of(fn: Callable) -> dict[str, Any]:
    """Resolved type hints (string annotations included); falls back to raw annotations."""
    # A callable object's hints live on its bound __call__ (callable() would only say it has one).
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)  # noqa: B004
    try:
        return typing.get_type_hints(target)
    except Exception:  # unresolvable forward references: use what is there
        return dict(getattr(target, "__annotations__", {}))


def classify(p: inspect.Parameter, hints: dict[str, Any]) -> Arg:
    """The :class:`Arg` of parameter ``p``: its hint, else its default, else typed by the first call.

    A ``None`` default makes a hinted type optional (``out: Tensor = None``, FlashInfer style).
    """
    hint = hints.get(p.name, inspect.Parameter.empty)
    if p.default is None and hint is not inspect.Parameter.empty:
        hint = Optional[hint]
    fields = classify_hint(p.name, hint)
    if fields is None and p.default is not inspect.Parameter.empty:
        fields = classify_default(p.default)
        if fields is not None and _unwrap_optional(hint)[1]:
            fields["optional"] = True
    arg = Arg(p.name, p.kind, **(fields or {}))
    if arg.lazy and (p.default is None or _unwrap_optional(hint)[1]):
        arg = replace(arg, optional=True)  # whatever the first call says, None stays allowed
    return arg


def with_first_call(arg: Arg, code: str, obj: Any) -> Arg:
    """``arg`` (not typed yet) typed by the value its first call passed; a Union hint must list that type."""
    fields = value_fields(arg.name, code, obj)
    if fields.get("const"):
        return replace(arg, const=True, optional=False)
    if arg.union is not None:
        if fields.get("base") == "SymInt" and "SymInt" not in arg.union and "float" in arg.union:
            fields["base"] = "float"  # an int given for Union[Tensor, float]
        if fields.get("base") not in arg.union:
            raise OpaqueError(f"opaque: argument {arg.name!r} is a Union of {', '.join(arg.union)}, and its first "
                              f"value is {code if code != 'obj' else type(obj).__name__}")
    return replace(arg, **fields)
