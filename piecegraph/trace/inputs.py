"""What each input of a Dynamo graph is (trace stage): a token tensor, the token count, module state or a static
caller argument; the token symbols, which outputs follow the token count, and the placeholders' facts a graph
snapshot records. :func:`~piecegraph.trace.backend.build_program` reads them before it splits the graph."""

from __future__ import annotations

from typing import Any

import torch

from ..program import InputKind


class UnsupportedGraph(RuntimeError):
    """The traced graph has a shape piecegraph cannot bucket (a second dynamic dimension, say); ``input`` names
    the graph input (its Dynamo source name) when one is to blame."""

    def __init__(self, message: str, input: str | None = None):
        super().__init__(message)
        self.input = input


def fake_value(node: torch.fx.Node) -> Any:
    """The trace's fake value of ``node`` (symbolic sizes); for a placeholder without one, Dynamo's own fake of
    that input (``grapharg.fake_tensor``), never a fake made anew from the real input (constant sizes)."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if value is None and node.op == "placeholder":
        value = getattr(node.meta.get("grapharg"), "fake_tensor", None)
    return value


def token_symbols(fakes: list[Any], token_dim: int) -> frozenset[Any]:
    """The symbols of the token dimension: one per input Dynamo could not relate to the others (an input that
    only meets the rest inside an opaque op gets its own); the runner checks they agree at every call."""
    symbols = set()
    for fake in fakes:
        if isinstance(fake, torch.Tensor) and fake.dim() > token_dim:
            size = fake.shape[token_dim]
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                symbols.add(size.node.expr)
    return frozenset(symbols)


def classify_inputs(
    placeholders: list[torch.fx.Node], token_dim: int
) -> tuple[list[InputKind], Any, list[str], list[int]]:
    """Each input's kind, the token symbols, the inputs' source names, and which inputs are the caller's (not
    module state): those the runner stages into buffers of its own when they are not token inputs."""
    fakes = [fake_value(n) for n in placeholders]
    sym = token_symbols(fakes, token_dim)
    names = [_source_name(n) for n in placeholders]
    caller = [i for i, (n, f) in enumerate(zip(placeholders, fakes))
              if isinstance(f, torch.Tensor) and not _is_module_state(n, f)]
    static_count = None if sym else _static_token_count(placeholders, fakes, caller, token_dim)
    kinds = []
    for i, (name, fake) in enumerate(zip(names, fakes)):
        if isinstance(fake, torch.SymInt):
            if fake.node.expr not in sym:
                raise UnsupportedGraph(
                    f"graph input {name} is a symbolic size other than the token count; piecegraph buckets one "
                    "dynamic dimension (Config.token_dim). Mark only the token dimension dynamic."
                )
            kinds.append(InputKind.COUNT)
        elif isinstance(fake, torch.Tensor) and sym and _is_token_tensor(fake, token_dim, sym):
            kinds.append(InputKind.TOKENS)
        elif i in caller and static_count is not None and fake.dim() > token_dim and (
                fake.shape[token_dim] == static_count):
            kinds.append(InputKind.TOKENS)
        else:
            if isinstance(fake, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in fake.shape):
                raise UnsupportedGraph(
                    f"graph input {name} has symbolic shape {tuple(fake.shape)}: only dim {token_dim} may "
                    "be dynamic, and it must be the token count shared by all inputs. If it is not token-aligned, "
                    "name it in Config(static_inputs=...).", input=name,
                )
            kinds.append(InputKind.STATIC)
    return kinds, sym, names, caller


def _source_name(node: torch.fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    name = grapharg.source.name if grapharg is not None and grapharg.source is not None else node.name
    return name() if callable(name) else name  # Source.name is a method in older torch, a property in newer


def _is_module_state(node: torch.fx.Node, fake: torch.Tensor) -> bool:
    """A parameter, buffer or tensor attribute of a module, as Dynamo marks them (a static address), whatever
    the module or its ``self`` is called; it keeps its address across calls and is never staged."""
    if (node.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type") is not None:
        return True
    grapharg = node.meta.get("grapharg")
    example = getattr(grapharg, "example", None) if grapharg is not None else None
    return isinstance(example, torch.nn.Parameter) or isinstance(fake, torch.nn.Parameter)


def _static_token_count(placeholders: list[torch.fx.Node], fakes: list[Any], caller: list[int],
                        token_dim: int) -> int | None:
    """The token count of a static trace: the token-dim size most of the caller's local arguments share (ties:
    the first argument's). Only the call's own arguments count, never module state or globals."""
    sizes = [fakes[i].shape[token_dim] for i in caller
             if fakes[i].dim() > token_dim and _is_local_argument(placeholders[i])]
    if not sizes:
        return None
    return max(sizes, key=lambda s: (sizes.count(s), -sizes.index(s)))


def _is_local_argument(node: torch.fx.Node) -> bool:
    from torch._dynamo.source import is_from_local_source

    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    return source is not None and is_from_local_source(source, only_allow_input=True)


def _is_token_tensor(fake: torch.Tensor, token_dim: int, sym: Any) -> bool:
    if fake.dim() <= token_dim:
        return False
    size = fake.shape[token_dim]
    return isinstance(size, torch.SymInt) and size.node.expr in sym


def token_outputs(gm: torch.fx.GraphModule, token_dim: int, sym: Any, num_tokens: int | None) -> list[bool]:
    """Which of ``gm``'s outputs follow the token count along ``token_dim``: by the token symbols ``sym``, or in
    a static trace (``sym`` empty) by their size equal to its ``num_tokens``."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flags = []
    for arg in output.args[0]:
        fake = fake_value(arg) if isinstance(arg, torch.fx.Node) else None
        if not isinstance(fake, torch.Tensor) or fake.dim() <= token_dim:
            flags.append(False)
        elif sym:
            flags.append(_is_token_tensor(fake, token_dim, sym))
        else:
            flags.append(num_tokens is not None and fake.shape[token_dim] == num_tokens)
    return flags


def placeholder_facts(gm: torch.fx.GraphModule) -> tuple[list[Any], list[str], list[bool]]:
    """Each placeholder's fake, Dynamo source name and whether it is module state: what a graph snapshot
    (trace/snapshot.py) records of Dynamo's metadata."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [fake_value(n) for n in placeholders]
    return (fakes, [_source_name(n) for n in placeholders],
            [isinstance(f, torch.Tensor) and _is_module_state(n, f) for n, f in zip(placeholders, fakes)])


def traced_token_count(example_inputs: list[Any], kinds: list[InputKind], token_dim: int) -> int | None:
    """The token count the token inputs of ``example_inputs`` share, or ``None`` when they do not agree."""
    counts = {x.shape[token_dim] for x, k in zip(example_inputs, kinds)
              if k is InputKind.TOKENS and x.dim() > token_dim}
    return counts.pop() if len(counts) == 1 else None
