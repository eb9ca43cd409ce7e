"""One step's token inputs: input ids on the device (in-flight tokens gathered there) and what to sample.

The overlapped engine schedules step k+1 before the host knows step k's tokens, so a decode row's input id may
be a token that exists only on the device. The host sends what it knows (one packed, pinned, non-blocking copy
with a 0 where a token is in flight) and a scatter list: ``input_ids[dst] = previous_tokens[src]``, done on the
device. Nothing here reads the device back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from piecegraph.attention.metadata import to_device
from piecegraph.serve.request import Request
from piecegraph.serve.scheduler import Row


@dataclass
class StepInputs:
    """``input_ids`` ``[T]`` (device); ``last_rows``: each sampling row's last token in the flat batch (device),
    ``None`` when every row samples its only token (a decode step: no gather); ``sampled``: those rows'
    requests, in row order."""

    input_ids: torch.Tensor
    last_rows: torch.Tensor | None
    sampled: list[Request]


def build_inputs(rows: Sequence[Row], device: torch.device, previous_tokens: torch.Tensor | None = None,
                 previous_index: dict[Request, int] | None = None) -> StepInputs:
    """The inputs of ``rows``. A row whose last token is in flight (sampled by the step still running, not yet
    on the host) takes it from ``previous_tokens[previous_index[request]]`` on the device; only the last token of
    a row can be in flight, and only one per request (the engine resolves a step before scheduling the next but
    one)."""
    flat: list[int] = []
    dst: list[int] = []
    src: list[int] = []
    ends: list[int] = []
    sampled: list[Request] = []
    offset = 0
    # Once per row every step (1000+ rows): Request properties are inlined; a decode row whose token is in
    # flight reads no host token at all.
    for request, cached, new in rows:
        stop = cached + new
        known = len(request.prompt) + len(request.output)
        if stop > known:
            if stop != known + 1 or previous_index is None or request not in previous_index:
                raise RuntimeError(f"request {request.id!r}: row [{cached}, {stop}) needs {stop - known} tokens "
                                   "the host does not know and the running step did not sample (engine bug)")
            flat += request.token_slice(cached, known)  # empty for a decode row: its token is in flight
            flat.append(0)  # placeholder, overwritten on the device
            dst.append(offset + new - 1)
            src.append(previous_index[request])
        else:
            flat += request.token_slice(cached, stop)
        offset += new
        if stop == known + request.inflight:  # Row.samples: the row ends at the request's last token
            ends.append(offset - 1)
            sampled.append(request)
    every = len(ends) == offset
    host = {"input_ids": flat, "dst": dst, "src": src, "ends": [] if every else ends}
    dev = to_device(host, device)
    ids = dev["input_ids"]
    if dst:
        ids.index_copy_(0, dev["dst"], previous_tokens.index_select(0, dev["src"]))
    return StepInputs(ids, None if every else dev["ends"], sampled)
