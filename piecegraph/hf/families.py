"""What a few Hugging Face model families need beyond the generic path of :mod:`piecegraph.hf`: why a layer kind
piecegraph's paged attention does not run is refused (named in the refusal), and JetMoE's mixture-of-attention
heads, whose keys come tiled over their query heads, turned into plain grouped-query attention.

Everything here is exact or refuses: the numeric self-check (:mod:`piecegraph.hf.probe`) still compares each
wrapped model with its own forward before it runs.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

# config.layer_types entries of attention piecegraph's paged attention does not compute: what each one is
LAYER_KINDS = {
    "indexed_attention": "DeepSeek sparse attention (DSA: an indexer picks the top-k cached keys each query "
                         "attends to)",
    "compressed_sparse_attention": "DeepSeek-V4 compressed sparse attention (keys and values pooled over blocks of "
                                   "tokens, then chosen top-k)",
    "heavily_compressed_attention": "DeepSeek-V4 heavily compressed attention (keys and values pooled over blocks "
                                    "of 128 tokens)",
}
# DSA model types whose layers are not the MLA decoder's (piecegraph.hf.mla runs deepseek_v2/v3/v32 and
# glm_moe_dsa): what each adds or changes, read from transformers' modeling code
DSA_DIFFERENCES = {
    "hy_v4": "DeepSeek-V4 hyper-connections (several residual streams mixed around each block), a gate on the "
             "attention output and attention sinks, on top of GLM-5's attention",
    "axk2": "gated RMSNorms (a low-rank sigmoid gate after the layer norms) and a fused query/output-gate "
            "projection reading the query latent",
    "deepseek_v4": "compressed keys and values, hyper-connections (several residual streams) and hash-routed "
                   "experts",
}


def layer_kind_refusal(name: str, kinds: list[str], mla_types: tuple[str, ...]) -> str | None:
    """The reason a config whose ``layer_types`` name ``kinds`` (layers other than full or sliding attention) is
    refused, when one of them is a kind this module describes (:data:`LAYER_KINDS`); ``None`` otherwise (the
    caller's generic reason). ``mla_types``: the model types piecegraph runs with its MLA decoder."""
    known = [k for k in kinds if k in LAYER_KINDS]
    if not known:
        return None
    what = "; ".join(f"{k}: {LAYER_KINDS[k]}" for k in known)
    differs = DSA_DIFFERENCES.get(name)
    why = (f"this type's layers differ from that decoder's: {differs}" if differs else
           "this type is not one of them")
    return (f"model_type {name!r}: config.layer_types names {kinds} ({what}). piecegraph's paged attention does not "
            f"run these layers through transformers' attention interface; it runs DeepSeek sparse attention only "
            f"with its own MLA decoder, for model types {list(mla_types)}, and {why}")


# --------------------------------------------------------------------------------- JetMoE's attention heads
def _is_jetmoe_attention(module: torch.nn.Module) -> bool:
    """JetMoE's mixture-of-attention module: ``top_k`` expert query projections per key/value head, its keys and
    values tiled ``top_k`` times (``repeat``, not ``repeat_interleave``) and ``num_key_value_groups`` set to 1."""
    return type(module).__name__ == "JetMoeAttention" and isinstance(getattr(module, "top_k", None), int)


def _jetmoe_heads(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """JetMoE's attention as grouped-query attention over its ``num_key_value_heads`` cached heads.

    Its query head ``s * kv + j`` (expert slot ``s`` of ``top_k``, key/value head ``j`` of ``kv``) attends key
    head ``s * kv + j`` of keys tiled ``top_k`` times, which is key head ``j``. Reordered to ``j * top_k + s``,
    query head ``h`` reads key head ``h // top_k``, the paged op's grouping, and only the ``kv`` heads of the
    first tile are cached. Returns ``(query, key, value, restore)``; ``restore`` puts an output ``[T, heads,
    dim]`` of the reordered heads back in the module's order. Shapes other than that tiling are returned
    unchanged (the shape check then refuses them)."""
    top_k, heads, kv = module.top_k, query.shape[1], key.shape[1] // max(module.top_k, 1)
    if heads != key.shape[1] or heads != top_k * kv or value.shape[1] != heads:
        return query, key, value, lambda out: out
    order = torch.arange(heads, device=query.device).view(top_k, kv).t().reshape(-1)  # new head -> module head
    back = torch.argsort(order)

    def restore(out: torch.Tensor) -> torch.Tensor:
        return out[:, back]

    return query[:, order], key[:, :kv], value[:, :kv], restore


# (applies(module), adapter): adapters giving the paged op another view of one family's attention call
HEAD_ADAPTERS: list[tuple[Callable[[torch.nn.Module], bool], Callable[..., Any]]] = [
    (_is_jetmoe_attention, _jetmoe_heads),
]


def head_adapter(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The :data:`HEAD_ADAPTERS` entry for ``module``'s attention call, or ``None`` (the generic path)."""
    return next((adapt for applies, adapt in HEAD_ADAPTERS if applies(module)), None)


# --------------------------------------------------------------------------------- per-layer key/value heads
REPEAT = "piecegraph_kv_repeat"  # instance attribute: times each key/value head is repeated to fill the cache's


def _kv_heads(attn: Any, query_heads: int) -> int | None:
    """The key/value heads of an attention module: its query heads (``num_heads``, else ``query_heads``) over its
    ``num_key_value_groups``; ``None`` when it does not say."""
    groups, heads = getattr(attn, "num_key_value_groups", None), getattr(attn, "num_heads", None)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 0:
        return None
    return (heads if isinstance(heads, int) else query_heads) // groups


def kv_head_counts(attentions: list[Any], query_heads: int) -> dict[int, list[int]]:
    """Key/value head count -> the indices of ``attentions`` (one per decoder layer) that have it (modules that do
    not say are left out)."""
    counts: dict[int, list[int]] = {}
    for i, attn in enumerate(attentions):
        kv = _kv_heads(attn, query_heads)
        if kv:
            counts.setdefault(kv, []).append(i)
    return counts


def kv_heads_refusal(name: str, attentions: list[Any], query_heads: int) -> str | None:
    """The reason to refuse a model whose attention layers (``attentions``, one per decoder layer) have different
    numbers of key/value heads that the largest is not a multiple of; ``None`` otherwise. Where it is a multiple
    of each (MiMo-V2-Flash: its sliding-window layers have twice its full layers'), the paged cache holds the
    largest count and the other layers' heads are repeated to fill it (:func:`widest_kv_heads`, :func:`kv_repeats`):
    exact, as grouped-query attention repeats each key/value head over its query heads."""
    counts = kv_head_counts(attentions, query_heads)
    if all(max(counts) % kv == 0 for kv in counts):
        return None
    per_count = ", ".join(f"layers {layers} have {count}" for count, layers in sorted(counts.items()))
    return (f"model_type {name!r}: its attention layers have different numbers of key/value heads ({per_count}), "
            "the largest not a multiple of the others; piecegraph's paged KV cache holds one key/value head count "
            "for every layer")


def _causal_attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The causal attention modules of transformers' kind in ``model`` (cross-attention left out), in order."""
    return [m for m in model.modules() if getattr(m, "is_causal", False) is True and hasattr(m, "scaling")
            and getattr(m, "config", None) is not None]


def widest_kv_heads(model: torch.nn.Module) -> int | None:
    """The key/value heads piecegraph's paged cache holds for ``model`` when its layers have different counts (the
    largest); ``None`` when they all have one (the config's ``num_key_value_heads`` then)."""
    counts = kv_head_counts(_causal_attentions(model), model.config.num_attention_heads)
    return max(counts) if len(counts) > 1 else None


def kv_repeats(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """Give each attention module of ``model`` with fewer key/value heads than :func:`widest_kv_heads`
    :data:`REPEAT`, how many times :func:`piecegraph.hf.attention.attention` repeats each of its heads; returns
    ``(module, attributes set)`` (see :func:`piecegraph.hf.adapters.adapt`, which calls it)."""
    widest, done = widest_kv_heads(model), []
    for attn in _causal_attentions(model) if widest else ():
        kv = _kv_heads(attn, model.config.num_attention_heads)
        if kv and kv < widest and widest % kv == 0 and REPEAT not in attn.__dict__:
            values = {REPEAT: widest // kv}
            attn.__dict__.update(values)
            done.append((attn, values))
    return done


# --------------------------------------------------------------------------------- hand-written attention
def _is_gpt_neo_attention(module: torch.nn.Module) -> bool:
    """GPT-Neo's eager self-attention (its only implementation besides flash-attention): attention computed in
    its ``_attn`` method, unscaled, over all earlier tokens (``"global"``) or the last ``window_size``
    (``"local"``)."""
    return (type(module).__name__ == "GPTNeoSelfAttention" and callable(getattr(module, "_attn", None))
            and getattr(module, "attention_type", None) in ("global", "local"))


def _is_gpt_neox_japanese_attention(module: torch.nn.Module) -> bool:
    """GPT-NeoX-Japanese's attention: attention computed in its ``_attn`` method, scaled by ``1 / norm_factor``,
    under the causal mask its base model builds."""
    return (type(module).__name__ == "GPTNeoXJapaneseAttention" and callable(getattr(module, "_attn", None))
            and isinstance(getattr(module, "norm_factor", None), float))


def _is_bert_self_attention(module: torch.nn.Module) -> bool:
    """A BERT-style self-attention of a decoder whose attention is computed in its forward (MegatronBERT's,
    RemBERT's, RoFormer's, BigBird's full attention): linear ``query``, ``key`` and ``value`` projections of
    ``num_attention_heads`` heads of ``attention_head_size``, logits divided by its square root, the base model's
    additive mask, a softmax; ``is_decoder`` set (an encoder's attention is bidirectional) and no config (those
    with one call transformers' attention interface). RoFormer's also take ``sinusoidal_pos`` and apply it with
    their own ``apply_rotary_position_embeddings`` (to the values too where ``rotary_value``)."""
    if (getattr(module, "config", None) is not None or hasattr(module, "is_causal")
            or getattr(module, "is_decoder", None) is not True):
        return False
    if not all(isinstance(getattr(module, n, None), torch.nn.Linear) for n in ("query", "key", "value")):
        return False
    numbers = [getattr(module, n, None) for n in ("num_attention_heads", "attention_head_size", "all_head_size",
                                                  "layer_idx")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers):
        return False
    takes = forward_parameters(module)
    if not {"attention_mask", "encoder_hidden_states"} <= set(takes):
        return False
    return "sinusoidal_pos" not in takes or (callable(getattr(module, "apply_rotary_position_embeddings", None))
                                             and isinstance(getattr(module, "rotary_value", None), bool))


def forward_parameters(module: torch.nn.Module) -> tuple[str, ...]:
    """The parameters of ``module``'s class forward after ``self``, in order (``()`` when unreadable)."""
    try:
        return tuple(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return ()


def block_sparse_refusal(name: str, layer: torch.nn.Module, base: str | None) -> str | None:
    """The reason to refuse a decoder layer of BigBird's kind whose attention is block-sparse now
    (``attention_type == "block_sparse"``), naming the switch to its full attention, which transformers' own
    ``generate`` makes for a decoder (and which piecegraph then runs); ``None`` for any other layer. ``base``: the
    attribute holding the causal LM's base model."""
    if getattr(layer, "attention_type", None) != "block_sparse" or not callable(
            getattr(layer, "set_attention_type", None)):
        return None
    return (f"model_type {name!r}: its layers run block-sparse attention (attention_type='block_sparse': each query "
            "attends blocks of global, sliding-window and random keys, in both directions), which piecegraph's "
            "paged attention does not compute. transformers' generate switches a decoder to full causal attention "
            f"(its cache cannot hold block-sparse attention); do the same before wrapping: "
            f"model.{base or 'base_model'}.set_attention_type('original_full')")


# hand-written attention modules piecegraph.hf.adapters makes of transformers' attention kind while wrapped
def _is_bloom_attention(module: torch.nn.Module) -> bool:
    """BLOOM's attention: fused ``query_key_value``, ALiBi added by ``baddbmm``, computed in its forward."""
    return (type(module).__name__ == "BloomAttention" and isinstance(getattr(module, "query_key_value", None),
                                                                      torch.nn.Linear)
            and isinstance(getattr(module, "inv_norm_factor", None), float) and getattr(module, "beta", None) == 1.0)


def _is_mpt_attention(module: torch.nn.Module) -> bool:
    """MPT's attention: fused ``Wqkv``, its ALiBi ``position_bias`` and softmax computed in its forward."""
    return (type(module).__name__ == "MptAttention" and isinstance(getattr(module, "Wqkv", None), torch.nn.Linear)
            and isinstance(getattr(module, "softmax_scale", None), float))


def _is_openai_gpt_attention(module: torch.nn.Module) -> bool:
    """OpenAI GPT's attention: fused ``c_attn``, its causal ``bias`` buffer and softmax computed in its ``_attn``."""
    return (type(module).__name__ == "Attention" and type(module).__module__.endswith("openai.modeling_openai")
            and callable(getattr(module, "_attn", None)) and isinstance(getattr(module, "scale", None), bool))


HAND_WRITTEN = (_is_gpt_neo_attention, _is_gpt_neox_japanese_attention, _is_bert_self_attention,
                _is_bloom_attention, _is_mpt_attention, _is_openai_gpt_attention)


def adaptable(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a hand-written attention :func:`piecegraph.hf.adapters.adapt` makes of transformers'
    attention kind (:data:`HAND_WRITTEN`), not adapted yet."""
    return any(applies(module) for applies in HAND_WRITTEN) and not {"_attn", "forward"} & module.__dict__.keys()


def set_fields(model: torch.nn.Module, table: Any, only: Callable[[torch.nn.Module], bool] = lambda m: True
               ) -> list[tuple[torch.nn.Module, dict[str, Any]]]:
    """Give each module of ``model`` that an ``(applies(module), fields(module, model))`` entry of ``table``
    matches (and ``only`` accepts) those fields as plain instance attributes (no parameter or submodule is added),
    leaving alone a module one of whose fields is an instance attribute already (idempotent); returns
    ``(module, attributes set)`` for :func:`unadapt` and :func:`readapt`."""
    done = []
    for module in model.modules():
        for applies, fields in table:
            if applies(module) and only(module):
                values = fields(module, model)
                if not any(name in module.__dict__ for name in values):
                    module.__dict__.update(values)
                    done.append((module, values))
    return done


def unadapt(done: list[tuple[torch.nn.Module, dict[str, Any]]]) -> None:
    """Undo :func:`piecegraph.hf.adapters.adapt` (or the like): remove the attributes it set (those still set to
    what it set)."""
    for module, values in done:
        for name, value in values.items():
            if module.__dict__.get(name) is value:
                del module.__dict__[name]


def readapt(done: list[tuple[torch.nn.Module, dict[str, Any]]]) -> None:
    """Set again what :func:`piecegraph.hf.adapters.adapt` (or the like) set (the same objects: a compiled graph's
    guards on them still hold)."""
    for module, values in done:
        module.__dict__.update(values)
