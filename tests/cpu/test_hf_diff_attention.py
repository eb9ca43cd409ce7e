"""Attention modules called more than once per forward run with transformers' exact greedy tokens, each call on a
cache layer of its own (``piecegraph.hf.multi_call``):

- DiffLlama's differential attention (two attention calls per layer, the same keys and the two halves of the
  values) through ``piecegraph.hf.generate``, eager and compiled;
- Dory's looped section (the same decoder layer run once per loop, ``recurrent_kv_cache_mode="per_loop"``: a
  cache per loop) through ``piecegraph.hf.generate`` and the serving engine;
- the KV bytes per token count every cache layer;
- the calls put on one cache layer (a wrong mapping) are refused by the numeric self-check, and Dory's
  ``"last_loop"`` mode (its cached forward differs from its uncached one) is refused by its config.
"""

import pytest

transformers = pytest.importorskip("transformers")

from hf_tiny import BASE, NEW, PROMPTS, hf_greedy, init_fan_in, random_causal_lm, skip_unless_known  # noqa: E402

import piecegraph.hf as pghf  # noqa: E402
import piecegraph.hf.multi_call as multi_call  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# one input layer, one recurrent layer run three times, one output layer; sliding windows shorter than the prompts
DORY = dict(BASE, num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,
            n_recurrent_loops=3, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def build(model_type, **fields):
    """A float32 tiny random causal LM, projections ~ N(0, 1/fan_in) so that every layer matters."""
    skip_unless_known(model_type)
    return random_causal_lm(transformers.AutoConfig.for_model(model_type, **fields), init_fan_in)


@pytest.fixture(scope="module")
def diffllama():
    hf = build("diffllama", **BASE)
    return hf, hf_greedy(hf)


@pytest.fixture(scope="module")
def dory():
    hf = build("dory", **DORY)
    return hf, hf_greedy(hf)


def cache_layers(hf):
    return [getattr(layer.self_attn, multi_call.LAYERS, None) for layer in hf.model.layers]


def test_diffllama_runs_exactly_with_a_cache_layer_per_call(diffllama):
    hf, want = diffllama
    with pghf.HFDecoder(hf) as wrapped:
        assert cache_layers(hf) == [(0, 2), (1, 3)]
        assert wrapped.config.num_layers == 4
        # every cache layer holds 2 kv heads of 16-wide keys and values, float32
        assert wrapped.facts().kv_bytes_per_token() == 4 * 2 * (16 + 16) * 4
    assert cache_layers(hf) == [None, None]  # unwrapped: the attributes are gone
    for _ in range(2):  # the second call resumes the session kept from the first: its cache layers set again
        assert pghf.generate(hf, PROMPTS, NEW, mode="eager", backend="torch") == want
        assert cache_layers(hf) == [None, None]
    pghf.unwrap(hf)
    assert hf_greedy(hf) == want  # transformers' own generate still runs as before


@pytest.mark.slow
def test_diffllama_runs_exactly_compiled(diffllama):
    hf, want = diffllama
    assert pghf.generate(hf, PROMPTS, NEW, mode="none", compiler="eager", prefill_tokens=32, backend="torch",
                         reuse=False) == want


def test_dory_runs_a_cache_per_loop_exactly(dory):
    hf, want = dory
    with pghf.HFDecoder(hf) as wrapped:
        assert cache_layers(hf) == [None, (1, 3, 4), None]  # the recurrent layer, three loops
        assert wrapped.config.num_layers == 5
        assert wrapped.facts().kv_bytes_per_token() == 5 * 2 * (16 + 16) * 4
    assert pghf.generate(hf, PROMPTS, NEW, mode="eager", backend="torch", reuse=False) == want


def test_dory_through_the_engine(dory):
    from piecegraph.serve import Engine, EngineConfig, SamplingParams

    hf, want = dory
    with pghf.HFDecoder(hf) as wrapped:
        engine = Engine(wrapped, EngineConfig(mode="eager", max_num_seqs=4, page_size=4, max_seq_len=64))
        requests = [engine.add_request(p, SamplingParams(max_new_tokens=NEW, eos_token_id=2)) for p in PROMPTS]
        engine.run()
    assert [r.output for r in requests] == want


def one_layer_per_module(monkeypatch):
    """Make every call of a module use the module's own cache layer (the mapping before per-call layers)."""
    assign = multi_call.assign

    def shared(counts, num_layers):
        total, done = assign(counts, num_layers)
        for module, values in done:
            values[multi_call.LAYERS] = (module.layer_idx,) * len(values[multi_call.LAYERS])
            module.__dict__.update(values)
        return total, done

    monkeypatch.setattr(multi_call, "assign", shared)


@pytest.mark.parametrize("model_type, fields", [("diffllama", BASE), ("dory", DORY)])
def test_calls_sharing_a_cache_layer_are_refused(model_type, fields, monkeypatch):
    hf = build(model_type, **fields)  # a model of its own: the self-check's verdict is kept per model
    one_layer_per_module(monkeypatch)
    with pytest.raises(pghf.UnsupportedModelError, match="does not reproduce the model's own forward") as err:
        pghf.HFDecoder(hf)
    assert repr(hf.config.model_type) in str(err.value)
    assert not hasattr(hf, "_piecegraph_hf") and set(cache_layers(hf)) == {None}  # given back as it was


def test_dory_last_loop_cache_is_refused():
    hf = build("dory", **DORY, recurrent_kv_cache_mode="last_loop")
    with pytest.raises(pghf.UnsupportedModelError, match="recurrent_kv_cache_mode is 'last_loop'"):
        pghf.HFDecoder(hf)
    assert not hasattr(hf, "_piecegraph_hf")
