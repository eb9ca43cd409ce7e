"""Per-step records of the engine and their summary: which graph kind each step used, tokens, padding, time."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from piecegraph.serve.executor import GRAPH_KINDS

PHASES = ("schedule", "metadata", "forward_launch", "sample_sync")


@dataclass(frozen=True)
class StepStats:
    """One engine step.

    ``kind``: what ran (``full``, ``piecewise``, ``breakable``: a graph replayed; ``none``: compiled pieces
    without a graph; ``eager``). ``tokens`` real tokens, ``padded`` the size the module ran them at (the bucket),
    ``seqs`` rows, ``decode_rows`` rows adding one token to a cached context, ``prefill_tokens`` the rest,
    ``sampled`` rows that emitted a token, ``preempted`` requests preempted while scheduling it, ``seconds`` wall
    time from scheduling to the tokens on the host, split into ``phases`` (:data:`PHASES`: scheduling; input ids
    and metadata, the backend's plan included; the forward call on the host, which on a GPU only launches; logits,
    sampling and the host sync that waits for the device; overlapped, that is the wait for this step's tokens one
    step later, while the next step runs). ``plan_s`` / ``plans``: the attention backend's planning seconds and
    plan calls in this step (FlashInfer ``plan()``; the torch backend's mask and index layout), part of the
    metadata or launch phase.
    """

    kind: str
    is_decode: bool
    tokens: int
    padded: int
    seqs: int
    decode_rows: int
    prefill_tokens: int
    sampled: int
    preempted: int
    seconds: float
    phases: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    plan_s: float = 0.0
    plans: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(steps: Sequence[StepStats]) -> dict[str, Any]:
    """Steps by kind, the share that replayed a graph, padding, preemptions and mean ms per kind."""
    kinds = Counter(s.kind for s in steps)
    tokens = sum(s.tokens for s in steps)
    padded = sum(s.padded for s in steps)
    ms: dict[str, float] = {}
    phase_ms: dict[str, dict[str, float]] = {}
    plan_us: dict[str, float] = {}
    plans: dict[str, float] = {}
    for kind in kinds:
        mine = [s for s in steps if s.kind == kind]
        ms[kind] = round(1e3 * sum(s.seconds for s in mine) / len(mine), 4)
        plan_us[kind] = round(1e6 * sum(s.plan_s for s in mine) / len(mine), 2)
        plans[kind] = round(sum(s.plans for s in mine) / len(mine), 3)
        phase_ms[kind] = {name: round(1e3 * sum(s.phases[i] for s in mine) / len(mine), 4)
                          for i, name in enumerate(PHASES)}
    return {
        "steps": len(steps),
        "by_kind": dict(sorted(kinds.items())),
        "decode_steps": sum(s.is_decode for s in steps),
        "graph_share": sum(kinds[k] for k in GRAPH_KINDS) / len(steps) if steps else 0.0,
        "tokens": tokens,
        "padding_share": (padded - tokens) / padded if padded else 0.0,
        "preempted": sum(s.preempted for s in steps),
        "ms_per_step": ms,
        "phase_ms": phase_ms,  # mean host ms per phase of a step, by kind: where a step's time goes
        "plan_us": plan_us,  # mean attention-plan microseconds per step, by kind
        "plans_per_step": plans,  # mean backend plan calls per step, by kind (FlashInfer: at most 1)
        "max_plans_per_step": max((s.plans for s in steps), default=0),
    }
