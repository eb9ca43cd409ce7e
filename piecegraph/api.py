"""``piecegraph.compile``: the public entry point."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .config import Config
from .graphed_module import GraphedModule


def compile(  # noqa: A001 - mirrors torch.compile on purpose
    model: torch.nn.Module,
    *,
    mode: str = "piecewise",
    split_ops: Iterable[Any] | None = None,
    capture_sizes: Iterable[int] | None = None,
    max_tokens: int = 512,
    compiler: str = "inductor",
    config: Config | None = None,
    **options: Any,
) -> GraphedModule:
    """Trace ``model`` with Dynamo, split it at split ops, compile each piece once and replay CUDA graphs.

    Constraints: ``model.forward`` takes tensors whose dim ``token_dim`` (0) counts tokens, plus non-tensor
    arguments that never change; it returns a tensor or a tuple of tensors; it must trace with
    ``fullgraph=True`` (see ``piecegraph doctor`` when it does not). Split ops (attention) run eagerly between
    pieces and must write their tensor results into buffers they were given. Nothing runs until the first call.

    Example::

        graphed = piecegraph.compile(model, max_tokens=256)
        with piecegraph.forward_context(metadata):
            hidden = graphed(input_ids, positions)   # traced, compiled and captured for this size
        graphed.stats()  # {'sizes': [8], 'pieces': 25, 'capture_s': {8: 0.4}, ...}

    Pass ``config=Config(...)`` for every option at once; keyword options override its fields.
    """
    base = config or Config()
    fields = dict(mode=mode, max_tokens=max_tokens, compiler=compiler, **options)
    if split_ops is not None:
        fields["split_ops"] = tuple(split_ops)
    if capture_sizes is not None:
        fields["capture_sizes"] = tuple(capture_sizes)
    if config is not None:  # explicit keywords win over the config only where they differ from the defaults
        defaults = Config()
        fields = {k: v for k, v in fields.items() if k not in ("mode", "max_tokens", "compiler") or v != getattr(defaults, k)}
    return GraphedModule(model, base.replace(**fields))
