"""``save_hf`` of a model fused by ``fuse_projections`` writes the unfused Hugging Face folder, which ``load_hf`` and
transformers read back with the unfused model's logits; FP8 models and weights the config does not describe are
refused."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

transformers = pytest.importorskip("transformers")

import piecegraph  # noqa: E402
from piecegraph.attention import AttentionMetadata, KVCache  # noqa: E402
from piecegraph.models import TINY, Decoder, fuse_projections, load_hf, quantize_fp8, save_hf  # noqa: E402

PROMPT = [5, 17, 3, 99, 42, 7, 8, 9, 10, 11, 1, 2, 3]


def _logits(model):
    cache = KVCache.for_sequences(model.config, 1, 32, backend="torch")
    meta = AttentionMetadata.for_batch(cache, [("a", 0, len(PROMPT))])
    with torch.no_grad(), piecegraph.forward_context(meta):
        return model.logits(model(torch.tensor(PROMPT), meta.positions))


@pytest.fixture(scope="module")
def plain():
    """The unfused decoder: the independent reference for every fused save."""
    return Decoder.random(TINY, seed=0)


def test_fused_model_saves_the_unfused_folder(plain, tmp_path):
    fused = fuse_projections(copy.deepcopy(plain))
    save_hf(plain, tmp_path / "plain")
    save_hf(fused, tmp_path / "fused")
    assert hasattr(fused.model.layers[0].self_attn, "qkv_proj")  # saving leaves the model fused
    assert (json.loads((tmp_path / "fused" / "config.json").read_text())
            == json.loads((tmp_path / "plain" / "config.json").read_text()))
    written, expected = load_file(tmp_path / "fused" / "model.safetensors"), load_file(
        tmp_path / "plain" / "model.safetensors")
    assert written.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(written[name], tensor), name

    reference = _logits(plain)
    torch.testing.assert_close(_logits(load_hf(tmp_path / "fused")), reference, rtol=0, atol=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fused", local_files_only=True).eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(hf_logits, reference, rtol=1e-5, atol=1e-5)


def test_fp8_model_is_refused_before_anything_is_written(plain, tmp_path):
    model = quantize_fp8(fuse_projections(copy.deepcopy(plain)), "torch")
    with pytest.raises(ValueError, match="before quantize_fp8"):
        save_hf(model, tmp_path / "fp8")
    assert not (tmp_path / "fp8").exists()


def test_weights_the_config_does_not_describe_are_refused(plain, tmp_path):
    model = copy.deepcopy(plain)
    model.model.layers[1].mlp.down_proj = nn.Linear(TINY.intermediate_size, TINY.hidden_size, bias=True)
    with pytest.raises(ValueError, match=r"unexpected \[model\.layers\.1\.mlp\.down_proj\.bias\]"):
        save_hf(model, tmp_path / "changed")
