"""``mode="auto"``, the policy: piecewise; else the fixes the advisor knows, then piecewise again; else breakable
CUDA graphs (eager on CPU), with one warning naming the blockers. The mechanics (tracing, breakable setup) stay in
:class:`~piecegraph.graphed.module.GraphedModule`, which calls :func:`setup_auto`."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch

from ..config import Config
from ..graphs.fallback import Advisor, TraceFixes, fallback_warning, wrapped_warning
from .binding import scratch_arguments

log = logging.getLogger("piecegraph")


def piecewise_config(config: Config) -> tuple[Config, float | None]:
    """The config auto traces piecewise with, and how many captured sizes it verifies (its first, by default)."""
    # compile_sizes=None: static code where the dynamic code is likely slow (see Config.compile_sizes)
    compile_sizes = "reductions" if config.compile_sizes is None else config.compile_sizes
    piecewise = config.replace(mode="piecewise", verify=bool(config.verify), compile_sizes=compile_sizes)
    return piecewise, (1 if config.verify is None else None)


def setup_auto(model: torch.nn.Module, values: dict[str, Any], config: Config, advisor: Advisor,
               try_trace: Callable[[dict[str, Any], Config, float | None], Exception | None],
               setup_breakable: Callable[..., None]) -> TraceFixes | None:
    """Set the module up for ``values`` under auto's policy. ``try_trace(values, config, verify_sizes)`` traces
    piecewise and returns the error (the module reset) or None; ``setup_breakable(values, config, graphs=)``
    falls back. The advisor's runs get copies of the arguments. Returns what the advisor's fixes did (None: the
    model traced as it was)."""
    piecewise, verify_sizes = piecewise_config(config)  # auto checks its first capture by default
    error = try_trace(values, piecewise, verify_sizes)
    fixed = None
    summary = ""
    if error is not None:
        # automatic opaque included; its rounds end as soon as this module traces after a fix
        def retrace() -> Exception | None:
            return try_trace(values, piecewise, verify_sizes)

        fixed = advisor.fix_trace(model, scratch_arguments(values), config, retrace=retrace)
        summary = fixed.summary
        if fixed.fixes:
            error = fixed.trace_error(retrace)
            summary = fixed.remaining  # the blockers the fixes left are the ones to name
    if error is None:
        if fixed is not None and fixed.wrapped:
            warnings.warn(wrapped_warning(fixed.wrapped, "piecewise"), stacklevel=5)
        elif fixed is not None and fixed.fixes:
            log.info("piecegraph auto: piecewise after applying %s", ", ".join(fixed.fixes))
        return fixed
    if fixed is not None:
        fixed.release()  # the eager fallback does not need the wrapped functions routed
    on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in values.values())
    # Breakable capture cannot see token-mixing ops (there is no trace): verify each size against the unpadded
    # run unless the caller said otherwise.
    verify = True if config.verify is None else config.verify
    setup_breakable(values, piecewise.replace(mode="breakable", verify=verify), graphs=on_cuda)
    summary = summary or advisor.summarize(model, scratch_arguments(values), error)
    fixes, refused = (fixed.fixes, fixed.refused) if fixed is not None else ([], {})
    warnings.warn(fallback_warning(summary, fixes, "breakable CUDA graphs" if on_cuda else "eager", refused),
                  stacklevel=5)
    return None
