"""``torch.compile(model, backend="piecegraph")``: the Dynamo backend entry point (registered through the
``torch_dynamo_backends`` entry point). It sits above the trace stage and the runner, so neither imports the
other lazily."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .config import Config
from .program import check_token_dim
from .runner.flat import FlatRunner
from .trace.backend import build_program, graph_memory


def piecegraph_backend(
    gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None, mode: Any = None
) -> Callable[..., Any]:
    """``torch.compile(model, backend="piecegraph", options={...})``: ``options`` are :class:`Config` fields
    (or ``{"config": Config(...)}``). Mark the token dimension dynamic (``torch._dynamo.mark_dynamic(x, 0)`` or
    ``dynamic=True``) so one trace serves every size; a static trace captures only its own size.
    """
    if mode not in (None, "default"):
        raise ValueError(
            f"torch.compile(..., backend='piecegraph', mode={mode!r}): that mode is Inductor's; piecegraph's mode "
            "goes in options, e.g. options={'mode': 'piecewise'} (piecewise | full | none | breakable | auto)"
        )
    options = dict(options or {})
    config = options.pop("config", None) or Config()
    if options:
        config = config.replace(**options)
    memory = graph_memory(gm, config)
    program = build_program(gm, example_inputs, config)
    check_token_dim({program.names[i]: example_inputs[i] for i in program.caller_inputs}, config.token_dim)
    return FlatRunner(program, config, memory=memory)
