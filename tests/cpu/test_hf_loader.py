"""``load_hf`` / ``ModelConfig.from_hf`` on transformers 5 checkpoints (``rope_parameters``, ``head_dim``, tied
embeddings, q/k/v biases), against Hugging Face's own forward; what the reference decoder cannot compute is refused."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import piecegraph  # noqa: E402
import piecegraph.hf as pghf  # noqa: E402
from piecegraph.attention import AttentionMetadata, KVCache  # noqa: E402
from piecegraph.models import TINY, Decoder, ModelConfig, load_hf, save_hf  # noqa: E402

PROMPT = [5, 17, 3, 99, 42, 7, 8, 9, 10, 11, 1, 2, 3]
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.1)


def _hf(model_type, **changes):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **changes})
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _reference_logits(model, prompt=PROMPT):
    cache = KVCache.for_sequences(model.config, 1, 32, backend="torch")
    meta = AttentionMetadata.for_batch(cache, [("a", 0, len(prompt))])
    with torch.no_grad(), piecegraph.forward_context(meta):
        return model.logits(model(torch.tensor(prompt), meta.positions))


def _hf_logits(model, prompt=PROMPT):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model_type, changes", [
    ("qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    ("llama", dict(tie_word_embeddings=True, head_dim=32)),
    ("llama", dict(num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
])
def test_load_hf_reads_transformers_5_checkpoints(tmp_path, model_type, changes):
    hf = _hf(model_type, **changes)
    hf.save_pretrained(tmp_path)
    assert "rope_parameters" in (tmp_path / "config.json").read_text()  # where transformers 5 writes rope_theta
    model = load_hf(tmp_path)
    assert model.config.rope_theta == hf.config.rope_parameters["rope_theta"]
    assert model.config.head_dim == (getattr(hf.config, "head_dim", None) or 16)
    assert model.config.tie_embeddings == hf.config.tie_word_embeddings
    assert _rel(_reference_logits(model), _hf_logits(hf)) < 1e-5


def test_rope_scaling_is_refused_by_the_reference_loader_and_runs_through_hf(tmp_path):
    scaling = {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    hf = _hf("llama", rope_parameters=scaling)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="llama3.*piecegraph.hf.load"):
        load_hf(tmp_path)
    wrapped = pghf.load(tmp_path)  # Hugging Face's own rotary computes the scaled RoPE
    assert _rel(_reference_logits(wrapped), _hf_logits(hf)) < 1e-5


def test_llama_attention_bias_is_refused_by_the_reference_loader_and_runs_through_hf(tmp_path):
    hf = _hf("llama", attention_bias=True)  # biases q, k, v and o: the reference decoder has no o_proj bias
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="o_proj.*piecegraph.hf.load"):
        load_hf(tmp_path)
    assert _rel(_reference_logits(pghf.load(tmp_path)), _hf_logits(hf)) < 1e-5


def test_from_hf_reads_rope_parameters_and_old_top_level_theta():
    base = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4}
    rope = {"rope_type": "default", "rope_theta": 1e6}
    assert ModelConfig.from_hf({**base, "rope_parameters": rope}).rope_theta == 1e6
    assert ModelConfig.from_hf({**base, "rope_theta": 5e5}).rope_theta == 5e5
    assert ModelConfig.from_hf(base).rope_theta == 10000.0
    assert ModelConfig.from_hf({**base, "head_dim": None}).head_dim == 8
    for bad, needle in (({"mlp_bias": True}, "mlp_bias"), ({"hidden_act": "gelu"}, "hidden_act"),
                        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn")):
        with pytest.raises(ValueError, match=needle):
            ModelConfig.from_hf({**base, **bad})


def test_save_hf_is_read_by_transformers_with_the_same_logits(tmp_path):
    model = Decoder.random(TINY.replace(rope_theta=1e6), seed=1)
    save_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert hf.config.rope_parameters["rope_theta"] == 1e6
    prompt = [t % TINY.vocab_size for t in PROMPT]
    assert _rel(_reference_logits(model, prompt), _hf_logits(hf, prompt)) < 1e-5
