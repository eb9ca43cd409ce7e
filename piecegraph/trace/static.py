"""Static compiles per size (``Config(compile_sizes=...)``, as vLLM's ``compile_sizes``).

Inductor's code for a symbolic token count can be several times slower than code compiled for one size (a
reduction over the whole tensor at 256 tokens, measured 0.41 ms against 0.14 ms). The trace is made once, with
the token count symbolic; for each chosen size the same piece is compiled again on fake inputs whose token
dimension is that size, so no second Dynamo trace runs and the dynamic compile keeps serving every other size.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

import torch

log = logging.getLogger("piecegraph")


def concrete_size(value: Any, subs: dict[Any, Any]) -> int:
    """``value`` (an int, or a SymInt of the trace) as a number once ``subs`` fixes the token symbols;
    ``ValueError`` when it depends on another symbol."""
    if isinstance(value, torch.SymInt):
        out = value.node.expr.xreplace(subs)
        if not out.is_Integer:
            raise ValueError(f"size {value} does not become a number when the token count is fixed")
        return int(out)
    return int(value)


def static_fakes(fake_args: Iterable[Any], token_symbols: Iterable[Any], size: int) -> list[Any]:
    """``fake_args`` (the trace's fakes, token count symbolic) as fakes of a fresh static mode where every token
    symbol is ``size``: same dtypes, devices and strides. Raises ``ValueError`` when a size depends on another
    symbol."""
    # Imported here, not at module level: sympy and the shape env cost ~0.5 s that `import piecegraph` must not pay.
    import sympy
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    subs = {sym: sympy.Integer(size) for sym in token_symbols}
    mode = FakeTensorMode(shape_env=ShapeEnv())
    out: list[Any] = []
    for arg in fake_args:
        if isinstance(arg, torch.SymInt):
            out.append(concrete_size(arg, subs))
        elif isinstance(arg, torch.Tensor):
            shape = [concrete_size(s, subs) for s in arg.shape]
            stride = [concrete_size(s, subs) for s in arg.stride()]
            with mode:
                out.append(torch.empty_strided(shape, stride, dtype=arg.dtype, device=arg.device))
        else:
            out.append(arg)
    return out


def compile_static(gm: torch.fx.GraphModule, fake_args: list[Any], token_symbols: Iterable[Any],
                   sizes: Iterable[int], name: str, single_output: bool) -> tuple[dict[int, Callable[..., Any]], float]:
    """``{size: gm compiled by Inductor for that token count}`` and the seconds it took. A size whose shapes do
    not follow from the token count alone is skipped (logged): the dynamic compile serves it.

    ``single_output``: ``gm`` returned one value before its dynamic compile. Inductor rewrites such a graph in
    place to return a 1-tuple (and unwraps its own result), so a later compile of the same module returns a
    one-element list, which is unwrapped here to keep the piece's calling convention.
    """
    from torch._inductor.compile_fx import compile_fx

    symbols = list(token_symbols)
    compiled: dict[int, Callable[..., Any]] = {}
    start = time.perf_counter()
    for size in sizes:
        try:
            args = static_fakes(fake_args, symbols, size)
        except ValueError as err:
            log.info("piecegraph: no static compile of %s at %d tokens: %s", name, size, err)
            continue
        log.debug("piecegraph: compiling %s for %d tokens", name, size)
        with _static_context(args):
            fn = compile_fx(gm, args)
        compiled[size] = _first(fn) if single_output else fn
    return compiled, time.perf_counter() - start


def _static_context(args: list[Any]) -> Any:
    """The static fakes' own mode as the only one Inductor sees: the caller runs under the trace's fake mode and
    tracing context (Dynamo's on a first trace, the restored graph's on a start from the cache), and Inductor
    refuses inputs of another mode than the active one (a start from the cache failed so, on a GPU, for any
    piece compiled per size)."""
    import contextlib

    from torch._guards import TracingContext, tracing
    from torch.utils._python_dispatch import _disable_current_modes

    mode = next((a.fake_mode for a in args if isinstance(a, torch.Tensor) and hasattr(a, "fake_mode")), None)
    if mode is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(_disable_current_modes())
    stack.enter_context(tracing(TracingContext(mode)))
    return stack


def returns_one_value(gm: torch.fx.GraphModule) -> bool:
    """Whether Inductor will rewrite ``gm`` to return a tuple: its output is one value, not a list or tuple, nor
    one op with several tensor results (which Inductor treats as a tuple already)."""
    (value,) = next(n for n in gm.graph.nodes if n.op == "output").args
    if isinstance(value, (list, tuple)):
        return False
    returns = getattr(getattr(getattr(value, "target", None), "_schema", None), "returns", ())
    return not (len(returns) > 1 and all(str(r.type) == "Tensor" for r in returns))


def _first(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        return fn(*args)[0]

    return call
