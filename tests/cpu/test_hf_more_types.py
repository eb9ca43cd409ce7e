"""More transformers causal-LM types through ``piecegraph.hf.generate``, each with transformers' exact greedy tokens
or refused with its model type and the reason, never run wrong:

- Whisper's decoder (``WhisperForCausalLM``), whose config maps ``num_attention_heads`` and ``num_hidden_layers``
  to its encoder's fields: the cache is shaped by the decoder's; its cross-attention is refused on a flat call;
  token suppression in its generation config is refused;
- BigBird-Pegasus's decoder, whose self-attention is causal by its decoder's mask, not by ``is_causal``: marked
  causal for piecegraph only, and refused when the mask is not causal after all;
- OpenAI GPT's hand-written attention, adapted while wrapped and its own again after;
- XLM (parallel lists of hand-written layers, a padding mask its base model asserts) stays refused.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import transformers_greedy  # noqa: E402

import piecegraph.hf as pghf  # noqa: E402
from piecegraph.hf.arch import cache_config  # noqa: E402
from piecegraph.hf.attention import CAUSAL, attention, placeholder_mask  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11], [7, 7, 1, 64, 30]]
NEW = 8
IDS = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
# encoder and decoder heads of different counts: only the decoder's may shape the cache (layer counts stay equal:
# transformers' own cache is sized by the encoder's)
WHISPER = dict(IDS, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_target_positions=64,
               begin_suppress_tokens=None)


def model(model_type, **fields):
    """A float32 tiny random causal LM, projections ~ N(0, 1/fan_in) so that every layer matters."""
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "embed" in name:
                param.normal_(0, 0.1)
            elif param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
    return hf


def assert_equal_tokens(hf):
    want = [transformers_greedy(hf, prompt, NEW) for prompt in PROMPTS]
    pghf.check_supported(hf.config)
    assert pghf.generate(hf, PROMPTS, NEW, mode="eager", backend="torch", reuse=False) == want
    assert not hasattr(hf, "_piecegraph_hf")


def refusal(hf):
    with pytest.raises(pghf.UnsupportedModelError) as err:
        pghf.check_supported(hf.config)
        pghf.generate(hf, PROMPTS, NEW, mode="eager", backend="torch", reuse=False)
    assert not hasattr(hf, "_piecegraph_hf"), "a refused model stays wrapped"
    assert repr(hf.config.model_type) in str(err.value)
    return str(err.value)


# ---------------------------------------------------------------------- Whisper's decoder
@pytest.fixture(scope="module")
def whisper():
    return model("whisper", **WHISPER)


def test_whisper_decoder_runs_exactly_on_a_cache_of_its_decoders_shape(whisper):
    assert whisper.config.num_attention_heads == 2  # the encoder's
    shape = cache_config(whisper.config)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (2, 4, 4, 16)
    assert_equal_tokens(whisper)


def test_whisper_cross_attention_is_refused_on_a_flat_call(whisper):
    with pghf.HFDecoder(whisper, verify=False):
        cross = whisper.model.decoder.layers[0].encoder_attn
        q = torch.randn(1, 4, 3, 16)
        with pytest.raises(pghf.UnsupportedModelError, match="'whisper': non-causal attention"):
            attention(cross, q, q, q, placeholder_mask("cpu"))


def test_whisper_token_suppression_is_refused_naming_the_field(whisper):
    whisper.generation_config.begin_suppress_tokens = [5, 500]
    try:
        message = refusal(whisper)
    finally:
        whisper.generation_config.begin_suppress_tokens = None
    assert "begin_suppress_tokens" in message and "[5]" in message


# ---------------------------------------------------------------------- BigBird-Pegasus's decoder
def bigbird_pegasus():
    return model("bigbird_pegasus", **IDS, d_model=64, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                 max_position_embeddings=256)


def test_bigbird_pegasus_decoder_runs_exactly_and_is_unmarked_after():
    hf = bigbird_pegasus()
    layers = hf.model.decoder.layers
    assert all(layer.self_attn.is_causal is False for layer in layers)  # causal by its decoder's mask only
    assert_equal_tokens(hf)
    for layer in layers:
        assert CAUSAL not in layer.self_attn.__dict__ and layer.self_attn.is_causal is False
        assert CAUSAL not in layer.encoder_attn.__dict__


def test_bigbird_pegasus_with_a_mask_that_is_not_causal_is_refused(monkeypatch):
    hf = bigbird_pegasus()
    modeling = __import__(type(hf).__module__, fromlist=["create_causal_mask"])
    monkeypatch.setattr(modeling, "create_causal_mask", lambda **kwargs: None)  # eager: every key attended
    assert "differ" in refusal(hf)


# ---------------------------------------------------------------------- OpenAI GPT and XLM
def test_openai_gpt_runs_exactly_and_is_its_own_again_after():
    hf = model("openai-gpt", **IDS, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    assert_equal_tokens(hf)
    assert "forward" not in hf.transformer.__dict__
    assert all(not {"_attn", "config", "scaling", "layer_idx"} & b.attn.__dict__.keys() for b in hf.transformer.h)
    transformers_greedy(hf, PROMPTS[0], NEW)  # transformers' own generate still runs


@pytest.mark.slow
def test_openai_gpt_runs_exactly_compiled():
    """Traced by Dynamo: its base model's flat-call forward and the mask shape its attention knows the call by."""
    hf = model("openai-gpt", **IDS, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    want = [transformers_greedy(hf, prompt, NEW) for prompt in PROMPTS]
    assert pghf.generate(hf, PROMPTS, NEW, mode="none", compiler="eager", prefill_tokens=32, backend="torch",
                         reuse=False) == want


def test_xlm_hand_written_layers_are_refused():
    hf = model("xlm", **IDS, emb_dim=64, n_layers=2, n_heads=4, causal=True, is_decoder=True)
    assert "hand-written" in refusal(hf)
