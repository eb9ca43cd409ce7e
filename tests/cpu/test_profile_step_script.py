"""scripts/profile_step.py's closed loop, the c10 workload's shape: never more requests in the engine than the
concurrency, every request served to its length, and each arrival's prompt prefilled beside running decode rows."""

from __future__ import annotations

import torch
from script_helpers import load_script

from piecegraph.models import TINY, Decoder
from piecegraph.serve.config import EngineConfig
from piecegraph.serve.engine import Engine


def test_closed_loop_keeps_the_concurrency_and_serves_every_request():
    script = load_script("profile_step")
    model = Decoder.random(TINY, dtype=torch.float32)
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=16, max_num_batched_tokens=256, page_size=8,
                                        max_seq_len=64))
    added, finished, live_at_add = [], [], []
    add, step = engine.add_request, engine.step

    def counting_add(prompt, params=None, **kw):
        request = add(prompt, params, **kw)
        added.append(request)
        live_at_add.append(len(added) - len(finished))
        return request

    def counting_step():
        done = step()
        finished.extend(done)
        return done

    engine.add_request, engine.step = counting_add, counting_step
    script._closed_loop(engine, TINY.vocab_size, torch.Generator().manual_seed(0), count=9, prompt=12, new=8,
                        running=3, spread=0.25)
    assert len(added) == 9 and sorted(map(id, finished)) == sorted(map(id, added))
    assert max(live_at_add) == 3  # filled to the concurrency, never past it
    assert all(9 <= len(r.prompt) <= 15 and len(r.output) == r.params.max_new_tokens for r in finished)
    assert all(6 <= r.params.max_new_tokens <= 10 for r in finished)
    assert len({r.params.max_new_tokens for r in finished}) > 1  # lengths spread, so arrivals are staggered
    mixed = [s for s in engine.steps if s.prefill_tokens > s.decode_rows > 0]
    assert mixed, "no arrival was prefilled beside running decode rows"


def test_timeline_marks_every_forward_and_reads_its_host_time(tmp_path):
    """The timeline profile's trace has one ``forward`` range per engine step, in launch order, and each range's
    host time lies within the step's own forward phase (which also samples and starts the token copy)."""
    script = load_script("profile_step")
    timeline = script
    model = Decoder.random(TINY, dtype=torch.float32)
    [row] = script.timeline_rows(model, "auto", False, TINY.vocab_size, tmp_path)
    steps = row["steps"]
    assert (tmp_path / row["trace"]).stat().st_size > 0
    labels = {s["kind"] for s in steps}
    assert {"piecewise:prefill", "piecewise:mixed", "full:decode"} <= labels, labels
    import gzip
    import json

    trace = json.loads(gzip.open(tmp_path / row["trace"], "rt").read())
    assert timeline.forward_rows(trace, [s["kind"] for s in steps]) == steps
    by_kind = timeline.summarize(steps)
    assert sum(v["steps"] for v in by_kind.values()) == len(steps)
    assert all(s["host_ms"] > 0 and s["kernels"] == 0 for s in steps)  # CPU: no device events
