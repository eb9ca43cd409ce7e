"""CPU start-up defaults and reuse (piecegraph/hf/reuse.py, serve/kv_budget.py): a second
``piecegraph.hf.generate`` call on the same model reuses the session the first built (no new trace) and gives the
model back as it was after each call; a weight written in place, a cast or ``reuse=False`` builds anew; a call
naming no mode runs eager on CPU; a CPU engine's default KV cache stays within its share of the memory."""

import copy
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import init_all_matrices_fan_in, random_causal_lm  # noqa: E402

import piecegraph.hf as pghf  # noqa: E402
from piecegraph.hf import reuse  # noqa: E402
from piecegraph.models import TINY, Decoder  # noqa: E402
from piecegraph.serve import Engine, EngineConfig  # noqa: E402
from piecegraph.serve.kv_budget import CPU_KV_CAP, GIB, cpu_kv_bytes  # noqa: E402

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9], [7, 7, 1]]
NEW = 6


@pytest.fixture()
def model():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    net = random_causal_lm(config, init_all_matrices_fan_in)
    net.generation_config.eos_token_id = None
    yield net
    reuse.forget(net)


def reference(net, prompt):
    with torch.no_grad():
        out = net.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW)
    return out[0, len(prompt):].tolist()


def kept(net):
    holder = net.__dict__.get(reuse.ATTR)
    return holder.session if holder is not None else None


def test_a_second_call_reuses_the_session_and_its_trace(model):
    want = [reference(model, p) for p in PROMPTS]
    assert pghf.generate(model, PROMPTS, NEW, mode="none", compiler="eager") == want
    session = kept(model)
    runner = session.prefill.runner
    assert not hasattr(model, "_piecegraph_hf")  # given back as it was between calls
    assert reference(model, PROMPTS[0]) == want[0]  # its own generate works in between
    assert pghf.generate(model, PROMPTS[:1], NEW, mode="none", compiler="eager") == want[:1]
    assert kept(model) is session and session.prefill.runner is runner  # no new session, no new trace
    assert pghf.generate(model, PROMPTS, NEW, mode="none", compiler="eager") == want
    assert kept(model) is session and not hasattr(model, "_piecegraph_hf")


def test_changed_weights_dtype_options_or_reuse_off_build_anew(model):
    want = [reference(model, p) for p in PROMPTS]
    assert pghf.generate(model, PROMPTS, NEW) == want
    first = kept(model)
    assert first.mode == "eager"  # CPU, no mode named
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # written in place: the same tensor, another version
    flipped = [reference(model, p) for p in PROMPTS]
    assert flipped != want
    assert pghf.generate(model, PROMPTS, NEW) == flipped
    second = kept(model)
    assert second is not first and first.closed
    assert pghf.generate(model, PROMPTS, NEW, mode="none", compiler="eager") == flipped  # other options
    assert kept(model) is not second and second.closed
    model.double()
    assert pghf.generate(model, PROMPTS, NEW) == [reference(model, p) for p in PROMPTS]
    assert kept(model).model.facts().dtype == torch.float64
    assert pghf.generate(model, PROMPTS, NEW, reuse=False) == [reference(model, p) for p in PROMPTS]
    assert kept(model) is None and not hasattr(model, "_piecegraph_hf")


def test_a_longer_call_grows_the_session_and_copies_keep_none(model):
    pghf.generate(model, PROMPTS[:1], 2)
    small = kept(model)
    pghf.generate(model, PROMPTS, NEW)
    grown = kept(model)
    assert grown is not small and grown.max_seqs == 2 and grown.max_len >= len(PROMPTS[0]) + NEW
    assert kept(copy.deepcopy(model)) is None
    assert kept(pickle.loads(pickle.dumps(model))) is None


def test_cpu_default_mode_is_eager_unless_a_compile_option_is_named(model):
    assert reuse.default_mode(model, {}) == "eager"
    assert reuse.default_mode(model, {"compiler": "eager"}) == "graphs"


def test_the_cpu_kv_share_is_bounded():
    assert cpu_kv_bytes(available=8 * GIB) == 2 * GIB
    assert cpu_kv_bytes(available=512 * GIB) == CPU_KV_CAP
    assert 0 < cpu_kv_bytes() <= CPU_KV_CAP


def test_a_cpu_engine_default_cache_stays_within_its_share(monkeypatch):
    import piecegraph.serve.engine as engine_module

    model = Decoder.random(TINY, seed=3).eval()
    per_token = model.facts().kv_bytes_per_token()
    share = 200 * 4 * per_token  # room for 200 pages of 4 tokens
    monkeypatch.setattr(engine_module, "cpu_kv_bytes", lambda: share)
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=64, page_size=4, max_seq_len=48))
    budget = engine.cache_budget
    assert budget.cpu and budget.trimmed and budget.pages * budget.page_bytes <= share
    assert "the CPU's share" in budget.describe()


def test_serve_on_cpu_defaults_to_the_eager_engine_says_why_and_mode_overrides(monkeypatch):
    from typer.testing import CliRunner

    from piecegraph.cli import app
    from piecegraph.server import run

    seen = {}

    def stop(factory, *args, **kwargs):  # the engine's config, as the engine process would get it
        seen["config"] = factory.args[-1]
        raise SystemExit(0)

    monkeypatch.setattr(run, "build_process_state", stop)
    base = ["serve", "--model", "tiny", "--device", "cpu", "--port", "0"]
    result = CliRunner().invoke(app, base)
    assert result.exit_code == 0 and seen["config"].mode == "eager", result.output
    assert "on CPU: engine mode eager" in " ".join(result.output.split())
    result = CliRunner().invoke(app, [*base, "--mode", "auto"])
    assert result.exit_code == 0 and seen["config"].mode == "auto", result.output
    assert "on CPU: engine mode eager" not in " ".join(result.output.split())
