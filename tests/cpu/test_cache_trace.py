"""A warm start skips Dynamo: the cache keeps the traced program (trace/snapshot.py, binding_snapshot.py), and a
start that finds it builds the same program from it. Tested against eager and the cold start, through one cache
directory the module's tests share; a program that does not fit the model (changed attributes, a changed source
file) is traced anew, never loaded. Graphs emulated on CPU. The snapshot's parts alone: test_trace_snapshot.py."""

from __future__ import annotations

import logging

import pytest
import torch
from cache_trace_helpers import Tagged
from hypothesis import given, settings
from hypothesis import strategies as st
from toy import ToyModel

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.context import forward_context
from piecegraph.models import TINY, Decoder, dummy_inputs, generate

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pgtrace")


def _start(root, mode: str, model: torch.nn.Module | None = None):
    model = model or Decoder.random(TINY, seed=0).eval()
    cache = KVCache.for_sequences(TINY, 3, 48)
    sizes = (1, 2, 4) if mode == "full" else (4, 16)
    graphed = piecegraph.compile(model, mode=mode, capture_sizes=sizes, emulate_graphs=True, cache_dir=root)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    graphed.capture(lambda n: dummy_inputs(model, cache, n))
    traced = torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames
    return model, cache, graphed, traced


@pytest.mark.parametrize("mode", ["piecewise", "full", "auto"])
def test_a_warm_start_loads_the_traced_program_without_dynamo_and_equals_eager(root, mode):
    model, cache, cold, cold_frames = _start(root, mode)
    first = cold.stats()["startup"]
    assert (first["cache"], first["trace"]) == ("cold", "traced") and cold_frames >= 1
    assert (root / "entries" / first["cache_key"] / "trace.pkl").exists()
    _, warm_cache, warm, warm_frames = _start(root, mode, model)
    second = warm.stats()["startup"]
    assert (second["cache"], second["trace"], warm_frames) == ("warm", "loaded", 0)
    assert second["fx_graph_cache"]["fxgraph_cache_miss"] == 0  # the same code as the cold start compiled
    want = generate(model, PROMPTS, 5)
    if mode != "full":  # auto: the piecewise program
        assert generate(model, PROMPTS, 5, cache=warm_cache, prefill_fn=warm) == want
        assert generate(model, PROMPTS, 5, cache=cache, prefill_fn=cold) == want
    else:
        assert generate(model, PROMPTS, 5, cache=warm_cache, decode_fn=warm) == want
        assert generate(model, PROMPTS, 5, cache=cache, decode_fn=cold) == want
    # An argument unlike the traced one is refused by the loaded binding as by a traced one, naming it
    with pytest.raises(ValueError, match="input input_ids is torch.float32"):
        warm(torch.zeros(2), torch.zeros(2, dtype=torch.long))


def test_a_traced_program_that_does_not_fit_is_traced_anew_with_a_warning(root, monkeypatch, caplog):
    model, cache, _, _ = _start(root, "piecewise")

    def refuse(*args, **kwargs):
        raise LookupError("model.layers.0.weight is not the tensor it was")

    monkeypatch.setattr(piecegraph.graphed.cached_start, "load_trace", refuse)
    with caplog.at_level(logging.WARNING, logger="piecegraph"):
        _, _, again, frames = _start(root, "piecewise", model)
    assert "could not be used (LookupError" in caplog.text and "tracing anew" in caplog.text
    assert again.stats()["startup"]["trace"] == "traced" and frames >= 1
    assert generate(model, PROMPTS, 5, cache=cache, prefill_fn=again) == generate(model, PROMPTS, 5)
    monkeypatch.undo()  # the new trace replaced the one that did not fit: the next start loads it
    _, _, third, frames = _start(root, "piecewise", model)
    assert third.stats()["startup"]["trace"] == "loaded" and frames == 0


def test_a_loaded_program_keeps_what_modules_declare_about_padding(root):
    """The FP8 MoE's experts declare their sort padding-safe (nn_module_stack metadata): a loaded program must
    still see it, or every size would capture exactly (slower, and a warning)."""
    from piecegraph.models import TINY_MOE, MoEDecoder, quantize_fp8

    model = quantize_fp8(MoEDecoder.random(TINY_MOE, seed=0).eval(), kernel="torch")
    cache = KVCache.for_sequences(TINY_MOE, 3, 48)
    stats = []
    for _ in range(2):
        graphed = piecegraph.compile(model, mode="piecewise", capture_sizes=(4, 16), emulate_graphs=True,
                                     cache_dir=root)
        graphed.capture(lambda n: dummy_inputs(model, cache, n))
        stats.append(graphed.stats())
    assert [s["startup"]["trace"] for s in stats] == ["traced", "loaded"]
    assert [s["token_mixing"] for s in stats] == [[], []]
    assert generate(model, PROMPTS, 4, cache=cache, prefill_fn=graphed) == generate(model, PROMPTS, 4)


def test_a_module_class_defined_inside_a_function_still_leaves_a_loadable_trace(root):
    """Dynamo's module stack names each module's class; one defined inside a function cannot be pickled by name
    (transformers 5.25 wraps apply_rotary_pos_emb in one, made by the kernels package), and the trace was then not
    kept: every start traced again. The class is kept by name; the program loads and equals eager."""

    class Wrapped(torch.nn.Module):  # defined here: its qualified name holds "<locals>"
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    model = Decoder.random(TINY, seed=5).eval()
    model.model.norm = Wrapped(model.model.norm)
    starts = [_start(root, "piecewise", model) for _ in range(2)]
    assert [s[2].stats()["startup"]["trace"] for s in starts] == ["traced", "loaded"]
    _, cache, warm, _ = starts[1]
    assert generate(model, PROMPTS, 4, cache=cache, prefill_fn=warm) == generate(model, PROMPTS, 4)


def test_an_engines_second_start_loads_both_modules_and_serves_the_same_tokens(root):
    from piecegraph.serve import Engine, EngineConfig, SamplingParams

    model = Decoder.random(TINY, seed=0).eval()
    config = EngineConfig(mode="auto", max_num_seqs=4, max_num_batched_tokens=32, num_pages=32, page_size=8,
                          max_seq_len=64, emulate_graphs=True, cache_dir=root)
    outputs, traces = [], []
    for _ in range(2):
        engine = Engine(model, config)
        outputs.append(engine.generate(PROMPTS, SamplingParams(max_new_tokens=6)))
        modules = engine.capture_report()["modules"]
        traces.append({kind: m["startup"]["trace"] for kind, m in modules.items()})
    # (the full module's key may be one an earlier test of this module published: then it loads at once)
    assert traces[0]["piecewise"] == "traced" and traces[1] == {"piecewise": "loaded", "full": "loaded"}
    assert outputs[0] == outputs[1] == generate(model, PROMPTS, 6)


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_a_hugging_face_decoder_loads_its_traced_program_and_equals_hf(root, model_type):
    from test_hf import PROMPTS as HF_PROMPTS
    from test_hf import flat_logits, hf_logits, rel, tiny

    model = tiny(model_type)
    expected = [hf_logits(model, p) for p in HF_PROMPTS]
    traces = []
    for _ in range(2):
        graphed = piecegraph.compile(model, mode="piecewise", capture_sizes=(32,), emulate_graphs=True,
                                     cache_dir=root)
        got = flat_logits(graphed, graphed.model, HF_PROMPTS)
        assert max(rel(a, b) for a, b in zip(got, expected)) < 1e-5
        traces.append(graphed.stats()["startup"]["trace"])
    assert traces == ["traced", "loaded"]


def _toy_start(root, model, x, n):
    graphed = piecegraph.compile(model, mode="piecewise", capture_sizes=(4, 8), emulate_graphs=True, cache_dir=root)
    with forward_context({"n": n}), torch.no_grad():
        out, want = graphed(x, torch.arange(n)), model(x, torch.arange(n))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # the independent reference: eager, as it is now
    return graphed.stats()["startup"]["trace"]


def test_an_attribute_the_trace_baked_in_that_changed_is_traced_anew(root, caplog):
    """Dynamo guards on ``self.scale``; a warm start runs no Dynamo, so the snapshot checks the model's plain
    attributes itself: a changed one is never loaded with the old value baked in."""
    model, x = Tagged(0.5, 2).eval(), torch.randn(5, 16)
    assert _toy_start(root, model, x, 5) == "traced"
    assert _toy_start(root, model, x, 5) == "loaded"
    model.scale = 3.0  # set on the instance: neither the code nor a config the cache key reads
    with caplog.at_level(logging.WARNING, logger="piecegraph"):
        assert _toy_start(root, model, x, 5) == "traced"  # (and equal to eager with 3.0: checked inside)
    assert "attributes" in caplog.text and "changed since it was traced" in caplog.text


SOURCE = '''
import torch
from toy import ToyModel

SHIFT = {shift}


class Shifted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = ToyModel(dim=16, layers=1, seed=4)

    def forward(self, x, pos):
        return self.inner(x + SHIFT, pos)
'''


def test_a_source_file_the_trace_came_from_that_changed_is_traced_anew(root, tmp_path, monkeypatch):
    """A module-level constant edited in the model's file: the class's code (in the cache key) is the same, the
    file is not; its digest in the snapshot sends the start back to Dynamo."""
    import importlib
    import sys

    monkeypatch.syspath_prepend(str(tmp_path))
    x = torch.randn(3, 16)
    results = []
    for shift in (1.0, 1.0, 2.0):
        (tmp_path / "shifted_model.py").write_text(SOURCE.format(shift=shift))
        sys.modules.pop("shifted_model", None)
        importlib.invalidate_caches()
        model = importlib.import_module("shifted_model").Shifted().eval()
        results.append(_toy_start(root, model, x, 3))
    assert results == ["traced", "loaded", "traced"]


@settings(max_examples=6, deadline=None)
@given(scales=st.lists(st.sampled_from([0.5, 3.0]), min_size=2, max_size=4))
def test_starts_follow_attribute_changes_and_always_equal_eager(root, scales):
    """Property: whatever the sequence of ``scale`` values across starts, every start equals eager (checked in
    _toy_start), and a start loads the cached program exactly when the previous start had the same value (the
    entry holds the last traced program)."""
    model, x = Tagged(scales[0], 3).eval(), torch.randn(6, 16)
    previous = None
    for scale in scales:
        model.scale = scale
        trace = _toy_start(root, model, x, 6)
        if previous is not None:
            assert trace == ("loaded" if scale == previous else "traced"), (scales, scale, previous)
        previous = scale


def test_static_compile_sizes_build_from_the_cache_and_equal_eager(root):
    """Pieces compiled per size (compile_sizes; on a GPU also the default for pieces that work along tokens) from
    the restored graph: Inductor refused the static fakes under the restored graph's fake mode until the static
    compile ran in its own mode (cold and warm starts both failed)."""
    model, x = ToyModel(dim=16, layers=2, seed=1).eval(), torch.randn(5, 16)
    traces = []
    for _ in range(2):
        graphed = piecegraph.compile(model, mode="piecewise", capture_sizes=(4, 8), compile_sizes=(4, 8),
                                     emulate_graphs=True, cache_dir=root / "static")
        with forward_context({"n": 5}), torch.no_grad():
            torch.testing.assert_close(graphed(x, torch.arange(5)), model(x, torch.arange(5)), rtol=1e-5, atol=1e-5)
        traces.append(graphed.stats()["startup"]["trace"])
    assert traces == ["traced", "loaded"]
