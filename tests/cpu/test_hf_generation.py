"""Generation as Hugging Face's ``generate`` does it: EOS ids from ``generation_config`` (a list here, one of them
a token greedy decoding reaches early), ``max_new_tokens``, ``max_length`` (prompt included) and the
``generation_config``'s own limits, through ``piecegraph.hf.generate`` and a reused ``Session``; the server's
tokenizer stops at the same EOS ids. Reference: transformers' ``generate(do_sample=False)``, one prompt at a time.
"""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import piecegraph.hf as pghf  # noqa: E402

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9], [7, 7, 1], [100, 13, 54, 2, 8, 31]]
NEW = 12


@pytest.fixture(scope="module")
def model():
    """A tiny random llama whose generation_config stops at a list of ids, one of them the 4th greedy token of
    the first prompt (so that prompt ends early, the others may not)."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # weights large enough that greedy tokens vary with the context
        for name, param in net.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.1 if "embed" in name else param.shape[-1] ** -0.5)
    net.generation_config.eos_token_id = None
    free = reference(net, PROMPTS[0], max_new_tokens=NEW)
    assert len(free) == NEW and free[3] not in free[:3], free  # a 4th token seen first at step 4
    unused = next(t for t in range(config.vocab_size) if t not in free)
    net.generation_config.eos_token_id = [unused, free[3]]
    net.generation_config.pad_token_id = unused
    return net


def reference(net, prompt, **kwargs):
    """transformers' greedy new tokens for one prompt (no padding: a batch of one)."""
    with torch.no_grad():
        out = net.generate(torch.tensor([prompt]), do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def test_eos_list_from_generation_config_equals_transformers(model):
    want = [reference(model, p, max_new_tokens=NEW) for p in PROMPTS]
    assert len(want[0]) == 4 and want[0][-1] in model.generation_config.eos_token_id  # stopped early, EOS kept
    assert pghf.eos_ids(pghf.wrap(model, verify=False)) == set(model.generation_config.eos_token_id)
    assert pghf.generate(model, PROMPTS, NEW, mode="eager") == want
    assert pghf.generate(model, PROMPTS, NEW, mode="none", compiler="eager") == want  # compiled pieces


def test_max_length_and_generation_config_limits_equal_transformers_in_one_session(model):
    by_length = [reference(model, p, max_length=11) for p in PROMPTS]
    assert sorted(len(t) for t in by_length) != [len(by_length[0])] * 3  # the limits differ per prompt
    model.generation_config.max_new_tokens = 5
    try:
        by_config = [reference(model, p) for p in PROMPTS]
        with pghf.Session(model, max_seqs=len(PROMPTS), max_len=32, mode="eager") as session:
            assert session.generate(PROMPTS, max_length=11) == by_length
            assert session.generate(PROMPTS) == by_config  # generation_config.max_new_tokens
            assert session.generate(PROMPTS, 2, max_length=11) == [t[:2] for t in by_config]  # max_new_tokens wins
            assert pghf.new_token_limits(model, PROMPTS, max_length=11) == [3, 8, 5]
            with pytest.raises(ValueError, match="max_length=8 counts the prompt too, and prompt 0"):
                session.generate(PROMPTS, max_length=8)
    finally:
        model.generation_config.max_new_tokens = None


def test_the_servers_eos_ids_are_the_ones_transformers_stops_at(tmp_path):
    from piecegraph.server.tokenizer import _eos_ids

    class Tok:
        eos_token_id = 9

    assert _eos_ids(Tok(), tmp_path) == {9}  # no configs: the tokenizer's
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert _eos_ids(Tok(), tmp_path) == {3}  # transformers builds the generation config from config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5]}))
    assert _eos_ids(Tok(), tmp_path) == {4, 5}  # not the tokenizer's 9: generate would not stop there
