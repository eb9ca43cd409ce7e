"""Block-scaled FP8 MLA checkpoints (DeepSeek-V3's and GLM-5-FP8's layout: e4m3 ``X.weight`` beside a float32
``X.weight_scale_inv`` per 128x128 block, experts per expert): ``load_mla`` dequantizes them, and its greedy tokens
equal those of transformers' model built from the same dequantized weights."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hf_reference import transformers_greedy

from piecegraph.models import generate
from piecegraph.models.mla_loader import load_mla

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 128
PROMPTS = [[(5 * i + 2) % 256 for i in range(20)], [9, 4, 200, 31]]
NEW_TOKENS = 6
# dims below and above 128 (kv_b_proj 2 x 80 = 160 rows, the dense MLP 160 wide): partial edge blocks after full
# ones in both directions, single partial blocks elsewhere
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=64, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=128,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _quantized(name: str) -> bool:
    """DeepSeek-V3's FP8 release quantizes every projection (experts included), not the router, norms,
    embeddings or lm_head."""
    return name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight")


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(e4m3, scale_inv [ceil(N/128), ceil(K/128)], dequantized float32)`` of ``w [N, K]``, each block's largest
    magnitude mapped to 448; written out here, independent of piecegraph's quantizers."""
    n, k = w.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    scale = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    deq = torch.empty(n, k)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q_tile = (tile / scale[i, j]).to(torch.float8_e4m3fn)
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = q_tile
            deq[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = q_tile.float() * scale[i, j]
    return q, scale, deq


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the FP8 folder, the dequantized folder, transformers' model loaded from the dequantized folder)."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # weights large enough that tokens depend on the context
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else
                    torch.randn(p.shape) * p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.02 * torch.randn(p.shape))
    plain = tmp_path_factory.mktemp("float")
    hf.save_pretrained(plain)
    state = safetensors_torch.load_file(plain / "model.safetensors")
    fp8, deq = {}, {}
    for name, t in state.items():
        if _quantized(name):
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"], deq[name] = _quantize(t)
        else:
            fp8[name] = deq[name] = t
    assert any(s.shape == (2, 1) for n, s in fp8.items() if n.endswith("kv_b_proj.weight_scale_inv"))
    folder, reference = tmp_path_factory.mktemp("fp8"), tmp_path_factory.mktemp("dequantized")
    config = json.loads((plain / "config.json").read_text())
    for target, tensors, extra in ((folder, fp8, {"quantization_config": QUANT_CONFIG}), (reference, deq, {})):
        safetensors_torch.save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
        (target / "config.json").write_text(json.dumps({**config, **extra}))
        (target / "generation_config.json").write_text((plain / "generation_config.json").read_text())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    return folder, deq, theirs


def _hf_greedy(hf, prompt):
    return transformers_greedy(hf, prompt, NEW_TOKENS, pad_token_id=0)


def test_fp8_block_checkpoint_loads_dequantized_with_transformers_greedy_tokens(folders, caplog):
    folder, deq, theirs = folders
    with caplog.at_level("INFO", logger="piecegraph.models"):
        model = load_mla(folder)
    assert "checkpoint fp8 (block 128x128) dequantized to torch.float32" in caplog.text
    attn = model.model.layers[0].self_attn
    assert torch.equal(attn.kv_b_proj.weight, deq["model.layers.0.self_attn.kv_b_proj.weight"])
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(experts.down_proj[3], deq["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    ours = generate(model, PROMPTS, NEW_TOKENS, eos_token_id=theirs.generation_config.eos_token_id)
    assert ours == [_hf_greedy(theirs, p) for p in PROMPTS]


def test_fp8_block_checkpoint_in_bfloat16_rounds_the_dequantized_weights_once(folders):
    folder, deq, _ = folders
    model = load_mla(folder, dtype=torch.bfloat16)
    name = "model.layers.0.mlp.gate_proj.weight"
    assert torch.equal(model.get_parameter(name), deq[name].to(torch.bfloat16))
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays float32


def test_serve_banner_says_an_fp8_mla_folder_runs_dequantized_on_every_device(folders):
    from piecegraph.server.command import checkpoint_note

    for device in ("cpu", "cuda"):  # the MLA loader dequantizes on a GPU too: the banner must not claim fp8 kept
        note = checkpoint_note(str(folders[0]), device, torch.bfloat16, False)
        assert "checkpoint fp8 (block 128x128) -> running bf16 (dequantized" in note, (device, note)


def test_fp8_checkpoint_with_a_misfit_scale_names_the_weight(folders, tmp_path):
    folder, _, _ = folders
    tensors = safetensors_torch.load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"] = torch.ones(3, 1)  # 160 rows: 2 blocks
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.kv_b_proj\.weight: .*scale of shape"):
        load_mla(tmp_path)


def test_piecegraph_hf_load_of_the_fp8_folder_generates_the_same_tokens(folders):
    """``piecegraph.hf.load`` dequantizes the folder itself (transformers' own dequantization reads the grid's
    ragged edge blocks wrongly) and runs the engine's MLA decoder on the result."""
    import piecegraph.hf
    from piecegraph.hf.mla import MLAHFDecoder

    folder, _, theirs = folders
    model = piecegraph.hf.load(folder)
    assert isinstance(model, MLAHFDecoder)
    want = [_hf_greedy(theirs, p) for p in PROMPTS]
    assert piecegraph.hf.generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, reuse=False) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_fp8_block_checkpoint_on_the_gpu_runs_dequantized_in_bf16_near_transformers(folders, caplog):
    """On CUDA the MLA loader dequantizes too (one warning says so); prefill logits as near transformers' float32
    model of the dequantized weights as that model run in bf16 is (twice its error, plus 2%)."""
    from piecegraph.attention import AttentionMetadata, KVCache
    from piecegraph.context import forward_context

    folder, deq, theirs = folders
    with caplog.at_level("WARNING", logger="piecegraph.models"):
        model = load_mla(folder, dtype=torch.bfloat16, device="cuda")
    assert "dequantized to torch.bfloat16" in caplog.text
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    assert torch.equal(model.get_parameter(name).cpu(), deq[name].to(torch.bfloat16))
    ids = torch.tensor(PROMPTS[0], device="cuda")
    cache = KVCache.for_sequences(model.config, 1, len(ids), dtype=torch.bfloat16, device="cuda")
    meta = AttentionMetadata.for_batch(cache, [("a", 0, len(ids))])
    with forward_context(meta):
        ours = model.logits(model(ids, meta.positions)).float().cpu()
    want = theirs(ids[None].cpu()).logits[0]
    rounded = copy.deepcopy(theirs).to("cuda", torch.bfloat16)(ids[None]).logits[0].float().cpu()
    ours_err, their_err = (((t - want).norm() / want.norm()).item() for t in (ours, rounded))
    assert ours_err <= 2 * their_err + 2e-2, (ours_err, their_err)  # as near as transformers' own bf16 forward
