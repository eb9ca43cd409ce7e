"""Decoders whose attention is hand-written in their modeling code, BERT-style: MegatronBERT, RemBERT, RoFormer
(its sinusoidal rotary embedding applied by its own code, to the values too where ``rotary_value``) and BigBird
(its full attention: transformers' generate switches a decoder to it) run through piecegraph's attention while
wrapped and give transformers' exact greedy tokens; their modules are their own again after. A sabotaged adapter
(wrong scale, rotary left out) is refused by the numeric self-check, never run wrong; BigBird's block-sparse
attention, encoders (``is_decoder`` unset) and other hand-written attention (XLM's, CPM-Ant's position bias) are
refused naming the model type.
"""

import pytest

transformers = pytest.importorskip("transformers")

from hf_tiny import NEW, PROMPTS, hf_greedy, random_causal_lm, refusal, sized_config  # noqa: E402

import piecegraph.hf as pghf  # noqa: E402
import piecegraph.hf.adapters as adapters  # noqa: E402
import piecegraph.hf.families as families  # noqa: E402
from piecegraph.hf.attention import is_flat  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, is_decoder=True,
             input_embedding_size=32, output_embedding_size=32, embedding_size=64)
ADAPTED = {"config", "is_causal", "scaling", "forward"}  # what the adapter sets on each module while wrapped


def model(model_type, **fields):
    """A float32 tiny random ``model_type`` causal LM, every matrix ~N(0, 1/fan_in) and biases 0, so that every
    layer matters and greedy tokens vary with the context (fields its config does not have are dropped)."""
    return random_causal_lm(sized_config(model_type, **{**SIZES, **fields}), init_matrices_fan_in_biases_zero)


def init_matrices_fan_in_biases_zero(name, param):
    if param.dim() >= 2:
        param.normal_(0, param.shape[-1] ** -0.5)
    elif name.endswith("bias"):
        param.zero_()


def self_attentions(hf):
    return [m for m in hf.modules() if families._is_bert_self_attention(m)]


CASES = {
    "megatron-bert": {},
    "rembert": {},  # its input embeddings narrower than its hidden states
    "roformer": {},
    "roformer-rotary-values": dict(rotary_value=True),
    "big_bird": dict(attention_type="original_full"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bert_style_hand_written_attention_runs_exactly_and_is_its_own_again_after(case):
    hf = model(case.removesuffix("-rotary-values"), **CASES[case])
    modules = self_attentions(hf)
    assert len(modules) == 2  # one per decoder layer: each is adapted
    want = hf_greedy(hf)
    pghf.check_supported(hf.config)
    assert pghf.generate(hf, PROMPTS, NEW, mode="eager", backend="torch", reuse=False) == want
    assert all(not ADAPTED & m.__dict__.keys() for m in modules)  # unwrapped: its own forward again
    assert hf_greedy(hf) == want


def test_a_bert_style_adapter_with_the_wrong_scale_is_refused(monkeypatch):
    fields = adapters._bert_fields
    monkeypatch.setattr(adapters, "HAND_WRITTEN", [(families._is_bert_self_attention,
                                                    lambda *a: {**fields(*a), "scaling": 1.0})])
    assert "decoder layer 0" in refusal(model("megatron-bert"))


def test_roformer_without_its_rotary_embedding_on_flat_calls_is_refused(monkeypatch):
    real = adapters._bert_forward

    def without_rotary(self, parameters, *args, **kwargs):  # flat calls only: the reference keeps its rotary
        given = {**dict(zip(parameters, args)), **kwargs}
        if is_flat(given.get("attention_mask"), given):
            given["sinusoidal_pos"] = None
        return real(self, (), **given)

    monkeypatch.setattr(adapters, "_bert_forward", without_rotary)
    assert "decoder layer 0" in refusal(model("roformer"))


def test_big_bird_block_sparse_is_refused_naming_the_switch_to_full_attention():
    hf = model("big_bird")  # attention_type="block_sparse" by default
    message = refusal(hf)
    assert "block-sparse" in message and "model.bert.set_attention_type('original_full')" in message


def test_a_bert_style_encoder_is_refused():
    assert "causal" in refusal(model("megatron-bert", is_decoder=False))


@pytest.mark.parametrize("model_type", ["xlm", "cpmant"])
def test_other_hand_written_attention_is_refused(model_type):
    fields = dict(emb_dim=64, n_layers=2, n_heads=4, dim_model=64, dim_ff=128, num_layers=2, num_heads=4,
                  dim_head=16, causal=True)
    assert "hand-written" in refusal(model(model_type, **fields))


def test_a_kept_session_runs_exactly_again():
    """A second call reuses the session kept from the first (suspended, then resumed: the adapted forward set
    again) and is as exact; the modules are their own between and after the calls."""
    hf = model("megatron-bert")
    want = hf_greedy(hf)
    for _ in range(2):
        assert pghf.generate(hf, PROMPTS, NEW, mode="eager", backend="torch") == want
        assert all(not ADAPTED & m.__dict__.keys() for m in self_attentions(hf))
    assert hf_greedy(hf) == want


@pytest.mark.slow
def test_roformer_runs_exactly_compiled():
    hf = model("roformer", rotary_value=True)
    want = hf_greedy(hf)
    assert pghf.generate(hf, PROMPTS, NEW, mode="none", compiler="eager", prefill_tokens=32, backend="torch",
                         reuse=False) == want
