"""Causal LMs laid out otherwise than ``model.model.layers[i].self_attn`` run exactly, found by structure.

GPT-2 (``transformer.h``, ``attn``, Conv1D, learned absolute positions), OPT (``model.decoder.layers``, scaling
in the query projection), GPT-NeoX (``gpt_neox.layers``, ``attention``, partial rotary, parallel residual),
Falcon (parallel attention and MLP, multi-query), BERT as a decoder (``bert.encoder.layer``, ``attention.self``,
an output head of its own: ``cls``), ELECTRA and ModernBERT (output heads in two modules) and BioGPT
(``output_projection``): each gives transformers' exact greedy tokens through ``piecegraph.hf.generate``. ALiBi
models are refused naming ALiBi, whether the config switches it on (Falcon, MPT) or the modeling code always adds
it (BLOOM); a layout whose layers hold no attention module of transformers' kind (GPT-Neo) is refused naming that.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import transformers_greedy  # noqa: E402

import piecegraph.hf as pghf  # noqa: E402
from piecegraph.hf.arch import decoder_layers, layer_attention, output_head_names  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11], [7, 7, 1, 64]]
NEW = 8
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, n_inner=128,
             ffn_dim=128, ffn_hidden_size=128, rotary_dim=8, is_decoder=True)
# model_type -> (where its decoder layers are, its attention module's attribute in a layer, output head)
LAYOUTS = {
    "gpt2": ("transformer.h", "attn", ("lm_head",)),
    "opt": ("model.decoder.layers", "self_attn", ("lm_head",)),
    "gpt_neox": ("gpt_neox.layers", "attention", ("lm_head",)),
    "falcon": ("transformer.h", "self_attention", ("lm_head",)),
    "bert": ("bert.encoder.layer", "attention.self", ("cls",)),
    "electra": ("electra.encoder.layer", "attention.self", ("generator_predictions", "generator_lm_head")),
    "biogpt": ("biogpt.layers", "self_attn", ("output_projection",)),
    "modernbert-decoder": ("model.layers", "attn", ("lm_head", "decoder")),
}


def tiny(model_type, **fields):
    """A float32 tiny random ``model_type`` whose projections are ~N(0, 1/fan_in), so that greedy tokens depend
    on every layer and on the context."""
    default = transformers.CONFIG_MAPPING[model_type]()
    sizes = {k: v for k, v in SIZES.items() if hasattr(default, k)}
    config = transformers.AutoConfig.for_model(model_type, **sizes, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed" in name or "wte" in name or "wpe" in name:
                param.normal_(0, 0.1)
            elif param.dim() >= 2 and "norm" not in name:
                param.normal_(0, param.shape[-1] ** -0.5)
    return model


def hf_greedy(model, prompt):
    return transformers_greedy(model, prompt, NEW)


@pytest.mark.parametrize("model_type", list(LAYOUTS))
def test_layout_is_found_and_runs_with_transformers_greedy_tokens(model_type):
    model = tiny(model_type)
    where, attn, head = LAYOUTS[model_type]
    layers = model.get_submodule(where)
    assert decoder_layers(model) == list(layers)
    assert all(layer_attention(layer) is layer.get_submodule(attn) for layer in layers)
    assert output_head_names(model) == head
    expected = [hf_greedy(model, p) for p in PROMPTS]
    got = pghf.generate(model, PROMPTS, NEW, mode="eager", backend="torch", reuse=False)
    assert got == expected
    assert not hasattr(model, "_piecegraph_hf")  # given back as it was


@pytest.mark.parametrize("model_type, fields, says", [
    ("falcon", dict(alibi=True), "ALiBi"),  # BLOOM's and MPT's run: tests/cpu/test_hf_alibi.py
    ("xlm", {}, "no causal attention module"),  # GPT-Neo's and GPT-1's are adapted
])
def test_alibi_and_hand_written_attention_are_refused_naming_it(model_type, fields, says):
    model = tiny(model_type, **fields)
    with pytest.raises(pghf.UnsupportedModelError, match=says) as err:
        pghf.generate(model, PROMPTS, NEW, mode="eager", backend="torch", reuse=False)
    assert repr(model_type) in str(err.value)
    assert not hasattr(model, "_piecegraph_hf")


def test_a_layout_that_passes_the_structure_check_but_differs_is_refused_by_the_probe():
    """A RoBERTa whose embeddings number positions from the padding index on whatever position ids they are given
    (transformers' generate passes them from 0, which piecegraph's positions equal for an unchanged RoBERTa): the
    numeric self-check sees the first layer differ and refuses (never runs it wrong)."""
    model = tiny("roberta")
    model.roberta.embeddings.register_forward_pre_hook(
        lambda module, args, kwargs: (args, {**kwargs, "position_ids": None}), with_kwargs=True)
    assert decoder_layers(model)  # found, with its attention
    verdict = pghf.verify(model, raise_on_failure=False)
    assert not verdict.ok and verdict.layer == 0 and "'roberta'" in verdict.reason, verdict.reason


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gpt2", "bert"])
def test_layouts_run_with_compiled_pieces_and_emulated_graphs(model_type):
    """Piecewise prefill and full-graph decode (emulated on CPU) through the base model found by structure."""
    model = tiny(model_type)
    expected = [hf_greedy(model, p) for p in PROMPTS]
    got = pghf.generate(model, PROMPTS, NEW, mode="graphs", emulate_graphs=True, compiler="eager",
                        prefill_tokens=32, backend="torch", reuse=False)
    assert got == expected


def test_an_output_head_found_short_is_refused_by_the_probe():
    """ModernBERT's logits come from ``lm_head`` (a transform) and then ``decoder``: a wrapper that took
    ``lm_head`` alone would give logits of another width, which the self-check refuses instead of failing."""
    model = tiny("modernbert-decoder")
    with pghf.HFDecoder(model, verify=False) as decoder:
        decoder.head_names = ("lm_head",)
        verdict = pghf.verify(decoder, raise_on_failure=False)
    assert not verdict.ok and "output head" in verdict.reason and "'modernbert-decoder'" in verdict.reason


def test_tensor_parallel_refuses_a_gpt2_layout_naming_it():
    """apply_tp shards Llama-style modules only: a GPT-2 layout (transformer.wte, transformer.h) is refused with a
    ValueError naming the layout, before any process group is asked for."""
    from piecegraph.parallel import apply_tp

    decoder = pghf.wrap(tiny("gpt2"), verify=False)
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no embed_tokens and layers"):
        apply_tp(decoder, "tp")
