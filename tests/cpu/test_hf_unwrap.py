"""Hugging Face models are left as they were: ``piecegraph.hf.unwrap`` undoes every change wrapping made, and while
wrapped the model's own forward, ``generate`` and ``generate_batch`` (transformers' continuous batching) give what
an untouched copy gives. Tiny random Llama / Qwen2 configs, float32 on CPU; every reference is transformers' own
output on a deep copy of the model taken before the wrap.
"""

import copy
import gc

import pytest
import torch

transformers = pytest.importorskip("transformers")

import piecegraph  # noqa: E402
import piecegraph.hf as pghf  # noqa: E402
from piecegraph.attention import AttentionMetadata, KVCache  # noqa: E402
from piecegraph.hf import attention as hf_attention  # noqa: E402

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.1, max_position_embeddings=256)
PROMPTS = [[5, 17, 3, 99, 42, 7], [7, 7, 1]]
NEW = 6
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def tiny(model_type, attn=None, seed=0):
    """A random model as tests/cpu/test_hf.py builds them, in training mode (as ``from_config`` leaves it)."""
    config = transformers.AutoConfig.for_model(model_type, **BASE)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn} if attn else {}
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    with torch.no_grad():  # projections ~ N(0, 1/fan_in): each layer matters, so greedy tokens depend on context
        for name, param in model.named_parameters():
            if "proj" in name and param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
            elif "embed" in name:
                param.normal_(0, 0.1)
    return model


def snapshot(model):
    """Everything of ``model`` wrapping could change, as plain values: its config (and sub-configs), each module's
    type, mode, attributes, hooks and config object."""
    config = model.config
    subs = {key: getattr(config, key)._attn_implementation for key in config.sub_configs if getattr(config, key)}
    modules = [(name, type(m), m.training, sorted(vars(m)), sum(len(getattr(m, h, {})) for h in _HOOKS),
                getattr(m, "config", config) is config) for name, m in model.named_modules()]
    return {"config": config.to_dict(), "attn": config._attn_implementation, "subs": subs, "modules": modules}


def registry():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return sorted(ALL_ATTENTION_FUNCTIONS.valid_keys()), sorted(ALL_MASK_ATTENTION_FUNCTIONS.valid_keys())


def hf_logits(model, prompt):
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def hf_generate(model):
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=-1,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def batch_tokens(model):
    """Greedy tokens of transformers' continuous batching (``generate_batch``): a small paged cache, no warmup."""
    gen = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = transformers.ContinuousBatchingConfig(page_size=16, num_blocks=8, max_batch_tokens=64,
                                               max_requests_per_batch=2)
    with torch.no_grad():
        out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cb, warmup=False)
    return [out[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]


def flat_logits(decoder, prompt):
    """piecegraph's flat forward of one prompt on a fresh paged cache."""
    cache = KVCache.for_sequences(decoder.config, 1, 32, page_size=4, backend="torch")
    meta = AttentionMetadata.for_batch(cache, [("a", 0, len(prompt))])
    with torch.no_grad(), piecegraph.forward_context(meta):
        return decoder.logits(decoder(torch.tensor(prompt), meta.positions))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_unwrap_leaves_the_model_as_it_was(model_type):
    model = tiny(model_type)
    model.model.layers[1].eval()  # one module in eval mode under training ones: each flag comes back as it was
    reference = copy.deepcopy(model)
    gc.collect()  # models other tests left wrapped are garbage: their wraps are not live
    before, registered_before = snapshot(model), registry()
    graphed = piecegraph.compile(model, mode="none", compiler="eager")
    decoder = graphed.model
    again = pghf.HFDecoder(model)  # wrapping the same model again joins the wrap
    assert decoder.owns_wrap and not again.owns_wrap and decoder.wrapped and again.wrapped
    assert not model.training and model.config.to_dict() == before["config"]
    assert model.config._attn_implementation == before["attn"] == "sdpa"  # the config never names "piecegraph"
    assert rel(flat_logits(again, PROMPTS[0]), hf_logits(reference, PROMPTS[0])) < 1e-5
    expected = hf_generate(reference)
    assert hf_generate(model) == expected  # its own generate while wrapped (the reference trains: no dropout here)

    assert pghf.unwrap(graphed) is model
    assert snapshot(model) == before
    assert pghf.unwrap(model) is model and again.unwrap() is model and decoder.unwrap() is model  # idempotent
    assert snapshot(model) == before
    if not hf_attention._users:  # "piecegraph" unregistered with the last wrapped model (another test may have left
        # it registered, its model garbage now): transformers' registries as they were without it
        assert registry() == ([k for k in registered_before[0] if k != "piecegraph"], registered_before[1])
    for prompt in PROMPTS:
        assert torch.equal(hf_logits(model, prompt), hf_logits(reference, prompt))
    assert hf_generate(model) == expected


@pytest.mark.parametrize("model_type, attn", [("qwen2", "sdpa"), ("llama", "eager")])
def test_generate_batch_works_while_wrapped_and_after_unwrap(model_type, attn):
    # "eager": continuous batching switches the model to "paged|eager" and back, through set_attn_implementation.
    model = tiny(model_type, attn).eval()
    reference = copy.deepcopy(model)
    expected = batch_tokens(reference)
    assert expected == hf_generate(reference)  # the reference itself: continuous batching is greedy decoding
    before = snapshot(model)
    with pghf.HFDecoder(model) as decoder:
        assert batch_tokens(model) == expected
        assert model.config._attn_implementation == attn
        assert rel(flat_logits(decoder, PROMPTS[0]), hf_logits(reference, PROMPTS[0])) < 1e-5
    assert snapshot(model) == before
    assert batch_tokens(model) == expected


def test_with_blocks_joined_wraps_and_refusals():
    model = tiny("llama").eval()
    want = hf_logits(copy.deepcopy(model), PROMPTS[1])
    before = snapshot(model)
    outer = pghf.HFDecoder(model)
    with pghf.HFDecoder(model) as inner:
        assert rel(flat_logits(inner, PROMPTS[1]), want) < 1e-5
    assert not inner.owns_wrap and inner.wrapped and outer.wrapped  # it leaves the wrap it joined as it found it
    with outer:
        pass
    assert not outer.wrapped and not inner.wrapped and snapshot(model) == before
    for decoder in (outer, inner):
        with pytest.raises(RuntimeError, match=r"was unwrapped .*piecegraph\.hf\.HFDecoder\(model\)"):
            flat_logits(decoder, PROMPTS[1])
    outer.close()
    outer.unwrap()
    assert snapshot(model) == before

    again = pghf.HFDecoder(model)  # wrapped again: flat again
    assert rel(flat_logits(again, PROMPTS[1]), want) < 1e-5
    model.model.layers[0].self_attn.config = model.config  # the view replaced: refused, not Hugging Face's attention
    with pytest.raises(RuntimeError, match="LlamaAttention was replaced since the wrap"):
        flat_logits(again, PROMPTS[1])
    pghf.unwrap(model)
    assert snapshot(model) == before


def test_set_attn_implementation_while_wrapped_reaches_the_models_own_forward_only():
    model = tiny("qwen2").eval()
    reference = copy.deepcopy(model)
    decoder = pghf.HFDecoder(model)
    model.set_attn_implementation("eager")
    reference.set_attn_implementation("eager")
    assert torch.equal(hf_logits(model, PROMPTS[0]), hf_logits(reference, PROMPTS[0]))
    assert rel(flat_logits(decoder, PROMPTS[0]), hf_logits(reference, PROMPTS[0])) < 1e-5  # still piecegraph's
    model.set_attn_implementation("piecegraph")  # registered while a model is wrapped, but not one to select
    with pytest.raises(ValueError, match="'piecegraph', which is piecegraph.hf's own"):
        hf_logits(model, PROMPTS[0])
    model.set_attn_implementation("eager")
    pghf.unwrap(model)
    assert snapshot(model) == snapshot(reference)


def test_a_copy_of_a_wrapped_model_is_wrapped_on_its_own():
    model = tiny("llama").eval()
    before = snapshot(model)
    decoder = pghf.HFDecoder(model)
    twin = copy.deepcopy(model)
    attn = twin.model.layers[0].self_attn
    assert hf_attention.is_view(attn.config) and attn.config.piecegraph_config is twin.config
    pghf.unwrap(decoder)
    assert hf_attention.registered()  # the copy still uses "piecegraph"
    assert torch.equal(hf_logits(twin, PROMPTS[0]), hf_logits(model, PROMPTS[0]))
    pghf.unwrap(twin)
    assert attn.config is twin.config and snapshot(twin) == snapshot(model) == before


def test_hf_generate_and_a_closed_session_leave_the_model_as_it_was():
    model = tiny("qwen2")
    before, names = snapshot(model), registry()
    reference = copy.deepcopy(model).eval()
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]
    assert pghf.generate(model, PROMPTS, NEW, mode="none", compiler="eager", backend="torch", reuse=False) == expected
    assert snapshot(model) == before and registry() == names
    # kept for the next call (the default): the same, but for the one attribute holding the session
    assert pghf.generate(model, PROMPTS, NEW, mode="none", compiler="eager", backend="torch") == expected
    assert registry() == names and "_piecegraph_session" in vars(model)
    pghf.reuse.forget(model)
    assert snapshot(model) == before
    already = pghf.HFDecoder(model)  # a wrap the caller made stays: the session only joined it
    with pghf.Session(already, max_seqs=2, max_len=32, mode="eager", backend="torch") as session:
        assert session.generate(PROMPTS, NEW) == expected
    assert already.wrapped
    with pytest.raises(RuntimeError, match="Session was closed"):
        session.generate(PROMPTS, NEW)
    already.unwrap()
    assert snapshot(model)["config"] == before["config"]
