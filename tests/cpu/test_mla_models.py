"""MLA decoders (DeepSeek-V2/V3, GLM-5 with DSA) against transformers' own forward and generate: tiny random
models of each type saved with ``save_pretrained`` and loaded by piecegraph's loader; presets on the meta device."""

from __future__ import annotations

import pytest
import torch
from hf_reference import transformers_greedy

import piecegraph.hf
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.context import forward_context
from piecegraph.models import generate, quantize_fp8
from piecegraph.models.fp8 import FP8Linear
from piecegraph.models.fp8_moe import FP8Experts
from piecegraph.models.mla import MLADecoder
from piecegraph.models.mla_config import DEEPSEEK_V3_SHAPE, GLM5_SHAPE, TINY_MLA, MLAConfig
from piecegraph.models.mla_loader import load_mla

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[(7 * i + 3) % 256 for i in range(24)], [5, 17, 3, 99, 42, 8, 1]]  # 24 > index_topk 8
NEW_TOKENS = 8
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1}
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
              max_position_embeddings=256, routed_scaling_factor=1.5)
CONFIGS = {
    # DeepSeek-V2-Lite style: no q_lora, softmax routing limited to 1 of 2 groups, 2 shared experts, YaRN
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})),
    # DeepSeek-V3 style: q_lora, sigmoid routing + correction bias in 4 groups (2 kept), YaRN with mscale
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # V3 with rope_interleave=false: rotary halves (rotate_half), plain RoPE, groups off
    "deepseek_v3-halves": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        q_lora_rank=48, n_shared_experts=1, n_group=1, topk_group=1, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0})),
    # GLM-5 style: DSA indexer choosing 8 keys, the middle layer sharing the first's choice
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        q_lora_rank=48, n_shared_experts=1, index_topk=8, index_head_dim=16, index_n_heads=8,
        indexer_types=["full", "shared", "full"])),
    # DeepSeek-V3.2 style: an indexer in every layer whose rotary dims turn in halves (GLM-5's: in pairs), YaRN
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        q_lora_rank=48, n_shared_experts=1, n_group=2, topk_group=1, index_topk=8, index_head_dim=16,
        index_n_heads=8, rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
}


# ---------------------------------------------------------------- tiny transformers models
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that the tokens depend on the context (transformers' 0.02 makes near-ties)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Per model type: (transformers model, its folder, piecegraph's MLADecoder loaded from the folder)."""
    out = {}
    for i, (kind, (config_cls, model_cls, extra)) in enumerate(CONFIGS.items()):
        config = getattr(transformers, config_cls)(**COMMON, **extra)
        hf = getattr(transformers, model_cls)(config).eval()
        _randomize(hf, seed=i)
        folder = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(folder)
        out[kind] = (hf, folder, load_mla(folder))
    return out


def _hf_greedy(hf, prompt):
    return transformers_greedy(hf, prompt, NEW_TOKENS, pad_token_id=0)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_prefill_logits_equal_transformers(tiny, kind):
    hf, _, model = tiny[kind]
    ids = torch.tensor(PROMPTS[0])
    cache = KVCache.for_sequences(model.config, 1, len(ids))
    meta = AttentionMetadata.for_batch(cache, [("a", 0, len(ids))])
    with torch.no_grad(), forward_context(meta):
        ours = model.logits(model(ids, meta.positions))
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_tokens_equal_transformers_generate(tiny, kind):
    """Both prompts in one packed batch; the 24-token one is longer than GLM's index_topk (sparse from the start)."""
    hf, _, model = tiny[kind]
    ours = generate(model, PROMPTS, NEW_TOKENS, eos_token_id=hf.generation_config.eos_token_id)
    assert ours == [_hf_greedy(hf, p) for p in PROMPTS]


def test_config_round_trips_through_transformers(tiny):
    for kind, (_, _, model) in tiny.items():
        assert model.config.model_type == kind.split("-")[0]
        again = MLAConfig.from_hf(model.config.to_hf())
        assert again == model.config.replace(max_seq_len=again.max_seq_len), kind


@pytest.mark.parametrize("preset", [DEEPSEEK_V3_SHAPE, GLM5_SHAPE], ids=["deepseek-v3-shape", "glm5-shape"])
def test_presets_build_on_meta_with_transformers_parameter_count(preset):
    with torch.device("meta"):
        ours = MLADecoder(preset)
        theirs = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**preset.to_hf()))
    count = sum(p.numel() for p in ours.parameters())
    assert count == preset.parameter_counts()[0] == sum(p.numel() for p in theirs.parameters())
    assert all(p.is_meta for p in ours.parameters())
    assert MLAConfig.from_hf(preset.to_hf(), max_seq_len=preset.max_seq_len) == preset
    assert 40e9 < count * 2 < 60e9  # bf16 weights fit one 80 GB GPU beside a KV cache


def test_glm5_shape_facts_on_meta_and_its_kv_budget_on_an_80_gb_gpu():
    """The ``glm5-shape`` preset as bench and serve-bench build it on the GPU (bf16), here on the meta device:
    nothing allocated; weight bytes are its tensors' (routers, the indexer's weights_proj and buffers float32);
    KV bytes per token one latent, rotary key and indexer key per layer. serve-bench's default workload (requests
    up to 800 tokens, 1024 clients, 16-token pages) then gets room for every request at its longest in 85% of
    what an 80 GB GPU has free beside the weights (the CUDA context's ~1 GB set aside)."""
    from piecegraph.serve.kv_budget import kv_budget

    c = GLM5_SHAPE
    model = MLADecoder.random(c, dtype=torch.bfloat16, device="meta")
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    facts = model.facts()
    float32 = sum(p.numel() for n, p in model.named_parameters()
                  if n.endswith(("mlp.gate.weight", "weights_proj.weight")))
    buffers = sum(b.numel() for b in model.buffers())  # e_score_correction_bias, inv_freq: float32
    assert facts.weight_bytes == 2 * (c.parameter_counts()[0] - float32) + 4 * (float32 + buffers)
    assert facts.kv_bytes_per_token() == c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim) * 2
    free = 80e9 - 1e9 - facts.weight_bytes
    budget = kv_budget(max_num_seqs=1024, max_seq_len=800, page_size=16, page_bytes=16 * facts.kv_bytes_per_token(),
                       fraction=0.85, free_bytes=int(free))
    assert not budget.trimmed and budget.pages == 1024 * 50 + 1
    assert budget.pages * budget.page_bytes < 0.25 * free  # MLA's latent cache: a fraction of what is left


def test_a_preset_larger_than_the_host_is_refused_before_allocating(monkeypatch):
    """``piecegraph bench --model glm5-shape --device cpu`` (float32: ~92 GB) says so instead of exhausting the
    host: the check runs on the meta model, before any tensor is allocated."""
    import os

    monkeypatch.setattr(os, "sysconf", lambda name: {"SC_PHYS_PAGES": 2**21, "SC_PAGE_SIZE": 4096}[name])  # 8 GiB
    with pytest.raises(MemoryError, match=r"need 9\d\.\d GB in torch.float32, more than this host's 8.6 GB"):
        MLADecoder.random(GLM5_SHAPE)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_piecegraph_hf_generate_equals_transformers(tiny, kind):
    """``piecegraph.hf.generate`` on the transformers model itself (and on ``piecegraph.hf.load`` of its folder)
    runs the engine's MLA decoder on its tensors."""
    hf, folder, _ = tiny[kind]
    want = [_hf_greedy(hf, p) for p in PROMPTS]
    assert piecegraph.hf.generate(hf, PROMPTS, max_new_tokens=NEW_TOKENS, reuse=False) == want
    loaded = piecegraph.hf.load(folder)
    assert piecegraph.hf.generate(loaded, PROMPTS, max_new_tokens=NEW_TOKENS, reuse=False) == want
    decoder = piecegraph.hf.wrap(hf, verify=True)  # the numeric self-check passes, and nothing is copied
    assert decoder.engine.model.embed_tokens.weight is hf.model.embed_tokens.weight
    assert decoder.facts().config.mla and decoder.config == tiny[kind][2].config.replace(attention_backend="auto")


def test_verify_and_doctor_check_an_mla_model_with_its_own_probe(tiny):
    """``piecegraph.hf.verify`` and ``check_folder`` (``piecegraph doctor --model``) give a verdict for an MLA model
    (its engine decoder against the model's own forward), and a decoder that differs is refused, not run."""
    hf, folder, _ = tiny["glm_moe_dsa"]
    assert piecegraph.hf.verify(hf).ok and piecegraph.hf.check_folder(folder).ok
    decoder = piecegraph.hf.wrap(hf, verify=False)
    own = decoder.engine.model.norm.weight
    decoder.engine.model.norm.weight = torch.nn.Parameter(own.detach() * 1.5)  # the engine's alone now
    verdict = piecegraph.hf.verify(decoder, raise_on_failure=False)
    assert not verdict.ok and "differs from the model's own forward" in verdict.reason
    with pytest.raises(piecegraph.hf.UnsupportedModelError, match="glm_moe_dsa"):
        piecegraph.hf.verify(decoder)
    decoder.engine.model.norm.weight = own
    assert hf.model.norm.weight is own  # the model itself never changed


@pytest.mark.parametrize("kind", ["glm_moe_dsa", "deepseek_v2"])
def test_compile_and_hfdecoder_of_an_mla_model_run_the_mla_decoder(tiny, kind):
    """``piecegraph.compile(hf)`` and ``HFDecoder(hf)`` of an MLA model give the engine's MLA decoder (never
    transformers' expanded attention through the ordinary op): one piece per layer plus one, split at
    ``mla_attention``, and logits equal transformers' own forward on a prompt longer than index_topk."""
    from piecegraph.hf.mla import MLAHFDecoder

    hf, _, _ = tiny[kind]
    assert type(piecegraph.hf.HFDecoder(hf, verify=False)) is MLAHFDecoder
    graphed = piecegraph.compile(hf, mode="none", compiler="eager", max_tokens=32)
    assert type(graphed.model) is MLAHFDecoder and not hasattr(hf, "_piecegraph_hf")  # the model is not wrapped
    ids = torch.tensor(PROMPTS[0])
    cache = KVCache.for_sequences(graphed.model.config, 1, len(ids))
    meta = AttentionMetadata.for_batch(cache, [("a", 0, len(ids))])
    with torch.no_grad(), forward_context(meta):
        ours = graphed.model.logits(graphed(ids, meta.positions))
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    stats = graphed.stats()
    assert stats["split_ops"] == hf.config.num_hidden_layers and stats["pieces"] == stats["split_ops"] + 1


@pytest.mark.parametrize("kind, mode, page_size", [("glm_moe_dsa", "eager", 4), ("glm_moe_dsa", "auto", 4),
                                                    ("deepseek_v32", "eager", 4), ("glm_moe_dsa", "eager", 16),
                                                    ("deepseek_v3", "eager", 16)])
def test_engine_serves_dsa_folders_like_transformers(tiny, kind, mode, page_size):
    """The serving engine on a GLM-5, DeepSeek-V3.2 or DeepSeek-V3 folder loaded as ``piecegraph serve DIR`` loads
    it: two concurrent requests, one longer than index_topk, prefills chunked by a 16-token step budget, pages of 4
    or 16 tokens (``serve``'s default); greedy tokens equal transformers'."""
    from piecegraph.cli_common import load_model
    from piecegraph.serve import Engine, EngineConfig, SamplingParams

    hf, folder, _ = tiny[kind]
    model = load_model(str(folder), "cpu", torch.float32)
    assert isinstance(model, MLADecoder)
    config = EngineConfig(mode=mode, max_num_seqs=2, max_num_batched_tokens=16, page_size=page_size, max_seq_len=40,
                          decode_sizes=(1, 2), prefill_sizes=(4, 16), compiler="eager", emulate_graphs=True)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, eos_token_id=hf.generation_config.eos_token_id)
    assert Engine(model, config).generate(PROMPTS, params) == [_hf_greedy(hf, p) for p in PROMPTS]


def test_bench_prices_and_profiles_the_mla_attention_op(monkeypatch):
    """``bench``'s attention-op cost table prices ``mla_attention`` for an MLA model (layer 0's DSA indexer
    included), with arguments the op's own checks accept; the step profile counts its calls as split-op calls."""
    import piecegraph.bench.profile as bench_profile
    from piecegraph.models.mla_config import TINY_GLM5

    model = MLADecoder.random(TINY_GLM5, seed=0)
    seen, real = [], bench_profile._op_and_args
    monkeypatch.setattr(bench_profile, "_op_and_args", lambda facts, n: seen.append(real(facts, n)) or seen[-1])
    result = bench_profile.attention_op_us(model.facts(), "torch", context=12, calls=2)
    assert "failed" not in result and result["decode_1"] > 0 and result["prefill_512"] > 0, result
    op, args = seen[-1]
    assert op is torch.ops.piecegraph_models.mla_attention
    c = TINY_GLM5
    assert args[0].shape == (512, c.num_heads, c.kv_lora_rank) and args[7] == c.index_topk
    assert args[8].shape == (512, c.index_n_heads, c.index_head_dim)  # layer 0 has its own indexer
    profiled = bench_profile.profile_step(model, model.facts(), "eager", 2, context=12, steps=2, attention="torch")
    assert profiled["split_calls_per_step"] == c.num_layers


@torch.no_grad()
def test_fp8_mla_decoder_stays_near_its_float_weights():
    """``--quant fp8``: experts, o_proj and the dense/shared MLPs in e4m3 (the first-order bound of
    tests/cpu/test_fp8.py, 2^-3 on the hidden states); the latent projections, routers and norms stay float."""
    base, fp8 = MLADecoder.random(TINY_MLA, seed=1), quantize_fp8(MLADecoder.random(TINY_MLA, seed=1))
    assert isinstance(fp8.model.layers[1].mlp.experts, FP8Experts)
    attn = fp8.model.layers[1].self_attn
    assert isinstance(attn.o_proj, FP8Linear) and isinstance(attn.kv_b_proj, torch.nn.Linear)
    assert fp8.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ids = torch.tensor(PROMPTS[0])
    outs = []
    for model in (base, fp8):
        cache = KVCache.for_sequences(TINY_MLA, 1, len(ids), page_size=4)
        meta = AttentionMetadata.for_batch(cache, [("a", 0, len(ids))])
        with forward_context(meta):
            outs.append(model(ids, meta.positions))
    rel = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert 0 < rel <= 2.0**-3, rel


def test_loader_skips_layers_beyond_num_hidden_layers_with_a_note(tiny, tmp_path, caplog):
    """Multi-token-prediction layers (``model.layers.{num_hidden_layers}...``) are skipped, with one line."""
    from safetensors.torch import load_file, save_file

    _, folder, model = tiny["deepseek_v3"]
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_text((folder / name).read_text())
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.ones(64, 128)
    tensors["model.layers.3.self_attn.kv_b_proj.weight"] = torch.ones(3, 3)
    save_file(tensors, tmp_path / "model.safetensors")
    with caplog.at_level("WARNING", logger="piecegraph.models"):
        again = load_mla(tmp_path)
    assert "skipping layers [3]" in caplog.text
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_bf16_on_gpu_near_transformers(tiny):
    """bf16 on the GPU (grouped_mm experts, the cache's default backend): prefill logits as near transformers'
    float32 forward as transformers' own bf16 forward is (within twice its error, plus 2%: routing ties), for every
    type."""
    for kind, (hf, folder, _) in tiny.items():
        model = load_mla(folder, dtype=torch.bfloat16, device="cuda")
        cls = getattr(transformers, type(hf).__name__)
        ids = torch.tensor(PROMPTS[0], device="cuda")
        cache = KVCache.for_sequences(model.config, 1, len(ids), dtype=torch.bfloat16, device="cuda")
        meta = AttentionMetadata.for_batch(cache, [("a", 0, len(ids))])
        with forward_context(meta):
            ours = model.logits(model(ids, meta.positions)).float()
        exact = cls.from_pretrained(folder, dtype=torch.float32).cuda()(ids[None]).logits[0]
        theirs = cls.from_pretrained(folder, dtype=torch.bfloat16).cuda()(ids[None]).logits[0].float()
        ours_err, their_err = (((t - exact).norm() / exact.norm()).item() for t in (ours, theirs))
        assert ours_err <= 2 * their_err + 2e-2, (kind, ours_err, their_err)


def test_kv_bytes_per_token_is_what_the_latent_cache_holds(tiny):
    """ModelFacts.kv_bytes_per_token of an MLA model: the bytes its KV cache really allocates per token (latent,
    rotary key, indexer key; once for all heads), far below the heads' expanded keys and values."""
    for kind, (_, _, model) in tiny.items():
        cache = KVCache(model.config, num_pages=3, page_size=4)
        held = sum(t.numel() * t.element_size() for t in [*cache.k, *cache.v, *getattr(cache, "index_k", [])])
        assert model.facts().kv_bytes_per_token() == held // (3 * 4), kind
        for layer, kind_of_indexer in enumerate(getattr(model.config, "layer_indexer_types", ())):
            assert bool(cache.index_k[layer].numel()) == (kind_of_indexer == "full"), (kind, layer)  # shared: none
        c = model.config
        expanded = c.num_layers * c.num_heads * (c.qk_head_dim + c.value_head_dim) * 4
        assert held // 12 < expanded / 2, kind


# glm_moe_dsa's seed 1 puts exact ties (index scores of 0) at the top-k boundary of its longer prompt
@pytest.mark.parametrize("kind, seed", [("glm_moe_dsa", 1), ("deepseek_v3", 0)])
def test_a_served_folder_answers_with_transformers_tokens(tmp_path, kind, seed):
    """What ``piecegraph serve DIR`` runs on a CPU (the folder's model by ``load_model``, its own tokenizer, the
    HTTP server, the engine's CPU defaults: eager, 16-token pages): completions of a prompt longer than
    index_topk and of a short one equal transformers' greedy tokens."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from byte_tokenizer import write_byte_tokenizer

    from piecegraph.cli_common import load_model
    from piecegraph.serve import Engine, EngineConfig
    from piecegraph.server.run import BackgroundServer, build_state
    from piecegraph.server.tokenizer import load_tokenizer

    vocab_size = write_byte_tokenizer(tmp_path)
    config_cls, model_cls, extra = CONFIGS[kind]
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**COMMON, "vocab_size": vocab_size},
                                                                         **extra)).eval()
    _randomize(hf, seed=seed)
    hf.save_pretrained(tmp_path)
    engine = Engine(load_model(str(tmp_path), "cpu", torch.float32), EngineConfig(mode="eager", max_num_seqs=4,
                                                                                   max_seq_len=64))
    got = []
    with BackgroundServer(build_state(engine, load_tokenizer(str(tmp_path), 0), kind)) as server:
        for prompt in PROMPTS:
            body = {"model": kind, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                    "return_token_ids": True}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            got.append(response.json()["choices"][0]["token_ids"])
    assert engine.cache.page_size == 16
    assert got == [_hf_greedy(hf, p) for p in PROMPTS]
