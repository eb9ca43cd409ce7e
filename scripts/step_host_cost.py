"""Host cost of building one serving step, per function, without running the model (CPU is enough).

Drives the engine's per-step host work the way the overlapped engine does (schedule step k+1, build its inputs
and attention metadata, then learn step k's tokens), on a torch-backend :class:`KVCache` of a tiny shape (the cost
measured here does not depend on the model: only on rows, tokens and pages), and times each piece:

- ``schedule``: :meth:`Scheduler.schedule` (pages reserved there);
- ``build_inputs``: :func:`piecegraph.serve.inputs.build_inputs` (one in-flight token per decode row);
- ``for_batch``: :meth:`AttentionMetadata.for_batch` as the FlashInfer backend sees it (no dense page table, lazy
  plan: the backend's ``plan`` is a stub that only records the layout);
- ``for_batch_dense``: the same with a backend that reads the dense decode page table (the torch backend's
  path; its own mask planning is left out, it is not step-building work);
- ``page_layout``: the FlashInfer backend's ``flashinfer_layout.page_layout`` (host half of its eager plan,
  ``kv_indices`` gathered from the cache's device page table), pure Python/torch, so it runs on CPU.

Workloads (page size 16, token budget 2048): ``decode`` = N running sequences of 512-560 tokens each adding one
token; ``mixed`` = the same N decode rows plus prompts of 512-640 tokens prefilled (chunked) in the rest of the
budget; a request finishes when its first token is known, so N stays fixed. N = 256 and 1024 by default. Prints
the median microseconds per step of each function (after a few warm-up steps, garbage collection off);
``--json PATH`` writes them too. On a GPU host the numbers are host time only; device work is never waited for.
The numbers move with the host's load: compare before/after runs made back to back (e.g. an older checkout first
on ``PYTHONPATH``); the script uses only public APIs, so it runs on either.

Usage: ``python scripts/step_host_cost.py [--rows 256 1024] [--steps 60] [--json OUT.json]``
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections import defaultdict
from typing import Callable

import torch

from piecegraph.attention import AttentionMetadata
from piecegraph.attention.backends.flashinfer_layout import page_layout
from piecegraph.attention.kv_cache import KVCache
from piecegraph.models import TINY
from piecegraph.serve.inputs import build_inputs
from piecegraph.serve.request import Request, SamplingParams, Status
from piecegraph.serve.scheduler import Scheduler

PAGE_SIZE, BUDGET, MAX_LEN = 16, 2048, 1024


class _StubBackend:
    """Stands in for an attention backend: records nothing, plans nothing (what is timed is step building)."""

    name = "stub"

    def __init__(self, reads_page_table: bool) -> None:
        self.reads_page_table = reads_page_table

    def plan(self, meta: AttentionMetadata) -> None:
        pass


def _workload(rows: int, mixed: bool, seed: int) -> tuple[Scheduler, Callable[[int], Request]]:
    """A scheduler whose ``rows`` running requests decode (context 512-560), and for ``mixed`` a maker of
    prompts of 512-640 tokens."""
    rng = random.Random(seed)
    shape = TINY.replace(num_layers=1, max_seq_len=MAX_LEN)
    pages = (rows + 64) * (MAX_LEN // PAGE_SIZE) + 1
    cache = KVCache(shape, pages, PAGE_SIZE, backend="torch")
    scheduler = Scheduler(cache, BUDGET, rows + 8)
    for i in range(rows):
        prompt = tuple(rng.randrange(256) for _ in range(rng.randrange(511, 560)))
        request = Request.make(("d", i), prompt, SamplingParams(max_new_tokens=400))
        request.output.append(rng.randrange(256))  # decoding: its next input is this token
        request.num_computed = len(prompt)
        request.status = Status.RUNNING
        cache.reserve([(request.id, len(prompt) + 1)])
        scheduler.running.append(request)

    def prompt(i: int) -> Request:
        return Request.make(("p", i), tuple(rng.randrange(256) for _ in range(rng.randrange(512, 641))),
                            SamplingParams(max_new_tokens=1))
    return scheduler, prompt


def _run(rows: int, mixed: bool, steps: int, warmup: int = 4, seed: int = 0) -> dict[str, float]:
    scheduler, prompt = _workload(rows, mixed, seed)
    cache = scheduler.cache
    lazy, dense = _StubBackend(False), _StubBackend(True)
    times: dict[str, list[float]] = defaultdict(list)
    previous = None  # (sampled requests, their index) of the step "running on the device"
    clock = time.perf_counter
    for step in range(warmup + steps):
        while mixed and len(scheduler.waiting) < 4:
            scheduler.add(prompt(step * 8 + len(scheduler.waiting)))
        t0 = clock()
        batch = scheduler.schedule()
        t1 = clock()
        prev = (torch.zeros(len(previous[0]), dtype=torch.int64), previous[1]) if previous else (None, None)
        inputs = build_inputs(batch.rows, cache.device, *prev)
        t2 = clock()
        seqs = [(r.request.id, r.cached, r.new) for r in batch.rows]
        cache.backend = lazy
        meta = AttentionMetadata.for_batch(cache, seqs)
        t3 = clock()
        page_layout(meta.layout, cache.device, table=cache.device_table())
        t4 = clock()
        cache.backend = dense
        AttentionMetadata.for_batch(cache, seqs)
        t5 = clock()
        if step >= warmup:
            for name, a, b in (("schedule", t0, t1), ("build_inputs", t1, t2), ("for_batch", t2, t3),
                               ("page_layout", t3, t4), ("for_batch_dense", t4, t5)):
                times[name].append((b - a) * 1e6)
            times["tokens"].append(batch.num_tokens)
            times["rows"].append(len(batch.rows))
        for r in batch.rows:  # what Engine._launch does once the step is launched
            r.request.num_computed += r.new
            if r.samples:
                r.request.inflight += 1
        if previous is not None:  # what Engine._resolve does with the previous step's tokens
            for request in previous[0]:
                if request.status is Status.FINISHED:
                    continue
                request.append(7, 0.0)
                if request.finish_reason is not None:
                    scheduler.finish(request)
        previous = (inputs.sampled, {q: i for i, q in enumerate(inputs.sampled)})
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the engine's host thread: per-step work is small, threads only add noise
    gc.disable()  # a collection landing in one timed function is noise here (medians of a few dozen steps)
    results = {}
    names = ("schedule", "build_inputs", "for_batch", "page_layout", "for_batch_dense")
    print(f"{'workload':>12} {'rows':>5} {'tokens':>6} " + " ".join(f"{n:>15}" for n in names) + f" {'sum':>8}")
    for rows in args.rows:
        for mixed in (False, True):
            key = f"{'mixed' if mixed else 'decode'}_{rows}"
            med = results[key] = _run(rows, mixed, args.steps)
            total = sum(med[n] for n in names[:4])
            print(f"{key:>12} {med['rows']:>5.0f} {med['tokens']:>6.0f} "
                  + " ".join(f"{med[n]:>15.1f}" for n in names) + f" {total:>8.1f}")
    print("median us per step; sum = schedule + build_inputs + for_batch + page_layout (the FlashInfer path)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"unit": "median us per step", "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
