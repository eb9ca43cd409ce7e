"""Decoders that number positions themselves run with each token's own position.

BART, Marian, mBART, Pegasus, Blenderbot (and its small kin) and PLBart as causal LMs count positions from 0 in
every call instead of reading ``position_ids``; piecegraph's packed prefill puts several sequences in one row, so
their position modules are given the flat forward's positions (``piecegraph.hf.positions``). Each type gives
transformers' exact greedy tokens for two prompts of different lengths, its hidden states agree with its own
forward (the numeric self-check), and the model's own forward is the same while wrapped and after unwrap (their
default generation_config forces EOS as the last token, as piecegraph does too: tests/cpu/test_hf_forced_tokens.py).
RoBERTa's kin number positions from their padding index when given none, but transformers' generate gives them
position ids from 0, as piecegraph's flat forward does: their greedy tokens equal generate's, unhooked. XGLM, MVP
and TrOCR (attention computed in their modeling code, MVP's and TrOCR's positions self-numbered) run through
piecegraph's attention too.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import init_all_matrices_fan_in, init_fan_in, random_causal_lm  # noqa: E402

import piecegraph.hf as pghf  # noqa: E402
from piecegraph.hf.positions import self_numbering_modules  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11], [7, 7, 1, 64]]
NEW = 8
SIZES = dict(vocab_size=128, d_model=64, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4,
             encoder_attention_heads=4, decoder_ffn_dim=128, encoder_ffn_dim=128, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
TYPES = ["bart", "marian", "mbart", "pegasus", "blenderbot", "blenderbot-small", "plbart"]


def tiny(model_type):
    """A float32 tiny random ``model_type`` causal LM, projections ~N(0, 1/fan_in)."""
    model = random_causal_lm(transformers.AutoConfig.for_model(model_type, **SIZES), init_fan_in)
    # Blenderbot's default bans n-grams of the prompt (a processor piecegraph refuses: test_hf_forced_tokens.py)
    model.generation_config.encoder_no_repeat_ngram_size = 0
    return model


def hf_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW, do_sample=False)
    tokens = out[0, len(prompt):].tolist()
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t == 2), len(tokens))]


def own_logits(model):
    with torch.no_grad():
        return model(torch.tensor([PROMPTS[0]])).logits


@pytest.mark.parametrize("model_type", TYPES)
def test_self_numbering_decoder_gives_transformers_tokens_and_is_given_back(model_type):
    model = tiny(model_type)
    (positions,) = self_numbering_modules(model)
    before = own_logits(model)
    expected = [hf_greedy(model, p) for p in PROMPTS]
    with pghf.HFDecoder(model) as decoder:  # the self-check: packed prefill and decode against its own forward
        assert pghf.verify(decoder, raise_on_failure=False).ok
        assert torch.equal(own_logits(model), before)  # while wrapped, its own forward counts its own positions
    assert not positions._forward_pre_hooks and not positions._forward_pre_hooks_with_kwargs
    got = pghf.generate(model, PROMPTS, NEW, mode="eager", backend="torch", reuse=False)
    assert got == expected
    assert not hasattr(model, "_piecegraph_hf") and not positions._forward_pre_hooks
    assert torch.equal(own_logits(model), before)


@pytest.mark.slow
def test_positions_reach_compiled_pieces_and_emulated_graphs():
    """Traced by Dynamo (piecewise prefill, full-graph decode emulated on CPU): the positions are the graph's input,
    not the count of the trace."""
    model = tiny("blenderbot-small")
    expected = [hf_greedy(model, p) for p in PROMPTS]
    got = pghf.generate(model, PROMPTS, NEW, mode="graphs", emulate_graphs=True, compiler="eager",
                        prefill_tokens=32, backend="torch", reuse=False)
    assert got == expected


def test_without_the_positions_the_packed_prefill_differs():
    """The control: with the hook taken off, the second packed sequence is numbered on from the first, and the
    self-check refuses naming the first layer."""
    model = tiny("bart")
    with pghf.HFDecoder(model, verify=False) as decoder:
        decoder._wrap.positions.remove()
        verdict = pghf.verify(decoder, raise_on_failure=False)
    assert not verdict.ok and verdict.layer == 0 and "'bart'" in verdict.reason, verdict.reason


def test_decoders_that_read_position_ids_are_not_hooked():
    """OPT and RoBERTa read ``position_ids`` (their embeddings need no hook)."""
    opt = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "opt", vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=64, max_position_embeddings=64))
    assert self_numbering_modules(opt) == [] and self_numbering_modules(roberta_like("roberta")) == []


ROBERTA_TYPES = ["roberta", "roberta-prelayernorm", "camembert", "data2vec-text", "xlm-roberta", "xlm-roberta-xl"]


def roberta_like(model_type):
    """A float32 tiny random causal LM (``is_decoder``) of RoBERTa's kin, projections ~N(0, 1/fan_in)."""
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, is_decoder=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    return random_causal_lm(config, init_all_matrices_fan_in)


@pytest.mark.parametrize("model_type", ROBERTA_TYPES)
def test_roberta_kin_give_the_tokens_of_transformers_generate(model_type):
    """Their own forward without position ids numbers from ``padding_idx + 1`` (the control: other greedy tokens
    than generate's); generate passes 0, 1, ..., as the flat forward does."""
    model = roberta_like(model_type)
    expected = [hf_greedy(model, p) for p in PROMPTS]
    ids = list(PROMPTS[0])
    with torch.no_grad():
        for _ in range(NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ids[len(PROMPTS[0]):][: len(expected[0])] != expected[0]
    assert pghf.generate(model, PROMPTS, NEW, mode="eager", backend="torch", reuse=False) == expected


PROJECTION_SIZES = {
    "xglm": dict(d_model=64, num_layers=2, attention_heads=4, ffn_dim=128),
    "mvp": dict(SIZES),
    "trocr": dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128),
}


def projection_model(model_type):
    """A float32 tiny random causal LM whose attention is computed in its modeling code (fairseq layout)."""
    sizes = {**dict(vocab_size=128, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2),
             **PROJECTION_SIZES[model_type]}
    return random_causal_lm(transformers.AutoConfig.for_model(model_type, **sizes), init_all_matrices_fan_in)


@pytest.mark.parametrize("model_type", sorted(PROJECTION_SIZES))
def test_hand_written_projection_attention_gives_transformers_tokens_and_is_given_back(model_type):
    """XGLM, MVP and TrOCR compute attention in their modeling code (no attention interface): wrapped, their
    attention modules run piecegraph's attention on the flat forward's calls; their own forward is unchanged while
    wrapped, and unwrap leaves no attribute behind."""
    model = projection_model(model_type)
    attn = model.model.decoder.layers[0].self_attn if model_type != "xglm" else model.model.layers[0].self_attn
    before = own_logits(model)
    expected = [hf_greedy(model, p) for p in PROMPTS]
    with pghf.HFDecoder(model) as decoder:
        assert pghf.verify(decoder, raise_on_failure=False).ok and "forward" in attn.__dict__
        assert torch.equal(own_logits(model), before)
    assert not {"forward", "config", "is_causal"} & set(attn.__dict__)
    assert pghf.generate(model, PROMPTS, NEW, mode="eager", backend="torch", reuse=False) == expected
    assert torch.equal(own_logits(model), before)


@pytest.mark.slow
def test_projection_attention_runs_compiled_with_emulated_graphs():
    model = projection_model("xglm")
    expected = [hf_greedy(model, p) for p in PROMPTS]
    got = pghf.generate(model, PROMPTS, NEW, mode="graphs", emulate_graphs=True, compiler="eager",
                        prefill_tokens=32, backend="torch", reuse=False)
    assert got == expected
