"""Model families beyond the generic path of ``piecegraph.hf``: each runs with transformers' exact greedy tokens
or is refused with a message naming its model type and the reason, never run wrong.

- GLM-5 (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``) as transformers configures them (``layer_types``
  of ``"indexed_attention"``, DeepSeek sparse attention) run on the engine's MLA decoder; DSA types whose layers
  differ from that decoder's are refused naming the difference;
- JetMoE's mixture-of-attention heads (keys tiled over the query heads) run as grouped-query attention;
- GPT-Neo's and GPT-NeoX-Japanese's hand-written attention (GPT-Neo's unscaled, in global and local layers) runs
  through piecegraph's attention while wrapped, and is their own again after;
- layers with more key/value heads than others (MiMo-V2-Flash) run on a cache of the most, the others' repeated;
- key/value head counts that do not divide, an attention module that does not declare itself causal (Doge's
  dynamic mask) and other hand-written attention (OpenAI GPT) are refused;
- BERT-like causal LMs (RoCBert) run as decoders and are refused as bidirectional encoders.
"""

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_tiny import (  # noqa: E402
    BASE,
    NEW,
    PROMPTS,
    hf_greedy,
    init_fan_in,
    random_causal_lm,
    refusal,
    sized_config,
    skip_unless_known,
)

import piecegraph.hf as pghf  # noqa: E402
import piecegraph.hf.adapters as adapters  # noqa: E402
import piecegraph.hf.families as families  # noqa: E402
from piecegraph.hf.mla import MLAHFDecoder  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
# DSA types piecegraph refuses, and a phrase of what their refusal names
DSA_REFUSED = {"hy_v4": "hyper-connections", "axk2": "gated RMSNorms",
               "deepseek_v4": "compressed"}


def config(model_type, **fields):
    """A tiny config of ``model_type`` (fields its config does not have are dropped)."""
    skip_unless_known(model_type)
    return sized_config(model_type, **fields)


def model(cfg):
    """A float32 tiny random causal LM of ``cfg``, projections ~ N(0, 1/fan_in) so that every layer matters."""
    hf = random_causal_lm(cfg, init_fan_in)
    if getattr(hf.config, "_experts_implementation", None) == "eager":
        hf.config._experts_implementation = "batched_mm"  # as piecegraph.hf.load: eager experts do not trace
    return hf


def assert_equal_tokens(hf):
    """piecegraph's greedy tokens (config check, wrap, numeric self-check, generate) equal transformers'."""
    want = hf_greedy(hf)
    pghf.check_supported(hf.config)
    got = pghf.generate(hf, PROMPTS, NEW, mode="eager", backend="torch", reuse=False)
    pghf.unwrap(hf)
    assert got == want


# ---------------------------------------------------------------------- DeepSeek sparse attention
@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])  # indexer rotary in pairs / in halves
def test_dsa_types_as_transformers_configures_them_run_exactly(model_type):
    cfg = config(model_type, **{**BASE, **MLA}, index_topk=4, index_head_dim=16, index_n_heads=4,
                 indexer_types=["full", "shared"])  # deepseek_v32 has no indexer_types: every layer full
    assert set(cfg.layer_types) == {"indexed_attention"}  # what a name-free layer-kind check refused
    hf = model(cfg)
    assert isinstance(pghf.HFDecoder(hf, verify=False), MLAHFDecoder)
    assert_equal_tokens(hf)  # prompts of 10 > index_topk 4 keys: the indexer's choice matters


@pytest.mark.parametrize("model_type", list(DSA_REFUSED))
def test_dsa_types_unlike_the_mla_decoder_are_refused_naming_the_difference(model_type):
    cfg = config(model_type)  # the config alone is refused: no weights are built
    with pytest.raises(pghf.UnsupportedModelError) as err:
        pghf.check_supported(cfg)
    message = str(err.value)
    assert repr(model_type) in message and DSA_REFUSED[model_type] in message, message
    assert "glm_moe_dsa" in message  # what piecegraph does run


# ---------------------------------------------------------------------- JetMoE's mixture-of-attention heads
def jetmoe():
    return model(config("jetmoe", **BASE, num_local_experts=4, num_experts_per_tok=2, kv_channels=16))


def test_jetmoe_tiled_keys_run_exactly_as_grouped_query_attention():
    hf = jetmoe()
    attn = hf.model.layers[0].self_attention
    assert attn.top_k * hf.config.num_key_value_heads == hf.config.num_attention_heads  # 2 tiles of 2 kv heads
    assert_equal_tokens(hf)


def test_jetmoe_without_its_head_adapter_is_refused_not_run_wrong(monkeypatch):
    monkeypatch.setattr(families, "HEAD_ADAPTERS", [])  # a fresh model: the self-check's verdict is per instance
    assert "its forward fails under piecegraph's flat attention" in refusal(jetmoe())


def test_jetmoe_heads_in_the_modules_order_differ_and_are_refused(monkeypatch):
    def untiled_in_order(module, query, key, value):  # the first tile's keys, queries not reordered: wrong
        kv = key.shape[1] // module.top_k
        return query, key[:, :kv], value[:, :kv], lambda out: out

    monkeypatch.setattr(families, "HEAD_ADAPTERS", [(families._is_jetmoe_attention, untiled_in_order)])
    assert "differ" in refusal(jetmoe())


# ---------------------------------------------------------------------- refused, naming why
def test_layers_with_more_key_value_heads_than_others_run_exactly():
    """MiMo-V2-Flash: its sliding-window layer has twice the key/value heads of its full layer (and attention
    sinks, values of another width): the cache holds the most, the full layer's heads repeated to fill it."""
    hf = model(config("mimo_v2_flash", **BASE, layer_types=["full_attention", "sliding_attention"],
                      sliding_window=4, mlp_layer_types=["dense", "dense"], v_head_dim=8))
    with torch.no_grad():
        hf.model.layers[1].self_attn.sinks.normal_(0, 1)
    assert [a.self_attn.num_key_value_groups for a in hf.model.layers] == [2, 1]
    assert pghf.wrap(hf, verify=False).config.num_kv_heads == 4
    pghf.unwrap(hf)
    assert_equal_tokens(hf)
    assert all(families.REPEAT not in layer.self_attn.__dict__ for layer in hf.model.layers)  # unwrapped


def test_key_value_head_counts_that_do_not_divide_are_refused():
    layers = [types.SimpleNamespace(num_key_value_groups=g) for g in (4, 3)]  # of 12 query heads: 3, 4 kv heads
    assert families.kv_heads_refusal("x", layers[:1] * 2, 12) is None
    assert "layers [0] have 3, layers [1] have 4" in families.kv_heads_refusal("x", layers, 12)


def test_an_attention_that_does_not_declare_itself_causal_is_refused():
    hf = model(config("doge", **BASE))  # Doge's dynamic mask: a per-key bias computed from the values
    assert "DogeAttention) without is_causal" in refusal(hf)


def test_hand_written_attention_is_refused():
    assert "hand-written" in refusal(model(config("xlm", **BASE)))


# ---------------------------------------------------------------------- GPT-Neo
def gpt_neo():
    """A global then a local layer whose window (4) is shorter than the prompts: both kinds matter."""
    return model(config("gpt_neo", **BASE, attention_types=[[["global", "local"], 1]], window_size=4))


def test_gpt_neo_runs_exactly_and_is_its_own_again_after():
    hf = gpt_neo()
    attention = [block.attn.attention for block in hf.transformer.h]
    assert [a.attention_type for a in attention] == ["global", "local"]
    assert_equal_tokens(hf)
    assert all(not {"_attn", "scaling", "layer_idx", "sliding_window"} & a.__dict__.keys() for a in attention)
    hf_greedy(hf)  # transformers' own generate still runs (its own _attn)


@pytest.mark.slow
def test_gpt_neo_runs_exactly_compiled():
    hf = gpt_neo()
    want = hf_greedy(hf)
    assert pghf.generate(hf, PROMPTS, NEW, mode="none", compiler="eager", prefill_tokens=32, backend="torch",
                         reuse=False) == want


def test_gpt_neox_japanese_runs_exactly_again_from_a_kept_session():
    """Its hand-written attention (scaled by 1 / norm_factor) is adapted as GPT-Neo's; a second call reuses the
    session kept from the first (suspended, then resumed: the adapted attributes set again) and is as exact."""
    hf = model(config("gpt_neox_japanese", **BASE))
    want = hf_greedy(hf)
    for _ in range(2):
        assert pghf.generate(hf, PROMPTS, NEW, mode="eager", backend="torch") == want
        assert not {"_attn", "config", "scaling"} & hf.gpt_neox_japanese.layers[0].attention.__dict__.keys()
    hf_greedy(hf)  # transformers' own generate still runs


def test_gpt_neo_without_its_local_window_differs_and_is_refused(monkeypatch):
    fields = adapters._gpt_neo_fields
    monkeypatch.setattr(adapters, "HAND_WRITTEN", [(families._is_gpt_neo_attention,
                                                    lambda *a: {**fields(*a), "sliding_window": None})])
    assert "layer 1" in refusal(gpt_neo())  # the local layer is the first that differs


# ---------------------------------------------------------------------- BERT-like causal LMs
def roc_bert(is_decoder):
    return model(config("roc_bert", **BASE, pronunciation_vocab_size=16, shape_vocab_size=16,
                        pronunciation_embed_dim=16, shape_embed_dim=16, is_decoder=is_decoder))


def test_a_bert_like_causal_lm_runs_exactly_as_a_decoder():
    assert_equal_tokens(roc_bert(is_decoder=True))


def test_a_bert_like_encoder_without_is_decoder_is_refused():
    assert "causal" in refusal(roc_bert(is_decoder=False))
