"""Hugging Face decoders through piecegraph, unmodified, against Hugging Face's own forward and generate.

Tiny random configs of every supported architecture, float32 on CPU: the graph splits into layers + 1 pieces,
logits equal ``model(input_ids).logits`` for single prompts and a packed batch, greedy tokens equal
``model.generate(do_sample=False)`` in ``mode="none"`` and with emulated graphs (piecewise prefill, full decode),
a ``save_pretrained`` folder loads back to the same tokens, and what piecegraph cannot compute is refused.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import transformers_greedy  # noqa: E402

import piecegraph  # noqa: E402
import piecegraph.hf as pghf  # noqa: E402
from piecegraph.attention import AttentionMetadata, KVCache  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256)
# Per model type, what makes its tiny config exercise its features: sliding windows shorter than the prompts,
# Gemma's query_pre_attn_scalar (a softmax scale that is not head_dim ** -0.5), Gemma 2's softcaps, experts.
ARCHS = {
    "llama": {},
    "mistral": dict(sliding_window=6),
    "qwen2": {},
    "qwen3": dict(head_dim=32),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=8, sliding_window=5, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=32, sliding_window=5),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=7),
}
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11], [7, 7, 1], [100, 13, 54, 2, 8, 31, 77, 64]]
NEW = 16


def tiny(model_type, seed=0, **changes):
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **ARCHS[model_type], **changes})
    torch.manual_seed(seed)
    # Gemma 2's reference is its eager attention: transformers < 5.2x loads it with sdpa, which drops the
    # attention logit softcap (Hugging Face's own forward is then not Gemma 2).
    attn = {"attn_implementation": "eager"} if model_type == "gemma2" else {}
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn).eval()
    with torch.no_grad():  # projections ~ N(0, 1/fan_in): each layer matters, so greedy tokens depend on context
        for name, param in model.named_parameters():
            if "proj" in name and param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
            elif "embed" in name:
                param.normal_(0, 0.02 if model_type.startswith("gemma") else 0.1)  # Gemma scales it by sqrt(hidden)
    return model


def hf_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def hf_greedy(model, prompt, new=NEW, **kwargs):
    return transformers_greedy(model, prompt, new, **kwargs)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def flat_logits(fn, decoder, prompts):
    """Logits of every token of ``prompts`` packed into one step of a fresh paged cache."""
    cache = KVCache.for_sequences(decoder.config, len(prompts), 32, page_size=4, backend="torch")
    meta = AttentionMetadata.for_batch(cache, [(i, 0, len(p)) for i, p in enumerate(prompts)])
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.no_grad(), piecegraph.forward_context(meta):
        hidden = fn(ids, meta.positions)
    return decoder.logits(hidden[: len(ids)]).split([len(p) for p in prompts])


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_graph_splits_into_layers_plus_one_pieces_and_logits_equal_hf(model_type):
    model = tiny(model_type)
    singles = [[3], PROMPTS[1], PROMPTS[0]]
    expected = [hf_logits(model, p) for p in singles + PROMPTS]
    graphed = piecegraph.compile(model, mode="none", compiler="eager", max_tokens=32)
    assert isinstance(graphed.model, pghf.HFDecoder)
    for prompt, want in zip(singles, expected):
        (got,) = flat_logits(graphed, graphed.model, [prompt])
        assert rel(got, want) < 1e-5, (model_type, len(prompt), rel(got, want))
    for got, want in zip(flat_logits(graphed, graphed.model, PROMPTS), expected[len(singles):]):
        assert rel(got, want) < 1e-5, (model_type, "packed", rel(got, want))
    stats = graphed.stats()
    layers = model.config.num_hidden_layers
    assert stats["pieces"] == layers + 1 and stats["split_ops"] == layers
    # Hugging Face's own forward still gives what it gave before the wrap.
    assert torch.equal(hf_logits(model, PROMPTS[2]), expected[-1])


def test_inductor_pieces_equal_hf_logits():
    model = tiny("qwen2")
    expected = [hf_logits(model, p) for p in PROMPTS]
    graphed = piecegraph.compile(model, mode="none", compiler="inductor", max_tokens=32)
    for got, want in zip(flat_logits(graphed, graphed.model, PROMPTS), expected):
        assert rel(got, want) < 1e-5


@pytest.mark.parametrize("model_type", sorted(ARCHS))
@pytest.mark.parametrize("mode", ["none", "emulated-graphs"])
def test_greedy_tokens_equal_hf_generate(model_type, mode):
    model = tiny(model_type, seed=1)
    expected = [hf_greedy(model, p) for p in PROMPTS]
    options = {"mode": "none"} if mode == "none" else {"mode": "graphs", "emulate_graphs": True}
    session = pghf.Session(model, max_seqs=len(PROMPTS), max_len=32, prefill_tokens=32, compiler="eager",
                           backend="torch", **options)
    assert session.generate(PROMPTS, NEW) == expected
    if mode != "none":
        assert session.prefill.stats()["fallbacks"] == 0 and session.decode.stats()["replays"] > 0
        assert session.prefill.config.pool is session.decode.config.pool is session.pool
    assert session.cache.sequences() == []  # every sequence's pages freed
    assert [hf_greedy(model, p) for p in PROMPTS] == expected  # the model's own generate is unchanged


def test_a_session_can_capture_every_size_at_once_on_one_shared_trace():
    """``Session(capture=True, share_trace=True)``: construction traces once (the decode module builds from the
    prefill module's trace), captures every prefill and decode size, and ``generate`` then captures nothing and
    gives Hugging Face's own greedy tokens. ``capture`` without graphs is refused, naming the argument."""
    model = tiny("qwen2", seed=1)
    expected = [hf_greedy(model, p) for p in PROMPTS]
    with pghf.Session(model, max_seqs=len(PROMPTS), max_len=32, prefill_tokens=32, compiler="eager",
                      backend="torch", emulate_graphs=True, share_trace=True, capture=True) as session:
        captured = {name: set(module.stats()["capture_s"]) for name, module in
                    (("prefill", session.prefill), ("decode", session.decode))}
        assert captured == {"prefill": set(session.prefill.config.sizes), "decode": set(session.decode.config.sizes)}
        assert session.decode.stats()["startup"]["trace"] == "shared"
        assert session.generate(PROMPTS, NEW) == expected
        assert {name: set(module.stats()["capture_s"]) for name, module in
                (("prefill", session.prefill), ("decode", session.decode))} == captured
        assert session.decode.stats()["replays"] > 0
    with pytest.raises(ValueError, match="capture=True captures CUDA graphs, which mode='none' has none of"):
        pghf.Session(model, max_seqs=1, max_len=32, mode="none", backend="torch", capture=True)
    assert [hf_greedy(model, p) for p in PROMPTS] == expected


def test_generation_stops_at_eos_and_keeps_it():
    model = tiny("llama", seed=2)
    free_run = hf_greedy(model, PROMPTS[0], eos_token_id=-1)
    eos = free_run[3]
    expected = hf_greedy(model, PROMPTS[0], eos_token_id=eos)
    got = pghf.generate(model, [PROMPTS[0], PROMPTS[1]], NEW, eos_token_id=eos, mode="eager", backend="torch")
    assert got[0] == expected == free_run[: free_run.index(eos) + 1]
    assert len(got[1]) == NEW or got[1][-1] == eos


@pytest.mark.parametrize("model_type", ["llama", "mixtral", "gemma2"])
def test_save_pretrained_folder_gives_the_same_tokens(tmp_path, model_type):
    model = tiny(model_type, seed=3)
    expected = [hf_greedy(model, p) for p in PROMPTS]
    model.save_pretrained(tmp_path)
    assert not (tmp_path / "pytorch_model.bin").exists() and (tmp_path / "config.json").is_file()
    loaded = pghf.load(tmp_path, dtype=torch.float32)
    assert loaded.model_type == model_type
    assert pghf.generate(loaded, PROMPTS, NEW, mode="none", compiler="eager", backend="torch") == expected


def test_cache_is_sized_from_the_hf_config():
    model = tiny("llama", num_attention_heads=8, num_key_value_heads=2)  # head_dim from hidden // heads
    config = pghf.HFDecoder(model).config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 8, 2, 8)
    assert config.max_seq_len == 256
    cache = KVCache.for_sequences(config, 2, 16)
    assert cache.k[0].shape[2:] == (2, 8) and len(cache.k) == 2


def test_unsupported_models_are_refused_naming_their_type():
    falcon = transformers.FalconForCausalLM(transformers.FalconConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64, alibi=True))
    with pytest.raises(pghf.UnsupportedModelError, match="'falcon'.*ALiBi"):
        piecegraph.compile(falcon)
    eager_moe = tiny("mixtral", experts_implementation="eager")
    with pytest.raises(pghf.UnsupportedModelError, match="'mixtral'.*batched_mm"):
        pghf.HFDecoder(eager_moe)
    with pytest.raises(TypeError, match="ForCausalLM"):
        pghf.HFDecoder(tiny("llama").model)


def test_flashinfer_is_refused_for_windows_and_softcaps_naming_the_model():
    with pytest.raises(ValueError, match="'gemma2'.*attention_backend='torch'"):
        pghf.HFDecoder(tiny("gemma2")).check_backend("flashinfer")
    pghf.HFDecoder(tiny("qwen2")).check_backend("flashinfer")  # plain layers: nothing to refuse
    # Mistral's window (6) exceeds a cache of 4 tokens: it never hides a key there, so nothing is refused.
    pghf.HFDecoder(tiny("mistral"), max_seq_len=4).check_backend("flashinfer")


def test_plain_modules_are_not_taken_for_hf_models():
    assert not pghf.is_hf_model(torch.nn.Linear(2, 2))
    assert pghf.is_hf_model(tiny("llama"))


def test_cli_demo_and_bench_on_a_local_hf_folder(tmp_path):
    from typer.testing import CliRunner

    from piecegraph.cli import app

    tiny("mistral", seed=4).save_pretrained(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["demo", "--device", "cpu", "--steps", "3", "--hf", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "graphed tokens equal eager tokens" in result.output
    result = runner.invoke(app, ["bench", "--device", "cpu", "--model", str(tmp_path), "--hf", "--modes", "eager",
                                 "--batches", "1", "--prefill", "8", "--context", "8", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["demo", "--device", "cpu", "--hf", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "--hf" in result.output

