"""A generation_config that forces EOS (BART, Marian, mBART, Pegasus, Blenderbot and its small kin, PLBart): an
answer that reaches its length limit ends with the forced id, as transformers' ``ForcedEOSTokenLogitsProcessor``
forces it, through ``piecegraph.hf.generate`` and through the server (the engine's request forces it on the host).
Reference: transformers' ``generate(do_sample=False)``, one prompt at a time. A forced first token
(``forced_bos_token_id``) is refused, named.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_positions import PROMPTS, TYPES, tiny  # noqa: E402

import piecegraph.hf as pghf  # noqa: E402
from piecegraph.hf.generate import forced_eos_id  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 6


def reference(model, prompt, **kwargs):
    """transformers' greedy new tokens for one prompt (no padding: a batch of one)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("model_type", TYPES)
def test_the_default_forced_eos_gives_transformers_tokens(model_type):
    model = tiny(model_type)
    forced = model.generation_config.forced_eos_token_id
    assert forced is not None  # the type's default generation_config forces it
    want = [reference(model, p, max_new_tokens=NEW) for p in PROMPTS]
    assert [t[-1] for t in want if len(t) == NEW] == [forced] * sum(len(t) == NEW for t in want)
    model.generation_config.forced_eos_token_id = None
    free = [reference(model, p, max_new_tokens=NEW) for p in PROMPTS]
    model.generation_config.forced_eos_token_id = forced
    assert free != want  # the control: forcing changed the answer
    assert pghf.generate(model, PROMPTS, NEW, mode="eager", backend="torch", reuse=False) == want


def test_every_length_limit_ends_with_the_forced_ids_smallest_as_transformers():
    """max_new_tokens, max_length (per prompt), the generation_config's max_length and transformers' default (20
    new tokens, at most max_position_embeddings in all), with a list of forced ids, in one kept session."""
    model = tiny("bart")
    model.generation_config.forced_eos_token_id = [9, 4]
    prompts = [*PROMPTS, list(range(3, 53))]  # 50 tokens: the default limit is cut to 64 - 50 new ones
    assert forced_eos_id(model) == 4
    cases = [dict(max_new_tokens=3), dict(max_length=58), dict()]
    want = [[reference(model, p, **kwargs) for p in prompts] for kwargs in cases]
    assert [len(t) for t in want[2]] == [20, 20, 14]
    assert all(t[-1] == 4 for case in want for t in case)
    with pghf.Session(model, max_seqs=len(prompts), max_len=64, mode="eager", backend="torch") as session:
        assert [session.generate(prompts, **kwargs) for kwargs in cases] == want
        model.generation_config.max_length = 15
        try:
            assert session.generate(PROMPTS) == [reference(model, p) for p in PROMPTS]
        finally:
            model.generation_config.max_length = None
    assert pghf.new_token_limits(model, prompts) == [20, 20, 14]
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        pghf.new_token_limits(model, [list(range(64))])


def test_a_forced_first_token_is_refused_naming_it():
    """``forced_bos_token_id`` (transformers' generate starts the answer to a one-token prompt with it) is not
    done: refused naming the field and the fix, the model left as it was."""
    model = tiny("bart")
    model.generation_config.forced_bos_token_id = 5
    with pytest.raises(pghf.UnsupportedModelError, match=r"forced_bos_token_id=5.*= None"):
        pghf.generate(model, PROMPTS, NEW, mode="eager", backend="torch", reuse=False)
    assert not hasattr(model, "_piecegraph_hf") and not model.model.decoder.embed_positions._forward_pre_hooks


@pytest.mark.parametrize("field, value, changes", [
    ("repetition_penalty", 1.5, True), ("no_repeat_ngram_size", 1, True), ("bad_words_ids", "argmax", True),
    ("min_new_tokens", NEW, False), ("num_beams", 2, False)])
def test_a_generation_config_that_changes_greedy_tokens_is_refused_naming_the_field(field, value, changes):
    """A logits processor (or search) of the generation_config that piecegraph's greedy decoding does not apply
    changes transformers' tokens (checked where this model's repetitive answer shows it: its tokens differ from its
    greedy tokens without it), and piecegraph refuses the model naming the field and its neutral value, instead of
    answering differently."""
    from piecegraph.hf.generation_check import NEUTRAL

    model = tiny("bart")
    model.generation_config.forced_eos_token_id = None  # only the field under test differs from plain greedy
    plain = reference(model, PROMPTS[0], max_new_tokens=NEW)
    if value == "argmax":  # ban the first greedy token: the answer must change
        value = [[plain[0]]]
    setattr(model.generation_config, field, value)
    assert (reference(model, PROMPTS[0], max_new_tokens=NEW) != plain) == changes  # transformers' answer with it
    with pytest.raises(pghf.UnsupportedModelError, match=rf"generation_config\.{field}=.*= {NEUTRAL[field]!r}"):
        pghf.generate(model, PROMPTS, NEW, mode="eager", backend="torch", reuse=False)


def test_serve_forces_the_models_eos_as_transformers(tmp_path):
    """``piecegraph serve FOLDER``'s path: the folder's generation_config forces EOS (Marian: id 0, no EOS id, so
    the text goes on to it), the server's tokenizer reads it, the engine's request puts it last."""
    openai = pytest.importorskip("openai")
    from test_server_lifecycle import _hf_folder

    from piecegraph.cli_common import load_model
    from piecegraph.serve import Engine, EngineConfig, SamplingParams
    from piecegraph.server.run import BackgroundServer, build_state
    from piecegraph.server.tokenizer import load_tokenizer

    eos = _hf_folder(tmp_path)  # its tokenizer; the Marian below replaces its Qwen2
    config = transformers.AutoConfig.for_model("marian", vocab_size=eos + 1, d_model=64, decoder_layers=2,
                                               encoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4,
                                               decoder_ffn_dim=128, encoder_ffn_dim=128, max_position_embeddings=64,
                                               pad_token_id=0, eos_token_id=eos, decoder_start_token_id=0)
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert net.generation_config.forced_eos_token_id == 0
    net.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path), 0)
    assert tok.forced_eos_id == 0 and tok.eos_ids == {eos}
    prompt = tok.encode("forced")
    want = reference(net, prompt, max_new_tokens=NEW)
    net.generation_config.forced_eos_token_id = None
    assert len(want) == NEW and want[-1] == 0 != reference(net, prompt, max_new_tokens=NEW)[-1]  # the control
    model = load_model(str(tmp_path), "cpu", torch.float32, hf=True)
    engine = Engine(model, EngineConfig(mode="eager", max_num_seqs=4, page_size=8, max_seq_len=64))
    request = engine.add_request(prompt, SamplingParams(max_new_tokens=NEW, eos_token_id=eos, forced_eos_token_id=0))
    engine.run()
    assert request.output == want and request.finish_reason == "length"
    with BackgroundServer(build_state(engine, tok, tmp_path.name)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0)
        r = client.completions.create(model=tmp_path.name, prompt="forced", max_tokens=NEW, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == want and r.choices[0].finish_reason == "length"
