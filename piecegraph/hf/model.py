"""``HFDecoder``: an unmodified Hugging Face ``*ForCausalLM`` as a flat-token decoder piecegraph can graph.

The wrapper owns no weights: it calls the model's own base model (``model.model``, or the module its
``base_model_prefix`` names: GPT-2's ``transformer``...) with explicit positions, ``use_cache=False`` and
``return_dict=False``, and its own output head (``lm_head``, or the like) separately. Attention goes through the
split op (see ``piecegraph.hf.attention``), so the graph splits into ``num_layers + 1`` pieces.

Wrapping changes exactly this on the model, and :func:`unwrap` (``HFDecoder.unwrap()``, the end of a ``with``
block) undoes it:

- each attention module's ``config`` becomes a view of the same config naming ``"piecegraph"`` (the model's
  config, its sub-configs and ``config.to_dict()`` are never changed); unwrap gives the modules their config back;
- modules in training mode are put in eval mode; unwrap puts them back in training mode;
- a decoder that numbers positions itself (BART, Marian, Pegasus...) gets a forward pre-hook on its position
  module that gives it the flat forward's positions, and changes nothing in any other call
  (:mod:`piecegraph.hf.positions`); unwrap removes it;
- a hand-written attention module piecegraph adapts (GPT-Neo's) gets instance attributes that make it of
  transformers' attention kind: ``scaling``, ``layer_idx``, ``sliding_window`` and an ``_attn`` that calls
  piecegraph's attention on the flat forward's calls, its own otherwise (:mod:`piecegraph.hf.adapters`); one of
  the fairseq layout (XGLM's, MVP's, TrOCR's) gets ``config``, ``is_causal`` and such a ``forward``
  (:func:`piecegraph.hf.attention.adapt_projection_attention`), and so does a BERT-style decoder self-attention
  computed in its forward (MegatronBERT's, RemBERT's, RoFormer's, BigBird's), with ``scaling``; unwrap removes them;
- OpenAI GPT's attention gets such fields and an ``_attn``, its base model a ``forward`` that marks the flat
  forward's calls; a decoder self-attention causal by its decoder's mask though not by ``is_causal``
  (BigBird-Pegasus's) gets ``piecegraph_causal`` (:mod:`piecegraph.hf.adapters_misc`); unwrap removes them;
- an attention module called more than once per forward (differential attention, looped layers) gets the cache
  layer of each call and a call count (:mod:`piecegraph.hf.multi_call`); unwrap removes them;
- a private attribute on the model (``_piecegraph_hf``) records the above; unwrap removes it;
- ``"piecegraph"`` is registered in transformers' ``AttentionInterface`` while any model is wrapped.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable

import torch

import piecegraph.hf.adapters as adapters
import piecegraph.hf.attention as hf_attention
import piecegraph.hf.families as families
import piecegraph.hf.multi_call as multi_call
import piecegraph.hf.probe as probe
from piecegraph.hf.arch import (
    base_model_name,
    cache_config,
    check_structure,
    check_supported,
    layer_constants,
    model_type,
    output_head_names,
)
from piecegraph.hf.attention import FLAT, is_view
from piecegraph.hf.generation_check import check_generation
from piecegraph.hf.positions import FlatPositions
from piecegraph.models.facts import ModelFacts, measure

_STATE = "_piecegraph_hf"  # the attribute of a wrapped Hugging Face model holding its _Wrap
# (applies(model), subclass): HFDecoder(model) builds the first subclass that applies instead. piecegraph.hf.mla
# registers MLAHFDecoder for deepseek_v2/v3 and glm_moe_dsa (importing any piecegraph.hf module imports it).
SUBSTITUTES: list[tuple[Callable[[Any], bool], type]] = []


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel``, without importing transformers (a model of that
    class exists only once transformers was imported)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    try:
        return isinstance(model, transformers.PreTrainedModel)
    except AttributeError:  # a half-imported or stubbed transformers
        return False


class _Wrap:
    """What wrapping changed on one Hugging Face model, to undo exactly: the attention modules given a config view
    (with their own configs), the position modules hooked and the modules it switched from training to eval mode.
    Shared by every :class:`HFDecoder` of the model until :func:`unwrap` removes it."""

    def __init__(self) -> None:
        self.configs: list[tuple[torch.nn.Module, Any]] = []
        self.trained: list[torch.nn.Module] = []
        self.positions = FlatPositions()
        self.adapted: list[tuple[torch.nn.Module, dict]] = []  # hand-written attention given fields (families)

    def apply(self, model: torch.nn.Module) -> None:
        """Switch ``model``'s attention modules to piecegraph's and the model to eval mode (idempotent)."""
        self.adapted += adapters.adapt(model)  # before install: adapted modules are of transformers' kind then
        self.adapted += hf_attention.adapt_projection_attention(model)  # XGLM's, MVP's, TrOCR's (same form)
        self.configs += hf_attention.install(model)
        self.positions.install(model)
        self.to_eval(model)

    def to_eval(self, model: torch.nn.Module) -> None:
        """Put ``model`` in eval mode, remembering the modules this switches from training (for :meth:`undo`)."""
        seen = {id(m) for m in self.trained}
        self.trained += [m for m in model.modules() if m.training and id(m) not in seen]
        model.eval()

    def __setstate__(self, state: dict) -> None:  # a copied or unpickled model is wrapped too: keep "piecegraph"
        self.__dict__.update(state)
        hf_attention.acquire(self)

    def undo(self) -> None:
        hf_attention.restore(self.configs)
        families.unadapt(self.adapted)
        self.positions.remove()
        for module in self.trained:
            module.training = True  # the flag only: a child that was in eval mode stays there

    def broken(self) -> str | None:
        """The first attention module whose config view was replaced since the wrap, if any."""
        return next((type(m).__name__ for m, _ in self.configs if not is_view(m.config)), None)


def unwrap(model: Any) -> torch.nn.Module:
    """Give a Hugging Face model back as it was before piecegraph wrapped it; returns it.

    ``model``: the Hugging Face model, its :class:`HFDecoder`, or a ``GraphedModule`` of one
    (``piecegraph.compile(hf_model)``). Undoes every change wrapping made (see the module docstring), whichever
    wrapper made it; every :class:`HFDecoder` of the model refuses its forward from then on (wrap it again:
    ``HFDecoder(model)``). Idempotent: a model that is not wrapped is returned as it is. A ``GraphedModule`` or
    ``Session`` already traced keeps what it traced (piecegraph's attention, still exact): drop it as well.
    """
    if isinstance(getattr(model, "model", None), HFDecoder):  # a GraphedModule of an HFDecoder
        model = model.model
    if isinstance(model, HFDecoder):
        model = model.hf
    state = model.__dict__.pop(_STATE, None)
    if state is not None:
        state.undo()
        hf_attention.release(state)
    return model


class HFDecoder(torch.nn.Module):
    """A Hugging Face causal LM over flat tokens: ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``.

    Constraints: a decoder-only causal LM that passes :func:`~piecegraph.hf.arch.check_supported`,
    :func:`~piecegraph.hf.arch.check_structure`, :func:`~piecegraph.hf.generation_check.check_generation` (no logits
    processor of its ``generation_config`` that greedy decoding skips; a forced last token is applied) and, unless
    ``verify`` is False, the numeric self-check :func:`piecegraph.hf.probe.verify` (a short probe through piecegraph's
    attention against the model's own forward, once per model instance; ``verify=None`` runs it unless the environment
    sets ``PIECEGRAPH_HF_VERIFY=0``): else :class:`UnsupportedModelError` naming its model_type, the feature or the
    first layer that differs, and the model is left unwrapped. In eval mode (the wrapper puts it there), called inside
    ``piecegraph.forward_context`` of :class:`~piecegraph.attention.AttentionMetadata` on a
    :class:`~piecegraph.attention.KVCache` built from :attr:`config` (``KVCache.for_sequences(wrapped.config, ...)``).
    ``config`` is a :class:`~piecegraph.models.ModelConfig` of the cache shape (what ``piecegraph.models.generate``,
    ``KVCache`` and the bench read); the model's own config is ``hf_config``. :meth:`logits` applies ``lm_head`` (and a
    final logit softcap, Gemma 2) to the rows given, usually each sequence's last token. ``HFDecoder(model)`` of a
    multi-head latent attention model (``deepseek_v2``, ``deepseek_v3``, ``glm_moe_dsa``) returns a
    :class:`~piecegraph.hf.mla.MLAHFDecoder` instead: the engine's MLA decoder on the model's own tensors.

    While wrapped, the model's own forward, ``generate`` and ``generate_batch`` (continuous batching) run as they
    did: its config is unchanged, and its attention modules' ``"piecegraph"`` function calls whatever
    implementation the config names (``set_attn_implementation`` included). :meth:`unwrap` (or
    :func:`piecegraph.hf.unwrap`) undoes the wrap; then this wrapper's forward refuses. Wrapping a model wrapped
    already joins that wrap (:attr:`owns_wrap` is False): :meth:`close` and the end of a ``with`` block unwrap only
    a wrap this wrapper made, leaving the model as they found it.

    Example::

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with HFDecoder(hf) as model:
            cache = KVCache.for_sequences(model.config, num_seqs=2, max_len=64)
            meta = AttentionMetadata.for_batch(cache, [("a", 0, 3)])
            with piecegraph.forward_context(meta):
                hidden = model(torch.tensor([5, 6, 7]), meta.positions)
            next_token = model.logits(hidden[-1:]).argmax(-1)
        # hf is as it was: its training flags, its attention modules' configs
    """

    # Bookkeeping the forward never reads: a cached trace's attribute check (trace/snapshot.py) skips it
    piecegraph_not_traced = ("owns_wrap",)

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> "HFDecoder":
        # A model a subclass registered for (SUBSTITUTES) gets that subclass: an MLA model's own attention expands
        # the latent per head and GLM-5's indexer keeps a cache of its own, neither of which the attention op runs
        if cls is HFDecoder and model is not None:
            cls = next((sub for applies, sub in SUBSTITUTES if applies(model)), cls)
        return super().__new__(cls)

    def __init__(self, model: torch.nn.Module, max_seq_len: int | None = None,
                 attention_backend: str = "auto", verify: bool | None = None) -> None:
        super().__init__()
        experts = getattr(model.config, "_experts_implementation", None) if _has_experts(model) else None
        check_supported(model.config, experts)
        check_structure(model)
        check_generation(model)
        state = getattr(model, _STATE, None)
        #: True when this wrapper wrapped the model; False when it joined a wrap made before (close() keeps that).
        self.owns_wrap = state is None
        if state is None:
            state = _Wrap()
            hf_attention.acquire(state)  # registered before any module names "piecegraph"
            setattr(model, _STATE, state)
        state.apply(model)
        self._wrap = state
        self.hf = model
        self.hf_config = model.config
        # attribute names, not modules (a module attribute would register the model's modules twice):
        self.base_name = base_model_name(model)  # "model", or GPT-2's "transformer", GPT-NeoX's "gpt_neox"...
        self.head_names = output_head_names(model)  # ("lm_head",), or BERT's ("cls",)...
        self.config = cache_config(model.config, max_seq_len, attention_backend)
        widest = families.widest_kv_heads(model)  # layers of several key/value head counts: the cache holds the most
        if widest is not None:
            self.config = self.config.replace(num_kv_heads=widest)
        # attention modules called more than once per forward (differential attention, looped layers): a cache
        # layer per call, appended after the model's own (piecegraph.hf.multi_call)
        self._multi_calls: tuple[torch.nn.Module, ...] = ()  # (the flat forward reads it)
        layers, self._multi_calls, assigned = multi_call.install(self, hf_attention.NAME)
        state.adapted += assigned
        if layers != self.config.num_layers:
            self.config = self.config.replace(num_layers=layers)
        self.constants = layer_constants(model)
        self.final_softcap = getattr(model.config, "final_logit_softcapping", None)
        # the head's scale as the model applies it: Cohere multiplies by model.logit_scale, Granite divides by
        # config.logits_scaling (any other head computation fails the numeric self-check and is refused)
        self.logit_scale = float(getattr(model, "logit_scale", None) or 1.0) / float(
            getattr(model.config, "logits_scaling", None) or 1.0)
        # Hugging Face's grouped_mm / batched_mm experts flatten (token, k) pairs, sort them by expert and scatter
        # back: every output row depends on its own row only, so padding a call to a capture size is safe.
        self.row_wise_experts = experts in ("grouped_mm", "batched_mm")
        if probe.enabled(verify):
            try:
                probe.verify(self)
            except BaseException:
                self.close()  # refused: the model is given back as it was
                raise

    @property
    def model(self) -> torch.nn.Module:
        """The base model (``hf.model``, or the module ``base_model_prefix`` names: embeddings, layers, final norm),
        as the reference decoder's ``.model``."""
        return getattr(self.hf, self.base_name)

    @property
    def model_type(self) -> str:
        return model_type(self.hf_config)

    @property
    def wrapped(self) -> bool:
        """Whether the model is still wrapped by this wrapper's wrap (False after :meth:`unwrap`)."""
        return getattr(self.hf, _STATE, None) is self._wrap

    def unwrap(self) -> torch.nn.Module:
        """Undo the wrap (whichever wrapper made it) and return the Hugging Face model as it was before: see
        :func:`piecegraph.hf.unwrap`. Idempotent. This wrapper's forward refuses from then on."""
        if getattr(self, "tp", None) is not None:
            warnings.warn("piecegraph.hf: unwrapping a model piecegraph.parallel.apply_tp sharded in place: its "
                          "attention and modes are restored, its sharded layers are not (Hugging Face's own forward "
                          "would compute this rank's shard only)", stacklevel=2)
        return unwrap(self.hf)

    def suspend(self) -> None:
        """Give the model back as it was (as :meth:`close`), remembering this wrap so that :meth:`resume` can
        put the same attention config views back (a compiled module's guards then still hold). Own wraps only."""
        if self.owns_wrap and self.wrapped:
            self._suspended = [(m, m.config) for m, _ in self._wrap.configs]
            unwrap(self.hf)

    def resume(self) -> bool:
        """Wrap the model again after :meth:`suspend`, without the self-check; ``False`` (nothing changed) when
        that is not safe: the model was wrapped by someone else meanwhile, or an attention module's config was
        replaced."""
        if self.wrapped:
            return True
        views, state = getattr(self, "_suspended", None), self._wrap
        if views is None or getattr(self.hf, _STATE, None) is not None or any(
                getattr(m, "config", own) is not own for m, own in state.configs):  # (an adapted one's is unset)
            return False
        hf_attention.acquire(state)
        setattr(self.hf, _STATE, state)
        families.readapt(state.adapted)  # first: a config it sets is then replaced by the view
        for module, view in views:
            module.config = view
        state.positions.install(self.hf)
        state.trained = []  # what is in training mode now, not what was before the suspend
        state.to_eval(self.hf)
        self._suspended = None
        return True

    def close(self) -> None:
        """Unwrap when this wrapper made the wrap (:attr:`owns_wrap`); leave a wrap it joined to its maker."""
        if self.owns_wrap:
            self.unwrap()

    def __enter__(self) -> "HFDecoder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.wrapped:  # Hugging Face's own attention again: it would attend the placeholder mask, wrongly
            raise RuntimeError(
                f"this piecegraph.hf.HFDecoder's {type(self.hf).__name__} was unwrapped (unwrap(), or the end of "
                "its `with` block): its attention is Hugging Face's own again. Wrap it again to run it flat: "
                "piecegraph.hf.HFDecoder(model) or piecegraph.compile(model)")
        broken = self._wrap.broken()
        if broken is not None:
            raise RuntimeError(f"the config of the model's {broken} was replaced since the wrap: its attention is "
                               "no longer piecegraph's. Unwrap it (piecegraph.hf.unwrap(model)) and wrap it again")
        # A 4D mask makes Hugging Face's mask builders return it as is: no [T, T] mask is built (attention is
        # paged and causal in the op, which ignores it).
        no_mask = hf_attention.placeholder_mask(input_ids.device)
        multi_call.reset(self._multi_calls)  # each call of a module called more than once: its own cache layer
        base = getattr(self.hf, self.base_name)
        inputs = dict(input_ids=input_ids[None], position_ids=positions[None], attention_mask=no_mask,
                      use_cache=False, return_dict=False, **{FLAT: True})
        numbering = self._wrap.positions
        if not numbering.modules:
            return base(**inputs)[0][0]
        numbering.current = positions  # a decoder that numbers positions itself: its hooked position module's
        try:
            return base(**inputs)[0][0]
        finally:
            numbering.current = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size] -> [T, vocab_size]``, as the Hugging Face model computes them (its output head,
        ``lm_head`` or the like, its logit scale, a final logit softcap)."""
        logits = hidden
        for name in self.head_names:
            logits = getattr(self.hf, name)(logits)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def facts(self) -> ModelFacts:
        """The model's device, dtype, cache shape (:attr:`config`) and weight bytes as they are now; a mixture of
        experts' expert count and top-k from its config (``num_experts`` or ``num_local_experts``,
        ``num_experts_per_tok``). Ask once and pass the facts down."""
        c = self.hf_config
        experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0
        top_k = getattr(c, "num_experts_per_tok", None) or 0
        return measure(self, self.config, experts if top_k else 0, top_k)

    def check_backend(self, backend_name: str) -> None:
        """Refuse, naming the model type, a backend that cannot run every layer's constants (FlashInfer plans one
        scale for all layers, and no sliding window shorter than the cache, softcap or ALiBi)."""
        if backend_name != "flashinfer":
            return
        if adapters.uses_alibi(self.hf):
            raise ValueError(f"model_type {self.model_type!r}: its attention adds ALiBi (alibi_slopes), which the "
                             "flashinfer attention backend does not implement; use attention_backend='torch'")
        scale = self.config.head_dim ** -0.5
        for i, c in enumerate(self.constants):
            window = c["window"] if c["window"] and c["window"] < self.config.max_seq_len else None
            if window or c["softcap"] or abs(c["scale"] - scale) > 1e-12 * scale:
                raise ValueError(
                    f"model_type {self.model_type!r}: layer {i} needs scale={c['scale']}, window={window}, "
                    f"softcap={c['softcap']}, which the flashinfer attention backend does not implement (it plans "
                    f"scale {scale} and no window or softcap); use attention_backend='torch'")


def _has_experts(model: torch.nn.Module) -> bool:
    return any(type(m).__name__.endswith("Experts") for m in model.modules())
