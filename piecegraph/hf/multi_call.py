"""Attention modules called more than once per forward, each call on a cache layer of its own.

Some Hugging Face decoders call transformers' attention interface several times from one attention module in one
forward: differential attention (``diffllama``, and the like) calls it twice, with the same queries and keys but
the two halves of the values; a looped model (``dory``'s recurrent section, ``recurrent_kv_cache_mode="per_loop"``)
runs the same decoder layers once per loop, each loop attending over its own keys and values. Each such call
keeps keys and values of its own, so each gets a cache layer of its own: the first call of a module keeps the
module's ``layer_idx``, later calls get layers appended after the model's ``num_hidden_layers`` (as transformers'
own caches of these models append theirs), in the order the calls first come.

:func:`discover` counts the calls in one flat forward of one token on a throwaway cache; :func:`assign` gives the
modules their cache layers (instance attributes, undone with the wrap's other attributes); :func:`cache_layer`
is what the attention function asks for each call, counting the module's calls since :func:`reset` (called at the
start of every flat forward). The count is plain Python state read and written where the forward is traced:
Dynamo traces the forward once, with calls in a fixed order, so each traced attention call holds its cache layer
as a constant. Whether the calls computed this way are what the model computes is the numeric self-check's
verdict (:mod:`piecegraph.hf.probe`): a model whose calls should share a layer would be refused there, not run.
"""

from __future__ import annotations

from typing import Any

import torch

from piecegraph.attention.kv_cache import KVCache
from piecegraph.attention.metadata import AttentionMetadata
from piecegraph.context import forward_context

LAYERS = "piecegraph_cache_layers"  # on a module called more than once: the cache layer of its k-th call
CALLS = "piecegraph_calls"  # on the same module: [calls made since the flat forward began]


@torch.no_grad()
def discover(decoder: Any, attention_name: str) -> dict[torch.nn.Module, int]:
    """How many times each attention module calls the attention function registered as ``attention_name`` in
    one flat forward of ``decoder`` (a wrapped :class:`~piecegraph.hf.HFDecoder`): one token on a throwaway
    one-sequence cache of ``decoder.config`` (torch backend); the outputs are discarded. Modules called once are
    left out. A forward that fails returns ``{}`` (the self-check then names the failure)."""
    from transformers import AttentionInterface

    param = next(decoder.hf.parameters())
    mapping = AttentionInterface._global_mapping
    own = mapping[attention_name]
    counts: dict[torch.nn.Module, int] = {}

    def counting(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        counts[module] = counts.get(module, 0) + 1
        return own(module, *args, **kwargs)

    cache = KVCache.for_sequences(decoder.config, 1, 1, 1, dtype=param.dtype, device=param.device, backend="torch")
    meta = AttentionMetadata.for_batch(cache, [(0, 0, 1)])
    mapping[attention_name] = counting
    try:
        with forward_context(meta):
            decoder(torch.zeros(1, dtype=torch.int64, device=param.device), meta.positions)
    except Exception:  # noqa: BLE001  (the self-check runs the model again and names what fails)
        return {}
    finally:
        mapping[attention_name] = own
    return {module: n for module, n in counts.items() if n > 1 and isinstance(getattr(module, "layer_idx", None), int)}


def assign(counts: dict[torch.nn.Module, int], num_layers: int) -> tuple[int, list[tuple[torch.nn.Module, dict]]]:
    """Give each module of ``counts`` (module -> calls per forward) its cache layers: its ``layer_idx`` for the
    first call, then ``num_layers``, ``num_layers + 1``, ... in order. Returns the number of cache layers and
    ``(module, attributes set)`` per module, for :func:`piecegraph.hf.families.unadapt` to remove."""
    done, next_layer = [], num_layers
    for module, calls in counts.items():
        layers = (int(module.layer_idx), *range(next_layer, next_layer + calls - 1))
        next_layer += calls - 1
        values = {LAYERS: layers, CALLS: [0]}
        module.__dict__.update(values)  # plain instance attributes: no parameter or submodule is added
        done.append((module, values))
    return next_layer, done


def install(decoder: Any, attention_name: str) -> tuple[int, tuple[torch.nn.Module, ...], list]:
    """Find and assign the cache layers of ``decoder``'s attention modules called more than once per forward
    (:func:`discover`, :func:`assign`; a model wrapped already keeps the layers its wrap assigned). Returns the
    number of cache layers the model needs, the modules called more than once (for :func:`reset`) and the
    ``(module, attributes set)`` newly set, which the wrap removes when undone."""
    model, layers = decoder.hf, decoder.config.num_layers
    kept = tuple(m for m in model.modules() if getattr(m, LAYERS, None) is not None)
    if kept:
        return max(layers, 1 + max(max(getattr(m, LAYERS)) for m in kept)), kept, []
    total, done = assign(discover(decoder, attention_name), layers)
    return total, tuple(m for m, _ in done), done


def calls_per_layer(decoder: Any, layers: list[torch.nn.Module]) -> list[int]:
    """Per decoder layer of ``layers``, the attention calls one flat forward of ``decoder`` makes in it: one, plus
    one per further call of a module inside it that is called more than once (:func:`assign`)."""
    multi = getattr(decoder, "_multi_calls", ())
    return [1 + sum(len(getattr(m, LAYERS)) - 1 for m in multi if any(m is x for x in layer.modules()))
            for layer in layers]


def reset(modules: tuple[torch.nn.Module, ...]) -> None:
    """Start a forward: the call count of every module of ``modules`` back to 0."""
    for module in modules:
        calls = getattr(module, CALLS, None)
        if calls is not None:
            calls[0] = 0


def cache_layer(module: torch.nn.Module) -> int:
    """The cache layer of this call of ``module``: its ``layer_idx``, or for a module called more than once per
    forward (:func:`assign`), the layer of its next call in this forward."""
    layers = getattr(module, LAYERS, None)
    if layers is None:
        return module.layer_idx
    calls = getattr(module, CALLS)
    k = calls[0]
    calls[0] = (k + 1) % len(layers)
    return layers[k % len(layers)]
