"""How auto's two modules are compiled: ``EngineConfig.full_compile`` and ``decode_compile_sizes`` reach the full
(decode) module only and are checked, and serve-bench's rows set them; ``share_trace`` builds the full module from
the piecewise module's Dynamo trace (one trace per engine, the same tokens); ``trace_from``'s checks and its
fallback to tracing."""

import pytest

from piecegraph.models import TINY, Decoder, generate
from piecegraph.serve import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_engine_passes_full_compile_to_its_full_module_and_checks_it():
    """``EngineConfig.full_compile`` reaches auto's full (decode) module only (piecewise compiles by pieces
    anyway); serve-bench's ``auto-pieces`` row sets it with ``share_trace``; other values are refused naming the
    field."""
    model = Decoder.random(TINY, seed=1).eval()
    config = EngineConfig(mode="auto", max_num_seqs=2, max_num_batched_tokens=16, max_seq_len=32, compiler="eager",
                          emulate_graphs=True, decode_sizes=(1, 2), prefill_sizes=(4, 16), full_compile="pieces")
    executor = Engine(model, config).executor
    assert executor.decode.module.config.full_compile == "pieces"
    assert executor.mixed.module.config.full_compile == "auto"  # the default: piecewise compiles by pieces anyway
    from piecegraph.serve.sweep import engine_config

    pieces = engine_config("auto-pieces", EngineConfig())
    assert pieces.full_compile == "pieces" and pieces.share_trace
    assert (EngineConfig().share_trace, EngineConfig().full_compile) == (True, "auto")  # the defaults
    shared = engine_config("auto-shared", EngineConfig())
    assert (shared.mode, shared.share_trace, shared.full_compile) == ("auto", True, "whole")
    with pytest.raises(ValueError, match="EngineConfig.full_compile='layers'"):
        EngineConfig(full_compile="layers")
    with pytest.raises(ValueError, match="EngineConfig.share_trace='yes' must be True or False"):
        EngineConfig(share_trace="yes")
    static = Engine(model, config.replace(decode_compile_sizes="auto")).executor  # auto-static's change
    assert static.decode.module.config.compile_sizes == "auto" and static.mixed.module.config.compile_sizes is None
    assert engine_config("auto-static", EngineConfig()).decode_compile_sizes == "auto"
    with pytest.raises(ValueError, match="EngineConfig.decode_compile_sizes=4"):
        EngineConfig(decode_compile_sizes=4)


@pytest.mark.parametrize("share", [True, False])
def test_auto_traces_the_model_once_for_both_modules_when_sharing(monkeypatch, share):
    """``EngineConfig(share_trace=True)``: auto's full module builds its program from the piecewise module's trace
    (``trace_from``): one Dynamo trace per engine (two without), tokens equal to the model's own greedy decoding
    either way, and the decode module says ``"shared"``."""
    from piecegraph.graphed import module as graphed_module

    traced = []
    real = graphed_module.trace_model
    monkeypatch.setattr(graphed_module, "trace_model", lambda *a, **k: traced.append(1) or real(*a, **k))
    model = Decoder.random(TINY, seed=4).eval()
    engine = Engine(model, EngineConfig(mode="auto", max_num_seqs=3, max_num_batched_tokens=16, max_seq_len=48,
                                        compiler="eager", emulate_graphs=True, decode_sizes=(1, 2, 4),
                                        prefill_sizes=(4, 8, 16), share_trace=share))
    assert len(traced) == (1 if share else 2)
    shared = engine.executor.decode.module.stats()["startup"].get("trace") == "shared"
    assert shared == share
    prompts = [[3, 1, 4, 1], [5, 9], [2, 6, 5, 3, 5]]
    assert engine.generate(prompts, SamplingParams(max_new_tokens=6)) == generate(model, prompts, 6)
    assert {s.kind for s in engine.steps} >= {"full", "piecewise"}


def test_trace_from_needs_the_same_model_before_setup_and_falls_back_to_tracing(monkeypatch):
    """A module whose source has no trace to share (breakable: no Dynamo) traces by itself; another model or a
    module already set up is refused."""
    import piecegraph
    from piecegraph.attention import KVCache
    from piecegraph.graphed import module as graphed_module
    from piecegraph.models import dummy_inputs

    model, other = Decoder.random(TINY, seed=4).eval(), Decoder.random(TINY, seed=5).eval()
    cache = KVCache.for_sequences(TINY, 2, 32)
    make = lambda n: dummy_inputs(model, cache, n)  # noqa: E731
    source = piecegraph.compile(model, mode="breakable", capture_sizes=(2,), emulate_graphs=True)
    full = piecegraph.compile(model, mode="full", capture_sizes=(2,), emulate_graphs=True, compiler="eager")
    with pytest.raises(ValueError, match="same model"):
        full.trace_from(piecegraph.compile(other, mode="piecewise"))
    with pytest.raises(ValueError, match=r"Config.token_dim=1 differs from this module's 0"):
        full.trace_from(piecegraph.compile(model, mode="piecewise", token_dim=1))
    with pytest.raises(ValueError, match=r"Config.static_inputs=\('positions',\) differs"):
        full.trace_from(piecegraph.compile(model, mode="piecewise", static_inputs=("positions",)))
    full.trace_from(source)
    source.capture(make)
    traced = []
    real = graphed_module.trace_model
    monkeypatch.setattr(graphed_module, "trace_model", lambda *a, **k: traced.append(1) or real(*a, **k))
    full.capture(make)
    assert traced == [1] and full.stats()["startup"].get("trace") != "shared"
    with pytest.raises(RuntimeError, match="before this module's first call"):
        full.trace_from(source)
