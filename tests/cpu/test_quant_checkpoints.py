"""Quantized checkpoints as they are published (block-scaled FP8, compressed-tensors FP8, ModelOpt NVFP4), made
here from tiny random transformers models by this file's own float64 quantizers: the loaders dequantize them
exactly, the serving engine and piecegraph.hf give transformers' greedy tokens on the dequantized weights, the
banner names the format, and the FP8-kept (GPU) load path runs on CPU through its torch kernels."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

import piecegraph.hf as pghf  # noqa: E402
from piecegraph.models import load_hf  # noqa: E402
from piecegraph.models import quant_formats as qf  # noqa: E402
from piecegraph.models.fp8_block import FP8BlockLinear, FP8ChannelLinear  # noqa: E402
from piecegraph.serve import EngineConfig, SamplingParams  # noqa: E402
from piecegraph.server.command import build_engine, checkpoint_note  # noqa: E402

FP8 = torch.float8_e4m3fn
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
PROMPTS = [[5, 17, 3, 99, 42, 7], [8, 9, 10, 11, 1, 2, 3, 4, 120]]
NEW = 8
BASE = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.08, max_position_embeddings=64)
CONFIGS = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
    "ct": {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
           "config_groups": {"group_0": {
               "targets": ["Linear"],
               "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
                           "group_size": None, "block_structure": None, "observer": "minmax"},
               "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                     "dynamic": True}}},
           "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
              "exclude_modules": ["lm_head"], "producer": {"name": "modelopt", "version": "0.29.0"}},
}
LABELS = {"fp8": "fp8 (block 128x128)", "ct": "fp8 (per-channel, compressed-tensors)", "nvfp4": "nvfp4 (modelopt"}


# -- the test's own quantizers and float64 dequantization ----------------------------------------------------------
def _blocks(w, block=(128, 128)):
    n, k = w.shape
    wp = torch.nn.functional.pad(w.double(), (0, -k % block[1], 0, -n % block[0]))
    return wp.view(wp.shape[0] // block[0], block[0], wp.shape[1] // block[1], block[1]), n, k


def quantize(w, fmt):
    """``{suffix: tensor}`` for one weight in ``fmt``, and its float64 dequantization."""
    if fmt == "fp8":
        tiles, n, k = _blocks(w)
        scale = (tiles.abs().amax((1, 3)) / 448).float()
        q = (tiles / scale.double()[:, None, :, None]).float().to(FP8).view(-1, tiles.shape[2] * 128)[:n, :k]
        s = scale.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
        back = q.double() * s
        return {"weight": q.contiguous(), "weight_scale_inv": scale}, back
    if fmt == "ct":
        scale = (w.double().abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)  # RedHat's: the model's dtype
        q = (w.double() / scale.double()).float().to(FP8)
        return {"weight": q, "weight_scale": scale}, q.double() * scale.double()
    scale_2 = (w.double().abs().amax() / (6 * 448)).float()  # ModelOpt NVFP4: global, then e4m3 per 16
    groups = w.double().view(w.shape[0], -1, 16)
    block = (groups.abs().amax(-1) / 6 / scale_2.double()).float().to(FP8)
    unit = (block.double() * scale_2.double()).unsqueeze(-1)
    x = (groups / unit).clamp(-6, 6)
    code = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1) + 8 * (x < 0)  # nearest e2m1, sign in bit 3
    code = code.view(w.shape[0], -1)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)  # the even element in the low nibble
    values = torch.where(code >= 8, -E2M1[code % 8], E2M1[code % 8]).view_as(groups)
    back = (values * unit).view(w.shape)
    return {"weight": packed, "weight_scale": block, "weight_scale_2": scale_2,
            "input_scale": torch.tensor(0.01)}, back


def write_quantized(plain, out, ref, fmt):
    """``out``: ``plain``'s checkpoint with its projections quantized in ``fmt``; ``ref``: the same model with
    the float64 dequantized weights (float32), for transformers."""
    state = load_file(str(plain / "model.safetensors"))
    quantized, reference = {}, {}
    for name, t in state.items():
        if name.endswith("proj.weight"):
            parts, back = quantize(t, fmt)
            quantized.update({name.removesuffix("weight") + key: v for key, v in parts.items()})
            reference[name] = back.float()
        else:
            quantized[name] = reference[name] = t
    config = json.loads((plain / "config.json").read_text())
    for folder, tensors, extra in ((out, quantized, {"quantization_config": CONFIGS[fmt]}), (ref, reference, {})):
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
    return quantized, reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{(model_type, fmt): (quantized dir, reference dir)}`` for tiny llama and qwen3 models."""
    root, out = tmp_path_factory.mktemp("quant"), {}
    for model_type in ("llama", "qwen3"):
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model(model_type, **BASE, head_dim=32, tie_word_embeddings=False)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / model_type)
        for fmt in CONFIGS:
            quant, ref = root / f"{model_type}-{fmt}", root / f"{model_type}-{fmt}-ref"
            write_quantized(root / model_type, quant, ref, fmt)
            out[model_type, fmt] = quant, ref
    return out


def hf_tokens(folder):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


# -- dequantization ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_dequantization_equals_the_float64_reference_ragged_shapes_too(fmt):
    torch.manual_seed(1)
    shape = (200, 304) if fmt != "nvfp4" else (200, 320)  # fp8: partial edge blocks in both directions
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    parts, back = quantize(w, fmt)
    quant = qf.detect({"quantization_config": CONFIGS[fmt]})
    tensors = {"x.weight": parts["weight"], **{f"x.{k}": v for k, v in parts.items() if k != "weight"}}
    got = qf.dequantize_tensors(tensors, quant)
    assert set(got) == {"x.weight"}  # scales and the activations' input_scale are gone
    torch.testing.assert_close(got["x.weight"].double(), back, rtol=3e-7, atol=0)  # float32 rounding only
    assert (back - w.double()).abs().max() > 0  # the quantization did round: the test sees the format


def test_a_scale_that_is_not_the_block_grid_is_refused_never_broadcast():
    q = torch.randn(256, 384).to(qf.FP8)
    for scale in (torch.ones(1, 1), torch.ones(2, 2), torch.ones(3, 3)):  # the grid of 128x128 blocks is 2 x 3
        with pytest.raises(ValueError, match=r"needs a scale of shape \[\.\.\., 2, 3\]"):
            qf.dequant_fp8_block(q, scale, (128, 128))
    with pytest.raises(ValueError, match="needs one scale"):  # per tensor (no weight_block_size): one value
        qf.dequant_fp8_block(q, torch.ones(2, 3), None)
    assert torch.equal(qf.dequant_fp8_block(q, torch.full((), 2.0), None), q.float() * 2)


def test_detect_reads_the_formats_and_refuses_others_by_name():
    assert qf.detect({}) is None
    # a folder transformers saved from a GGUF file it read (dequantized) still names gguf: its weights are float
    assert qf.detect({"quantization_config": {"quant_method": "gguf"}}) is None
    assert qf.detect({"quantization_config": CONFIGS["fp8"]}).block == (128, 128)
    ct_block = json.loads(json.dumps(CONFIGS["ct"]))
    ct_block["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 128])
    assert qf.detect({"quantization_config": ct_block}).label == "fp8 (block 128x128)"
    modelopt_file = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
    assert qf.detect({}, modelopt_file).method == "nvfp4"
    nvfp4 = qf.detect({"quantization_config": CONFIGS["nvfp4"]})
    assert qf.engine_form(nvfp4, "cuda").startswith("fp8 block 128x128 (converted from nvfp4")
    assert qf.engine_form(nvfp4, "cuda", transformers=True).startswith("dequantized")
    with pytest.raises(qf.UnsupportedQuantization, match="'awq'.*'fp8'"):
        qf.detect({"quantization_config": {"quant_method": "awq", "bits": 4}})
    int4 = json.loads(json.dumps(CONFIGS["ct"]))
    int4["format"] = "pack-quantized"
    with pytest.raises(qf.UnsupportedQuantization, match="pack-quantized.*float-quantized"):
        qf.detect({"quantization_config": int4})


# -- serving on CPU: tokens equal transformers' on the dequantized weights -------------------------------------
@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_llama_checkpoint_serves_transformers_tokens_and_the_banner_names_it(checkpoints, fmt):
    quant_dir, ref_dir = checkpoints["llama", fmt]
    note = checkpoint_note(str(quant_dir), "cpu", torch.float32, False)
    assert note == f", checkpoint {qf.read_quant(quant_dir).label} -> running float32 (dequantized on cpu)"
    assert LABELS[fmt] in note
    config = EngineConfig(mode="eager", max_num_seqs=4, max_num_batched_tokens=64, page_size=8, max_seq_len=64)
    engine = build_engine(str(quant_dir), "cpu", torch.float32, False, config)  # what `piecegraph serve` runs
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW)) == hf_tokens(ref_dir)


def test_the_reference_loader_equals_transformers_own_fp8_dequantization(checkpoints):
    quant_dir, _ = checkpoints["llama", "fp8"]
    ours = load_hf(quant_dir).state_dict()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(quant_dir, dtype=torch.float32).state_dict()
    assert all(torch.equal(t, theirs[n]) for n, t in ours.items())  # bit for bit


@pytest.mark.parametrize("fmt", ["fp8", "ct"])
def test_qwen3_checkpoint_through_piecegraph_hf_gives_transformers_tokens(checkpoints, fmt):
    quant_dir, ref_dir = checkpoints["qwen3", fmt]
    assert "(dequantized on cpu)" in checkpoint_note(str(quant_dir), "cpu", torch.float32, False)
    wrapped = pghf.load(quant_dir, dtype=torch.float32)
    assert pghf.generate(wrapped, PROMPTS, NEW, eos_token_id=[]) == hf_tokens(ref_dir)


def test_unsupported_quantization_is_refused_naming_it(checkpoints, tmp_path):
    import typer

    quant_dir, _ = checkpoints["llama", "fp8"]
    (tmp_path / "model.safetensors").write_bytes((quant_dir / "model.safetensors").read_bytes())
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'gptq'"):
        load_hf(tmp_path)
    with pytest.raises(typer.BadParameter, match="gptq"):
        checkpoint_note(str(tmp_path), "cpu", torch.float32, False)


# -- the FP8-kept load path (what a GPU gets), run on CPU through the torch kernels ----------------------------
@pytest.mark.parametrize("fmt, module", [("fp8", FP8BlockLinear), ("ct", FP8ChannelLinear),
                                         ("nvfp4", FP8BlockLinear)])
def test_fp8_kept_path_stays_fp8_and_stays_close_to_the_dequantized_model(checkpoints, monkeypatch, fmt, module):
    quant_dir, ref_dir = checkpoints["llama", fmt]
    monkeypatch.setattr(qf, "keeps_fp8", lambda device: True)
    model = load_hf(quant_dir, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, module)]
    assert len(linears) == 14 and all(m.weight.dtype == FP8 for m in linears)
    plain = load_hf(ref_dir, dtype=torch.float32)
    assert model.facts().weight_bytes < 0.6 * plain.facts().weight_bytes
    x = torch.randn(10, 128, dtype=torch.float64)
    layer = model.model.layers[0].self_attn.q_proj
    w = plain.model.layers[0].self_attn.q_proj.weight.double()
    if fmt != "nvfp4":  # the checkpoint's own weights: only the activations' e4m3 rounding errs
        bound = (2**-3 + 2**-8) * (x.abs() @ w.abs().t())
        assert ((layer(x.float()).double() - x @ w.t()).abs() <= bound).all()
    ids = torch.tensor(PROMPTS[1])
    from piecegraph.attention import AttentionMetadata, KVCache
    from piecegraph.context import forward_context

    logits = []
    for m in (model, plain):
        cache = KVCache.for_sequences(m.config, 1, 32, backend="torch")
        meta = AttentionMetadata.for_batch(cache, [("a", 0, len(ids))])
        with torch.no_grad(), forward_context(meta):
            logits.append(m.logits(m(ids, meta.positions)))
    rel = ((logits[0] - logits[1]).norm() / logits[1].norm()).item()
    assert rel < 0.15  # e4m3 activations in 14 linears (the layer bound above is the exact check)


@pytest.mark.parametrize("fmt", ["fp8", "ct"])
def test_moe_checkpoint_with_per_expert_keys_and_partial_blocks_through_piecegraph_hf(tmp_path, fmt):
    """Per-expert keys (``experts.3.gate_proj.weight`` + its scale), as published MoE checkpoints name them, and
    expert widths of 192 (a full 128 block then a partial one): the logits equal transformers' on the float64
    dequantization (transformers' own FP8 dequantization reads such blocks as 96 wide: piecegraph's runs)."""
    torch.manual_seed(2)
    config = transformers.AutoConfig.for_model("qwen3_moe", **{**BASE, "intermediate_size": 192}, head_dim=32,
                                               moe_intermediate_size=192, num_experts=4, num_experts_per_tok=2,
                                               decoder_sparse_step=1, mlp_only_layers=[])
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "plain")
    quantized, _ = write_quantized(tmp_path / "plain", tmp_path / "q", tmp_path / "ref", fmt)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in quantized
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    ours = pghf.load(tmp_path / "q", dtype=torch.float32).unwrap()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


def test_block_linear_rows_are_independent_and_it_traces_whole():
    """Pad rows never change a real row (per-token activation scales), and Dynamo traces the layer in one graph
    with the token count dynamic (what the engine's capture needs)."""
    from piecegraph.models.fp8_block import quantize_weight_blocks

    torch.manual_seed(3)
    q, scale = quantize_weight_blocks(torch.randn(200, 300))
    layer = FP8BlockLinear(q, scale, (128, 128), torch.randn(200), torch.float32)
    assert layer.kernel == "torch"  # on the CPU
    x = torch.randn(5, 300)
    padded = torch.cat([x, 1e3 * torch.randn(11, 300)])
    torch.testing.assert_close(layer(padded)[:5], layer(x), rtol=1e-5, atol=1e-4)  # BLAS's sum order only
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="eager")
    torch.testing.assert_close(compiled(padded), layer(padded), rtol=0, atol=0)


def test_transformers_fp8_linears_are_swapped_for_piecegraph_kernels():
    """On a GPU, transformers keeps a block-FP8 checkpoint in its ``FP8Linear``, whose forward fetches a kernel from
    the hub; piecegraph.hf swaps each for an :class:`FP8BlockLinear` on the same tensors (tried here on CPU)."""
    from piecegraph.models.fp8_block import expand_blocks, swap_fp8_linears

    fp8_linear = pytest.importorskip("transformers.integrations.finegrained_fp8").FP8Linear
    torch.manual_seed(4)
    theirs = fp8_linear(300, 200, block_size=(128, 128), has_bias=True)
    parts, back = quantize(torch.randn(200, 300), "fp8")
    with torch.no_grad():
        theirs.weight.copy_(parts["weight"])
        theirs.weight_scale_inv.copy_(parts["weight_scale_inv"])
        theirs.bias.copy_(torch.randn(200))
    model = torch.nn.Sequential(theirs)
    assert swap_fp8_linears(model, torch.float32) == 1
    ours = model[0]
    assert isinstance(ours, FP8BlockLinear) and torch.equal(ours.weight, parts["weight"])
    x = torch.randn(6, 300, dtype=torch.float64)
    w = parts["weight"].double() * expand_blocks(parts["weight_scale_inv"].double(), 200, 300, (128, 128))
    exact = x @ w.t() + theirs.bias.double()
    assert ((ours(x.float()).double() - exact).abs() <= (2**-3 + 2**-8) * (x.abs() @ w.abs().t()) + 1e-6).all()
