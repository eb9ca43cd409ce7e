"""The fake values on a traced graph's nodes, kept as plain specs, so that a warm start puts them back without
running the whole graph on fakes again (``FakeTensorProp`` was ~75% of restoring a 24-layer decoder's trace:
~2.3 s of each module's warm start on CPU, ~1.9-3.3 s on the H200).

A spec states only what a restore can rebuild exactly: tensors (shape and strides as integers or polynomials in
the trace's size symbols, dtype, device; detached, as the propagation leaves them), SymInts of such
polynomials, plain constants, and tuples, lists, ``torch.Size`` and torch's named results (``topk``'s) of these.
Anything else (a size over an unbacked symbol, a floor division, a SymFloat, an object) makes the graph's specs
``None``, and the restore propagates fakes as before. What the specs do not keep is which values share
storage: nothing that reads the restored values (the token-mixing check, the memory estimate, the split) asks,
and the pieces are compiled on fakes run afresh through them.
"""

from __future__ import annotations

from typing import Any

import torch

_ABSENT = ("absent",)
_CONSTANTS = (bool, int, float, str, torch.dtype, torch.device, type(None))


class _Unsupported(Exception):
    pass


def value_specs(nodes: list[torch.fx.Node], symbols: set[str]) -> list[Any] | None:
    """Per node of ``nodes``, the spec of its fake value (``meta["example_value"]``, else ``meta["val"]``); the
    placeholders' are left out (``None``: the restore builds their fakes itself). ``None`` when any value is
    beyond what a spec states (module docstring). ``symbols``: the names of the trace's size symbols."""
    try:
        return [None if n.op == "placeholder" else _spec(_value(n), symbols) for n in nodes]
    except Exception:  # noqa: BLE001  (_Unsupported, or a value that cannot even be read: propagate instead)
        return None


def _value(node: torch.fx.Node) -> Any:
    if "example_value" in node.meta:
        return node.meta["example_value"]
    return node.meta.get("val", _ABSENT)


def _spec(value: Any, symbols: set[str]) -> Any:
    if value is _ABSENT:
        return _ABSENT
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(_size(s, symbols) for s in value.shape),
                tuple(_size(s, symbols) for s in value.stride()), value.dtype, str(value.device))
    if isinstance(value, torch.SymInt):
        return ("symint", _size(value, symbols))
    if type(value) in (tuple, list, torch.Size) or type(value).__module__ == "torch.return_types":
        return ("sequence", type(value), [_spec(v, symbols) for v in value])
    if isinstance(value, _CONSTANTS):
        return ("const", value)
    raise _Unsupported(type(value).__name__)


def _size(size: Any, symbols: set[str]) -> int | str:
    """An int, or the polynomial over ``symbols`` a symbolic size is, as text."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    import sympy  # here, not at import: ``import piecegraph`` leaves sympy to the first compile

    expr = size.node.expr
    if expr.is_number:
        return int(expr)
    if not {str(s) for s in expr.free_symbols} <= symbols or expr.atoms(sympy.Function) \
            or not expr.is_polynomial(*expr.free_symbols):
        raise _Unsupported(str(expr))
    return str(expr)


class ValueBuilder:
    """Rebuilds specs as fakes of ``mode``, over ``symbols`` (``{name in the specs: SymInt of the restored shape
    env}``; ``hints``: each name's example value)."""

    def __init__(self, env: Any, mode: Any, symbols: dict[str, torch.SymInt], hints: dict[str, int]) -> None:
        import sympy

        self.env, self.mode = env, mode
        self.names = {name: sympy.Symbol(name, integer=True) for name in symbols}
        self.restored = {self.names[name]: s.node.expr for name, s in symbols.items()}
        self.hints = {self.names[name]: hint for name, hint in hints.items() if name in self.names}
        self.sizes: dict[str, Any] = dict(symbols)

    def put_back(self, nodes: list[torch.fx.Node], specs: list[Any]) -> None:
        """Each node's rebuilt value as its ``meta["val"]`` and ``meta["example_value"]``."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # Tensors are made as meta tensors and wrapped as fakes of the mode directly (0.45 ms each through the
        # fake mode's dispatch and cache: a second per restore of the 0.5B shape on CPU), outside the mode
        with unset_fake_temporarily():
            for node, spec in zip(nodes, specs):
                if node.op == "output":  # what it returns, as the propagation records it
                    value = torch.fx.node.map_arg(node.args[0], lambda n: n.meta.get("val"))
                elif spec is None or spec == _ABSENT:
                    continue
                else:
                    value = self.build(spec)
                node.meta["val"] = node.meta["example_value"] = value

    def build(self, spec: Any) -> Any:
        kind = spec[0]
        if kind == "tensor":
            _, shape, stride, dtype, device = spec  # detached, as FakeTensorProp leaves its values
            meta = torch.empty_strided([self.size(s) for s in shape], [self.size(s) for s in stride], dtype=dtype,
                                       device="meta")
            return self.mode.fake_tensor_converter.from_meta_and_device(self.mode, meta, torch.device(device))
        if kind == "symint":
            return self.size(spec[1])
        if kind == "sequence":  # tuple, list, torch.Size or a torch.return_types result: built from a sequence
            return spec[1]([self.build(s) for s in spec[2]])
        if kind == "const":
            return spec[1]
        raise ValueError(f"not a value spec: {spec!r}")

    def size(self, size: int | str) -> Any:
        if isinstance(size, int):
            return size
        if size not in self.sizes:  # a polynomial: the same expression over the restored symbols
            import sympy

            expr = sympy.sympify(size, locals=self.names)
            hint = int(expr.xreplace(self.hints))
            self.sizes[size] = self.env.create_symintnode(expr.xreplace(self.restored), hint=hint)
        return self.sizes[size]
