"""Which Hugging Face causal LMs piecegraph runs is decided by evidence, never by name.

Tiny random configs of many transformers causal-LM types (float32, CPU, 2 layers): each is either run with
transformers' exact greedy tokens (``model.generate``, greedy, same ``max_new_tokens``) or refused at wrap time
with a message naming its model type: never run with different tokens. The types piecegraph ran before and the
ones the old name list refused though they work must run; the numeric self-check refuses a computation that
differs (naming the first layer that differs), is paid once per model, can be switched off, and
``piecegraph doctor --model PATH`` prints the same verdict.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import transformers_greedy  # noqa: E402

import piecegraph.hf as pghf  # noqa: E402
import piecegraph.hf.attention as hf_attention  # noqa: E402
import piecegraph.hf.probe as probe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=64, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
# model_type -> what its tiny config needs beyond BASE and MOE (fields its config does not have are dropped).
RAN_BEFORE = {  # the old name list: must still run
    "llama": {}, "mistral": dict(sliding_window=6), "qwen2": {}, "qwen3": {}, "gemma": {},
    "gemma2": dict(query_pre_attn_scalar=8, sliding_window=5, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0),
    "gemma3_text": dict(query_pre_attn_scalar=32, sliding_window=5), "qwen2_moe": {},
    "mixtral": dict(sliding_window=7),
}
NAME_LIST_REFUSED = {  # refused by the old name list though piecegraph computes them exactly: must run
    "granite": dict(logits_scaling=4.0), "granitemoe": {}, "granitemoeshared": {}, "cohere": {},
    "cohere2": dict(sliding_window=5), "phi3": {}, "phi": {}, "starcoder2": dict(sliding_window=6), "glm": {},
    "glm4": {}, "glm4_moe": {},
    "qwen3_moe": {}, "ernie4_5": {}, "ernie4_5_moe": {}, "exaone4": dict(sliding_window=5), "smollm3": {},
    "olmo": {}, "olmo2": {}, "olmo3": dict(sliding_window=5), "olmoe": {}, "seed_oss": {}, "helium": {},
    "hunyuan_v1_dense": {}, "hunyuan_v1_moe": {}, "dots1": {}, "minimax_m2": {}, "apertus": {}, "arcee": {},
    "bitnet": {}, "internlm3": {}, "jais2": {}, "ministral": {}, "phimoe": {}, "vaultgemma": {}, "cwm": {},
    "nanochat": {}, "exaone": {}, "flex_olmo": {},
}
MADE_RIGHT = {  # partial rotary; decoder layers that do not pass keyword arguments on to attention: must run
    "stablelm": {}, "nemotron": {}, "persimmon": {}, "lfm2": {},
}
OTHERS = {  # run exactly or refused, never run wrong: differential or dynamic-mask attention, attention sinks,
    # latent attention, chunked attention, hybrid recurrent layers, other layouts, multimodal wrappers
    "diffllama": {}, "doge": {}, "gpt_oss": {},
    "deepseek_v2": dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "llama4_text": {}, "qwen3_next": {}, "falcon_h1": {}, "jamba": {}, "gpt2": {}, "gemma3": {},
}
ARCHS = {**RAN_BEFORE, **NAME_LIST_REFUSED, **MADE_RIGHT, **OTHERS}
MUST_RUN = {**RAN_BEFORE, **NAME_LIST_REFUSED, **MADE_RIGHT}
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11], [7, 7, 1]]
NEW = 8


def tiny_config(model_type):
    """The tiny config of ``model_type`` (skips a type this transformers lacks or cannot configure so)."""
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    default = transformers.CONFIG_MAPPING[model_type]()
    try:
        fields = {k: v for k, v in {**BASE, **MOE}.items() if hasattr(default, k)}
        return transformers.AutoConfig.for_model(model_type, **fields, **ARCHS.get(model_type, {}))
    except Exception as err:  # noqa: BLE001  (a config this harness cannot make tiny: not piecegraph's concern)
        pytest.skip(f"{model_type!r}: no tiny config here ({type(err).__name__}: {str(err)[:120]})")


def tiny(model_type, seed=0):
    """A float32 tiny random model of ``model_type`` (skips a type this transformers cannot build so)."""
    config = tiny_config(model_type)
    try:
        with torch.device("meta"):
            size = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        if size > 4e6:
            pytest.skip(f"{model_type!r}: its tiny config still has {size / 1e6:.0f}M parameters")
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    except Exception as err:  # noqa: BLE001  (as above)
        pytest.skip(f"{model_type!r}: no tiny model here ({type(err).__name__}: {str(err)[:120]})")
    with torch.no_grad():  # projections ~ N(0, 1/fan_in): every layer matters, so greedy tokens depend on context
        for name, param in model.named_parameters():
            if "proj" in name and param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
            elif "embed" in name:
                param.normal_(0, 0.02 if "gemma" in model_type else 0.1)
    return model


def hf_greedy(model, prompt):
    return transformers_greedy(model, prompt, NEW)


def run_or_refuse(model_type, mode="eager", **options):
    """``"equal"`` when piecegraph's greedy tokens equal transformers', or the refusal's message; fails the test
    when piecegraph runs the model with different tokens."""
    try:  # what the config alone shows is refused before any weights exist (as piecegraph.hf.load does)
        pghf.check_supported(tiny_config(model_type))
    except pghf.UnsupportedModelError as err:
        assert repr(model_type) in str(err), str(err)
        return str(err)
    model = tiny(model_type)
    try:
        decoder = pghf.HFDecoder(model)
    except pghf.UnsupportedModelError as err:
        assert repr(model_type) in str(err), str(err)
        assert not hasattr(model, "_piecegraph_hf"), "a refused model stays wrapped"
        return str(err)
    expected = [hf_greedy(model, p) for p in PROMPTS]
    with decoder:
        got = pghf.generate(decoder, PROMPTS, NEW, mode=mode, backend="torch", **options)
    assert got == expected, f"{model_type}: piecegraph ran it with other tokens than transformers"
    return "equal"


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_each_type_runs_exactly_or_is_refused_naming_it(model_type):
    outcome = run_or_refuse(model_type)
    if model_type in MUST_RUN:
        assert outcome == "equal", outcome


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["granite", "cohere", "phi3", "starcoder2", "glm4", "qwen3_moe", "olmo2",
                                        "stablelm", "nemotron"])
def test_types_the_name_list_refused_run_compiled_too(model_type):
    assert run_or_refuse(model_type, mode="none", compiler="eager", prefill_tokens=32) == "equal"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["stablelm", "nemotron"])
def test_layers_that_drop_keyword_arguments_run_with_emulated_graphs(model_type):
    """Piecewise prefill and full-graph decode (emulated on CPU) of layers reached through the placeholder mask."""
    assert run_or_refuse(model_type, mode="graphs", emulate_graphs=True, compiler="eager",
                         prefill_tokens=32) == "equal"


def test_refusals_name_the_feature():
    """Refused before any weights: a linear-attention hybrid, a multimodal wrapper. Attention called twice per
    layer (DiffLlama: tests/cpu/test_hf_diff_attention.py) and attention sinks (gpt_oss's ``s_aux``:
    tests/cpu/test_attention_sinks.py) run and pass the probe."""
    assert "linear_attention" in run_or_refuse("qwen3_next") and "multimodal" in run_or_refuse("gemma3")
    assert pghf.verify(tiny("diffllama")).ok
    assert pghf.verify(tiny("gpt_oss")).ok
    # multi-head latent attention runs on piecegraph's MLA decoder (tests/cpu/test_mla_models.py), checked by its
    # own probe against the model's forward
    assert pghf.verify(tiny("deepseek_v2"), raise_on_failure=False).ok


def _break(monkeypatch, which="scale"):
    """piecegraph's attention computing something else than the model: a softmax scale 1.5x the model's, no
    sliding window, or no logit softcap."""
    real = hf_attention._constants

    def wrong(module, args, kwargs):
        scale, window, softcap = real(module, args, kwargs)
        return {"scale": (scale * 1.5, window, softcap), "window": (scale, -1, softcap),
                "softcap": (scale, window, 0.0)}[which]

    monkeypatch.setattr(hf_attention, "_constants", wrong)


@pytest.mark.parametrize("model_type, which", [("llama", "scale"), ("mistral", "window"), ("gemma2", "softcap"),
                                               ("gemma3_text", "window")])
def test_a_differing_computation_is_refused_naming_the_first_layer(monkeypatch, model_type, which):
    model = tiny(model_type)
    layer = type(model.model.layers[0]).__name__
    _break(monkeypatch, which)
    with pytest.raises(pghf.UnsupportedModelError, match=rf"'{model_type}'.*decoder layer 0 \({layer}\).*"
                                                         r"relative error [0-9.e-]+, largest absolute"):
        pghf.HFDecoder(model)
    assert not hasattr(model, "_piecegraph_hf") and not hf_attention.is_view(model.model.layers[0].self_attn.config)
    monkeypatch.undo()
    verdict = pghf.verify(model, raise_on_failure=False)  # the verdict is this instance's, reached once
    assert not verdict.ok and verdict.layer == 0 and verdict.layer_error > probe.TOLERANCE[torch.float32]
    assert pghf.verify(tiny(model_type)).ok  # another instance is checked afresh


def test_the_check_is_paid_once_per_model_and_can_be_switched_off(monkeypatch):
    runs = []
    real = probe._run
    monkeypatch.setattr(probe, "_run", lambda decoder: runs.append(1) or real(decoder))
    model = tiny("qwen2")
    for _ in range(3):
        pghf.HFDecoder(model).close()
    assert len(runs) == 1 and pghf.verify(model).ok and len(runs) == 1
    other = tiny("qwen2", seed=1)
    pghf.HFDecoder(other, verify=False).close()
    monkeypatch.setenv(probe.ENV, "0")
    pghf.HFDecoder(other).close()
    assert len(runs) == 1
    monkeypatch.delenv(probe.ENV)
    pghf.HFDecoder(other).close()
    assert len(runs) == 2


def test_doctor_model_prints_the_verdict(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from piecegraph.cli import app

    runner = CliRunner()
    tiny("qwen3").save_pretrained(tmp_path / "good")
    result = runner.invoke(app, ["doctor", "--model", str(tmp_path / "good")])
    assert result.exit_code == 0 and "supported: model_type 'qwen3'" in result.output, result.output
    _break(monkeypatch)
    result = runner.invoke(app, ["doctor", "--model", str(tmp_path / "good"), "--dtype", "float32"])
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and "refused: model_type 'qwen3'" in said and "decoder layer 0" in said, said
    result = runner.invoke(app, ["doctor", "--model", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "config.json" in result.output
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 2 and "--model" in result.output
