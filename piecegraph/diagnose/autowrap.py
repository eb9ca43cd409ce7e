"""Automatic opaque from the doctor's findings: which library functions to wrap, and their inferred fakes.

:func:`library_entries` lists the public functions (:mod:`piecegraph.diagnose.entry`) of every break inside an
installed package, except those the FlashInfer adapter covers (its fakes are written by hand) and opaque ops.
:func:`plan_wraps` records their calls in one eager forward of the model (a second one at ``tokens + 2`` tells
the token dimensions apart; under a forward context its extra rows are pad rows) and infers each fake
(:mod:`piecegraph.ops.auto_opaque`); nothing is registered or routed yet, so the doctor can print the lines
and ``--fix`` / auto mode apply them.

Constraint: the recorded forwards run on copies of the call's tensors (the caller's are never written), under the
forward context given; they are eager runs of the model like prewarm's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from piecegraph.diagnose.attribute import Finding
from piecegraph.diagnose.entry import Entry
from piecegraph.diagnose.trace import run_under
from piecegraph.ops.auto_opaque import AutoOp, infer, record_calls
from piecegraph.ops.modules import identity
from piecegraph.ops.opaque import is_opaque
from piecegraph.ops.probe_calls import ProbeRefused
from piecegraph.program import token_arguments

__all__ = ["Wrapping", "adapter_covers", "library_entries", "plan_wraps"]

log = logging.getLogger("piecegraph.doctor")
ONE_TOKEN_RECORDED = 3  # a one-token call is recorded at this many (3, not 2: fewer static sizes equal it)
_NOT_OURS = ("user", "torch", "piecegraph")


@dataclass
class Wrapping:
    """Inferred ops (entry name -> :class:`~piecegraph.ops.auto_opaque.AutoOp`, not registered yet) and the entries
    that cannot be wrapped (name -> why)."""

    ops: dict[str, AutoOp] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)


def adapter_covers(package: str, entry: Optional[str]) -> bool:
    """Whether ``piecegraph.adapters.flashinfer`` adapts the function named ``entry`` (``flashinfer.rmsnorm``)."""
    if package != "flashinfer" or not entry:
        return False
    from piecegraph.adapters.flashinfer_specs import fake_specs

    return entry.rsplit(".", 1)[-1] in fake_specs()


def finding_entries(f: Finding) -> list[Entry]:
    """The library entries a finding names: its own and those of other stacks that broke at the same place."""
    return [e for e in (f.entry_ref, *f.more_entries) if e is not None]


def library_entries(findings: list[Finding]) -> list[Entry]:
    """The entries automatic opaque may wrap, once each, in the order found."""
    found: dict[int, Entry] = {}
    for f in findings:
        if f.kind != "trace" or f.package in _NOT_OURS:
            continue
        for e in finding_entries(f):
            if not adapter_covers(f.package, e.alias) and not is_opaque(e.fn):
                found.setdefault(identity(e.fn), e)
    return list(found.values())


def _tile(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    index = torch.arange(n, device=t.device) % t.shape[dim]
    return t.index_select(dim, index)


def model_runner(model: Callable, args: tuple, kwargs: dict, context: Any, token_dim: int = 0,
                 static: tuple = ()) -> tuple[int, Callable[[int], Any]]:
    """``(tokens, run)``: the call's token count and ``run(n)``, one eager forward at ``n`` tokens on copies of
    the arguments (token inputs cut or tiled along ``token_dim``, other tensors cloned)."""
    values = {f"#{i}": a for i, a in enumerate(args)} | dict(kwargs)
    names = token_arguments(values, token_dim, tuple(s for s in static if s in values))
    first = next((k for k in values if k in names), None)
    tokens = values[first].shape[token_dim] if first is not None else 0

    def run(n: int) -> Any:
        new = {k: _tile(v, token_dim, n) if k in names else v.clone() if isinstance(v, torch.Tensor) else v
               for k, v in values.items()}
        call_args = [new[f"#{i}"] for i in range(len(args))]
        return run_under(context, lambda: model(*call_args, **{k: new[k] for k in kwargs}))

    return tokens, run


def plan_wraps(model: Callable, args: tuple, kwargs: dict, context: Any, entries: list[Entry],
               token_dim: int = 0, static: tuple = ()) -> Wrapping:
    """Record ``entries``' calls in the model's forward and infer each one's fake (see the module docstring)."""
    plan = Wrapping()
    if not entries:
        return plan
    tokens, run = model_runner(model, args, kwargs, context, token_dim, static)
    if tokens == 0:
        plan.refused = {e.alias: "the model has no tensor input with a token dimension to probe" for e in entries}
        return plan
    # With one token every size-1 dimension looks like the token one: record at a few tokens instead (rows tiled
    # from the call's). Under a forward context the metadata fixes the token count: the extra rows of this run and
    # of the twin are pad rows, as a capture's are; a model that refuses them is recorded without a twin.
    tokens = max(tokens, ONE_TOKEN_RECORDED)
    try:
        calls = record_calls([e.fn for e in entries], run, tokens, tokens + 2, model)
    except Exception as err:  # noqa: BLE001  (the recorded forward failed: nothing can be inferred)
        plan.refused = {e.alias: f"the recorded forward raised {type(err).__name__}: {err}" for e in entries}
        return plan
    for e in entries:
        try:
            plan.ops[e.alias] = infer(e.fn, e.alias, calls.get(id(e.fn), []), e.target)
        except ProbeRefused as err:
            plan.refused[e.alias] = str(err)
            log.info("automatic opaque: %s not wrapped: %s", e.alias, err)
    return plan
