"""Tiny random Hugging Face causal LMs the CPU tests build, the prompts they run, and piecegraph's refusal of one.

transformers is imported inside the functions: a test module whose other tests need no transformers imports this
one at its top and still runs them without it.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import transformers_greedy

PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 9, 10, 11], [7, 7, 1, 64, 30]]
NEW = 8
# a Llama-like tiny config's sizes: 2 layers of 4 query and 2 key/value heads of 16
BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)


def skip_unless_known(model_type: str) -> None:
    """Skips the calling test where this transformers has no ``model_type``."""
    import transformers

    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")


def sized_config(model_type: str, **fields):
    """``model_type``'s config of ``fields``, less those its default config does not have (one dict of sizes serves
    types that name them differently)."""
    import transformers

    default = transformers.CONFIG_MAPPING[model_type]()
    return transformers.AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if hasattr(default, k)})


def random_causal_lm(config, init):
    """A float32 causal LM of ``config`` in eval mode, built after ``torch.manual_seed(0)``, then
    ``init(name, param)`` called on each named parameter under ``torch.no_grad`` to draw it anew."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            init(name, param)
    return model


def init_fan_in(name: str, param: torch.Tensor) -> None:
    """An ``init`` of :func:`random_causal_lm`: embeddings (``embed``, GPT-2's ``wte``) ~N(0, 0.01), other
    matrices but norms' ~N(0, 1/fan_in), so that every layer matters; the rest as built."""
    if "embed" in name or "wte" in name:
        param.normal_(0, 0.1)
    elif param.dim() >= 2 and "norm" not in name:
        param.normal_(0, param.shape[-1] ** -0.5)


def init_all_matrices_fan_in(name: str, param: torch.Tensor) -> None:
    """An ``init`` of :func:`random_causal_lm`: embedding matrices ~N(0, 0.01), every other matrix
    ~N(0, 1/fan_in); vectors (norms, biases, 1-d embedding norms) as built."""
    if param.dim() >= 2:
        param.normal_(0, 0.1 if "embed" in name else param.shape[-1] ** -0.5)


def hf_greedy(model) -> list[list[int]]:
    """transformers' greedy tokens (:data:`NEW` of them, cut after an EOS) for each of :data:`PROMPTS`."""
    return [transformers_greedy(model, prompt, NEW) for prompt in PROMPTS]


def refusal(model) -> str:
    """The message piecegraph refuses ``model`` with (the config check, then the wrap); fails if it runs it."""
    import piecegraph.hf as pghf

    with pytest.raises(pghf.UnsupportedModelError) as err:
        pghf.check_supported(model.config)
        pghf.generate(model, PROMPTS, NEW, mode="eager", backend="torch", reuse=False)
    assert not hasattr(model, "_piecegraph_hf"), "a refused model stays wrapped"
    message = str(err.value)
    assert repr(model.config.model_type) in message, message
    return message
