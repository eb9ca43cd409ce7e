"""Auto's decode choice: which module (full or piecewise graphs) replays each decode size, by the rule on CPU or
measured; timed again once per swap of the full module's program and kept when a timing fails; timed on steps
launched back to back, each with its own metadata, when steps overlap; and the timing rows themselves (token ids
that spread over a router's experts, half of max_seq_len of context as far as the free pages allow, every page
returned)."""

import logging

import pytest
import serve_helpers
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_helpers import MAX_NEW, PAGE_SIZE, PROMPTS, small_engine_config

from piecegraph.serve import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
model, expected = serve_helpers.model, serve_helpers.expected  # module-scoped fixtures: built once in this module


def test_auto_replays_the_decode_module_measured_faster_per_size(model, expected):
    """On CPU the rule (full everywhere) is recorded; a timer that finds piecewise faster at size 2 makes decode
    steps of 2 rows replay piecewise graphs and size 1 keep full graphs, with the same tokens."""
    engine = Engine(model, small_engine_config("auto", num_pages=15))
    choice = engine.capture_report()["decode_choice"]
    assert {n: c["pick"] for n, c in choice.items()} == {1: "full", 2: "full"}
    assert all(c["by"] == "rule" and c["full_ms"] is None for c in choice.values())
    times = {("full", 1): 1.0, ("piecewise", 1): 2.0, ("full", 2): 3.0, ("piecewise", 2): 2.5}
    engine.executor.choose_decode(lambda slot, n: times[slot.kind, n])
    choice = engine.capture_report()["decode_choice"]
    assert choice[2] == {"pick": "piecewise", "full_ms": 3.0, "piecewise_ms": 2.5, "by": "measured",
                         "when": "capture"}
    assert choice[1]["pick"] == "full"
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW)) == expected
    decode = [s for s in engine.steps if s.is_decode and s.tokens <= 2]
    assert {s.kind for s in decode if s.tokens == 1} == {"full"}
    assert {s.kind for s in decode if s.tokens == 2} == {"piecewise"}


def test_auto_times_its_decode_choice_again_after_the_full_module_swapped_its_program(model, expected,
                                                                                       monkeypatch, caplog):
    """A step first lets the full module look for its background package (a stand-in swap here; the real one is
    tests/cpu/test_aot_background.py's), then, once it swapped, times the decode choice again: full graphs were
    slower than piecewise before, faster after, and the steps follow. Without a swap nothing is timed again."""
    engine = Engine(model, small_engine_config("auto", num_pages=15))
    module = engine.executor.decode.module
    timings = []

    def timer(cache):
        def time_one(slot, n):
            timings.append((slot.kind, n))
            return 1.0 if slot.kind == "piecewise" else (0.5 if module.swaps else 2.0)
        return time_one

    monkeypatch.setattr(engine.executor, "decode_timer", timer)
    engine.executor.choose_decode(timer(None))
    params = SamplingParams(max_new_tokens=MAX_NEW)
    assert engine.generate(PROMPTS, params) == expected
    assert len(timings) == 4  # two sizes, two modules, once: no swap, no timing again
    assert {s.kind for s in engine.steps if s.is_decode and s.tokens <= 2} == {"piecewise"}
    looks, swapped = [], [1]

    def poll_upgrade():  # a worker's package appears: the next look swaps it in
        looks.append(module.swaps)
        module.swaps = swapped[0]
        return True

    monkeypatch.setattr(module, "poll_upgrade", poll_upgrade)
    steps = len(engine.steps)
    assert engine.generate(PROMPTS, params) == expected
    assert looks and len(timings) == 8  # looked at every step; timed again once, after the swap
    choice = engine.capture_report()["decode_choice"]
    assert {(c["pick"], c["when"]) for c in choice.values()} == {("full", "swap")}
    assert {s.kind for s in engine.steps[steps:] if s.is_decode and s.tokens <= 2} == {"full"}

    def failing(cache):  # a timing that fails after a later swap: the step goes on with the choice it had
        def time_one(slot, n):
            raise RuntimeError("CUDA error: out of memory (timing)")
        return time_one

    monkeypatch.setattr(engine.executor, "decode_timer", failing)
    swapped[0] = 2
    with caplog.at_level(logging.WARNING, logger="piecegraph"):
        assert engine.generate(PROMPTS, params) == expected
    assert "timing the decode choice again after the full module's swap failed (RuntimeError" in caplog.text
    assert engine.capture_report()["decode_choice"] == choice
    assert caplog.text.count("timing the decode choice again") == 1  # once per swap, not once per step


class _Swapping:
    """A full module stand-in: its program is swapped (``swaps`` counts) when the next look is told to."""

    def __init__(self):
        self.swaps, self.pending = 0, False

    def poll_upgrade(self):
        swapped, self.pending = self.pending, False
        self.swaps += swapped
        return swapped


@settings(max_examples=60, deadline=None)
@given(events=st.lists(st.tuples(st.booleans(), st.sampled_from([None, 0, 1, 2, 3]), st.booleans()), max_size=12))
def test_refresh_times_the_decode_choice_once_per_swap_and_keeps_the_last_one_when_a_timing_fails(events):
    """Any sequence of steps, each maybe after a swap (first flag), whose timing may fail at its k-th of four
    measurements (second) and may find piecewise faster (third): the choice is the last successful timing's, each
    swap is timed once, at the first step after it, and a failed timing leaves the whole choice as it was.
    Checked against a plain model of that rule, on :meth:`Executor.refresh` with stand-in modules."""
    from piecegraph.serve.executor import Executor, Slot

    executor = Executor.__new__(Executor)
    module = _Swapping()
    executor.decode, executor.mixed = Slot("full", module, (1, 2)), Slot("piecewise", object(), (1, 2, 4))
    executor.decode_choice, executor._timed_swaps, executor.prefill = {}, 0, None
    timings, expected_picks, expected_timings = [], None, 0
    for swapped, fails, piecewise_faster in events:
        module.pending = swapped

        def timer(cache, fails=fails, faster=piecewise_faster):
            calls = []

            def time_one(slot, n):
                timings.append((slot.kind, n))
                calls.append(n)
                if fails is not None and len(calls) > fails:
                    raise RuntimeError("timing failed")
                return 1.0 if (slot.kind == "piecewise") == faster else 2.0
            return time_one

        executor.decode_timer = timer
        executor.refresh(None)
        if swapped:  # the model: timed once after a swap; kept as it was when the timing failed
            expected_timings += 1
            if fails is None:
                expected_picks = "piecewise" if piecewise_faster else "full"
        picks = {c["pick"] for c in executor.decode_choice.values()} or None
        assert picks == (None if expected_picks is None else {expected_picks})
        assert executor._timed_swaps == module.swaps  # looked at: not timed again at the next step
    assert sum(1 for kind, n in timings if kind == "full" and n == 1) == expected_timings


def test_decode_choice_times_steps_back_to_back_with_their_own_plan_when_overlapped(model, monkeypatch):
    """The overlapped engine's pace is the slower of host and device per step, so its decode choice times steps
    launched back to back, each with fresh metadata (the attention plan is host work a step pays); the
    synchronous engine times each step alone, also with fresh metadata. Checked on the timer's arithmetic with a
    fake clock (each call costs 3 ms of host time; warm-up calls are not counted) and on which timer each loop
    asks for."""
    from piecegraph.graphs import capture
    from piecegraph.serve import executor

    clock = [0.0]
    monkeypatch.setattr(capture.time, "perf_counter", lambda: clock[0])
    calls = []

    def fn(i):
        calls.append(i)
        clock[0] += 0.003

    assert capture.pipelined_ms(fn, warmup=2, repeats=5) == pytest.approx(3.0)
    assert calls == [0, 1, 0, 1, 2, 3, 4]
    monkeypatch.undo()

    engine = Engine(model, small_engine_config("auto", num_pages=15))
    built = []
    for_batch = executor.AttentionMetadata.for_batch
    monkeypatch.setattr(executor.AttentionMetadata, "for_batch",
                        lambda cache, seqs: built.append(len(seqs)) or for_batch(cache, seqs))
    seen = {}
    monkeypatch.setattr(executor, "pipelined_ms", lambda step, repeats: seen.setdefault("pipelined", step(0)) or 1.0)
    monkeypatch.setattr(executor, "time_ms", lambda step, warmup, repeats: seen.setdefault("alone", step(0)) or 2.0)
    decode = engine.executor.decode
    assert executor.time_replays(decode.module, engine.model, engine.cache, 2) == 1.0
    assert built == [2]  # each timed step builds its own inputs and metadata
    assert executor.time_replays(decode.module, engine.model, engine.cache, 4, overlap=False) == 2.0
    assert built == [2, 4] and set(seen) == {"pipelined", "alone"}
    assert engine.cache.num_free_pages == engine.cache.num_pages - 1


def test_auto_times_decode_steps_on_rows_that_spread_over_a_routers_experts():
    """Auto's timing rows differ as served rows do: each its own token and page, so through a mixture of experts
    they reach more experts than pad rows (all reading the one scratch slot: one top-k set for every row) do, as a
    served batch's rows would (the FP8 MoE's 16-row step timed 4.8 ms on pad rows against ~10 ms served, on the H200).
    With too few free pages it falls back to pad rows; either way the cache ends as it began."""
    from piecegraph.context import forward_context
    from piecegraph.models.moe import MoEDecoder
    from piecegraph.models.moe_config import TINY_MOE
    from piecegraph.serve import executor

    moe = MoEDecoder.random(TINY_MOE, seed=1).eval()
    engine = Engine(moe, small_engine_config("auto", num_pages=40))
    cache, chosen, seen = engine.cache, [], []
    experts = moe.model.layers[0].mlp.experts  # forward(x, ids [T, k], weights): the ids the router chose
    hook = experts.register_forward_pre_hook(lambda mod, args: chosen.append(args[1]))

    def module(ids, positions):
        seen.append(ids)
        return moe(ids, positions)

    try:
        with torch.no_grad():
            executor.time_replays(module, moe, cache, 16, overlap=False, repeats=1)
            varied = chosen[-1]
            pad = executor.dummy_inputs(moe, cache, 16)
            with forward_context(pad[1]):
                moe(*pad[0])
            alike = chosen[-1]
            executor.time_replays(module, moe, cache, 64, overlap=False, repeats=1)  # 64 rows > 39 free pages
    finally:
        hook.remove()
    assert torch.equal(seen[0], executor.varied_ids(16, TINY_MOE.vocab_size, cache.device))
    assert len(set(alike.flatten().tolist())) == TINY_MOE.top_k < len(set(varied.flatten().tolist()))
    assert torch.equal(seen[-1], torch.zeros(64, dtype=torch.int64))  # the fallback: pad rows
    assert cache.sequences() == [] and cache.num_free_pages == cache.num_pages - 1


def test_auto_timing_rows_attend_over_half_the_max_seq_len_as_far_as_free_pages_allow(model):
    """Each timing row holds half of max_seq_len cached tokens (its position), fewer when the free pages cannot
    give every row that many, pad rows when they cannot give each row a page; the pages come back either way. On
    one-token rows the FP8 MoE's 1024-row step timed 30 ms where served ones took 42 (H200)."""
    from piecegraph.serve import executor

    engine = Engine(model, small_engine_config("auto", num_pages=40, max_seq_len=24))  # 39 free pages of 4 tokens
    cache = engine.cache
    expected = {2: 12, 8: 12, 16: 7, 39: 3, 40: None}  # rows -> cached tokens (min(24 // 2, pages/row * 4 - 1))
    for rows, context in expected.items():
        with executor.timing_rows(model, cache, rows) as make:
            (ids, positions), meta = make()
            held = cache.num_free_pages
            make()  # a second step reserves nothing more
            assert cache.num_free_pages == held
        if context is None:
            assert torch.equal(ids, torch.zeros(rows, dtype=torch.int64))  # pad rows on the scratch page
        else:
            assert positions.tolist() == [context] * rows, rows
            assert held == 39 - rows * (context // PAGE_SIZE + 1)
        assert cache.sequences() == [] and cache.num_free_pages == 39
