"""Greedy generation for Hugging Face decoders: packed piecewise prefill, full-graph decode, one graph pool.

A :class:`Session` holds what must live across calls: the wrapped model, one paged KV cache (full graphs bake
the cache they captured with), the compiled prefill and decode modules and their shared
:class:`~piecegraph.GraphPool`. :func:`generate` makes a session for one call; keep a session to generate
again without tracing, compiling and capturing anew.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from piecegraph.attention.kv_cache import KVCache
from piecegraph.config import Config, default_capture_sizes
from piecegraph.graphed.module import GraphedModule
from piecegraph.graphs.capture import GraphPool
from piecegraph.hf import reuse as reuse_
from piecegraph.hf.mla import MLAHFDecoder, is_mla_model
from piecegraph.hf.model import HFDecoder
from piecegraph.models.generate import dummy_inputs, greedy_loop, stop_ids

MODES = ("graphs", "none", "eager")
DEFAULT_NEW_TOKENS = 20  # transformers' generate when nothing sets a length limit


def wrap(model: Any, **options: Any) -> HFDecoder:
    """``model`` itself when it is an :class:`HFDecoder` (``options`` unused), else ``HFDecoder(model,
    **options)`` (which checks the model: see :class:`HFDecoder`); an MLA model (DeepSeek-V2/V3, GLM-5) gets
    :class:`~piecegraph.hf.mla.MLAHFDecoder`, the engine's MLA decoder on the model's own tensors."""
    if isinstance(model, HFDecoder):
        return model
    return MLAHFDecoder(model, **options) if is_mla_model(model) else HFDecoder(model, **options)


def eos_ids(model: HFDecoder, eos_token_id: int | Iterable[int] | None = None) -> set[int]:
    """The EOS ids to stop at: ``eos_token_id`` if given, else the model's ``generation_config`` (as
    Hugging Face's ``generate`` does), else its config's; empty when none is known."""
    value = eos_token_id
    if value is None:
        gen = getattr(model.hf, "generation_config", None)
        value = getattr(gen, "eos_token_id", None)
        if value is None:
            value = getattr(model.hf_config, "eos_token_id", None)
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def new_token_limits(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None,
                     max_length: int | None = None) -> list[int]:
    """How many new tokens each prompt may get, counted as Hugging Face's ``generate`` counts them:
    ``max_new_tokens`` when given (it wins over ``max_length``; below 0 counts as 0), else ``max_length`` (prompt
    and output together) minus the prompt's length, else the model's ``generation_config`` (its
    ``max_new_tokens``, else its ``max_length``), else transformers' default: 20 new tokens, prompt and output
    together at most the config's ``max_position_embeddings``. ``model``: a Hugging Face causal LM or an
    :class:`HFDecoder`. A length limit that leaves a prompt no room raises ``ValueError`` naming it (pass
    ``max_new_tokens`` instead), as transformers' ``generate`` does."""
    if max_new_tokens is not None:
        return [max(int(max_new_tokens), 0)] * len(prompts)
    source = "max_length"
    if max_length is None:
        hf = model.hf if isinstance(model, HFDecoder) else model
        gen = getattr(hf, "generation_config", None)
        if getattr(gen, "max_new_tokens", None) is not None:
            return [max(int(gen.max_new_tokens), 0)] * len(prompts)
        if getattr(gen, "max_length", None) is not None:
            max_length, source = gen.max_length, "the model's generation_config.max_length"
        else:
            return _default_limits(hf, prompts)
    short = [i for i, p in enumerate(prompts) if len(p) >= max_length]
    if short:
        raise ValueError(f"{source}={max_length} counts the prompt too, and prompt {short[0]} already has "
                         f"{len(prompts[short[0]])} tokens: pass max_new_tokens (new tokens only) or a larger "
                         "max_length")
    return [max_length - len(p) for p in prompts]


def _default_limits(hf: Any, prompts: Sequence[Sequence[int]]) -> list[int]:
    """transformers' limits when nothing sets one: ``max_length`` is the prompt plus 20, at most the config's
    ``max_position_embeddings``."""
    cap = getattr(getattr(hf, "config", None), "max_position_embeddings", None)
    limits = [DEFAULT_NEW_TOKENS if cap is None else min(len(p) + DEFAULT_NEW_TOKENS, cap) - len(p) for p in prompts]
    short = [i for i, n in enumerate(limits) if n <= 0]
    if short:
        raise ValueError(f"prompt {short[0]} has {len(prompts[short[0]])} tokens, which leaves no room under the "
                         f"model's max_position_embeddings={cap} (transformers' default length limit when neither "
                         "max_new_tokens nor max_length is set): pass max_new_tokens")
    return limits


def forced_eos_id(model: Any) -> int | None:
    """The token the model's ``generation_config.forced_eos_token_id`` forces as the last new token of an answer
    that reaches its length limit (transformers' ``ForcedEOSTokenLogitsProcessor``: at length ``max_length - 1``
    every logit but the forced ids' becomes -inf), or ``None``. A list of ids gives its smallest, the one greedy
    decoding picks among the equal logits the processor leaves. ``model``: a causal LM or an :class:`HFDecoder`."""
    hf = model.hf if isinstance(model, HFDecoder) else model
    value = getattr(getattr(hf, "generation_config", None), "forced_eos_token_id", None)
    if value is None:
        return None
    ids = stop_ids(value)
    return min(ids) if ids else None


def force_last_tokens(outputs: list[list[int]], limits: Sequence[int], forced: int | None) -> list[list[int]]:
    """``outputs`` with the forced EOS id (:func:`forced_eos_id`) as the last token of each that reached its
    limit (an answer that stopped earlier at an EOS id keeps its tokens); unchanged when ``forced`` is ``None``."""
    if forced is None:
        return outputs
    return [[*tokens[:-1], forced] if tokens and len(tokens) == n else tokens for tokens, n in zip(outputs, limits)]


class Session:
    """A model ready to generate for up to ``max_seqs`` sequences of up to ``max_len`` tokens.

    ``mode``: ``"graphs"`` (piecewise prefill, full-graph decode: CUDA graphs on a GPU; on CPU they fall back to
    compiled pieces with a warning unless ``emulate_graphs``), ``"none"`` (compiled pieces, no graphs) or
    ``"eager"`` (the wrapped model as it is). ``prefill_tokens`` is the largest captured prefill (larger ones
    run the compiled pieces without graphs). ``backend`` is the KV cache's attention backend (``auto``:
    FlashInfer on a GPU that has it, for bf16/fp16); a backend the model's layers cannot use is refused naming
    its model type. ``share_trace`` (default on): the decode module builds its program from the prefill module's
    Dynamo trace (``GraphedModule.trace_from``) instead of tracing the model again, and where it compiles by
    pieces (``full_compile``: ``"auto"`` with a cache on CUDA, or ``"pieces"``) takes its compiled pieces too
    (``piecegraph/trace/handover.py``). ``capture``: trace, compile and capture every
    prefill and then every decode size now, as an engine's start does (``mode="graphs"`` only), so that
    construction holds the whole start-up cost (each module's ``stats()["startup"]``) and no ``generate`` call
    captures; by default each size is captured at its first use. ``verify``: the numeric self-check of a model
    the session wraps itself (:class:`HFDecoder`'s; ``None``: on unless ``PIECEGRAPH_HF_VERIFY=0``). Every other
    keyword is a
    :class:`piecegraph.Config` field of both compiled modules
    (a mixture of experts on ``grouped_mm`` / ``batched_mm`` defaults to ``token_mixing="pad"``: those experts
    are row-wise, so padded calls replay graphs of every capture size). :meth:`close` (or the end of a ``with``
    block) gives back a model the session wrapped itself as it was, and frees the graphs and the cache.
    """

    def __init__(self, model: Any, *, max_seqs: int, max_len: int, mode: str = "graphs",
                 prefill_tokens: int = 512, backend: str = "auto", page_size: int = 16, share_trace: bool = True,
                 capture: bool = False, verify: bool | None = None, **options: Any) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if capture and mode != "graphs":
            raise ValueError(f"capture=True captures CUDA graphs, which mode={mode!r} has none of; use "
                             "mode='graphs' or leave capture off")
        self._own_wrapper = not isinstance(model, HFDecoder)
        self.model = wrap(model, verify=verify)
        self.closed = False
        self.max_seqs, self.max_len = max_seqs, max_len
        try:
            facts = self.model.facts()
            self.cache = KVCache.for_sequences(facts.config, max_seqs, max_len, page_size, dtype=facts.dtype,
                                               device=facts.device, backend=backend)
            self.model.check_backend(self.cache.backend.name)
        except BaseException:
            self.close()
            raise
        self.pool = GraphPool()
        self.mode = mode
        if mode == "eager":
            self.prefill = self.decode = self.model
            return
        graphs = mode == "graphs"
        if self.model.row_wise_experts:
            # The token-mixing check flags the experts' flatten of (token, k) pairs; they are row-wise (see
            # HFDecoder), so pad to capture sizes instead of capturing exact token counts only.
            options.setdefault("token_mixing", "pad")
        base = Config(pool=self.pool, **options)
        self.prefill = GraphedModule(self.model, base.replace(mode="piecewise" if graphs else "none",
                                                              max_tokens=prefill_tokens))
        self.decode = GraphedModule(self.model, base.replace(mode="full" if graphs else "none",
                                                             capture_sizes=default_capture_sizes(max_seqs)))
        if share_trace:  # the prefill module sets up first (generate's prefill, or the captures below)
            self.decode.trace_from(self.prefill)
        if capture:
            try:
                for module in (self.prefill, self.decode):
                    module.capture(lambda n: dummy_inputs(self.model.config, self.cache, n))
            except BaseException:
                self.close()
                raise

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None,
                 eos_token_id: int | Iterable[int] | None = None, *, max_length: int | None = None
                 ) -> list[list[int]]:
        """Greedy new tokens per prompt: ``max_new_tokens`` each (or up to ``max_length`` with the prompt, or
        the model's ``generation_config``'s: :func:`new_token_limits`), or fewer when one is an EOS id (which is
        kept, as Hugging Face keeps it; default EOS: :func:`eos_ids`); an answer that reaches its limit ends with
        the ``generation_config``'s ``forced_eos_token_id`` where it names one (:func:`forced_eos_id`). One packed
        prefill of every prompt, then decode steps over the sequences still running; each finished sequence's
        pages are freed at once (:func:`piecegraph.models.generate.greedy_loop`, the loop the reference decoder
        uses too); prompts whose limits differ (``max_length``) run in one loop per limit, so no sequence grows past
        its own limit in the cache."""
        if self.closed:
            raise RuntimeError("this piecegraph.hf.Session was closed: make a new one")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs at least one prompt, and every prompt needs at least one token")
        limits = new_token_limits(self.model, prompts, max_new_tokens, max_length)
        if max(limits) <= 0:
            return [[] for _ in prompts]
        stop = stop_ids(eos_ids(self.model, eos_token_id))
        out: list[list[int]] = [[] for _ in prompts]
        for limit in sorted(set(limits) - {0}):  # several only under max_length
            group = [i for i, n in enumerate(limits) if n == limit]
            tokens = greedy_loop(self.model, self.cache, [prompts[i] for i in group], limit, prefill_fn=self.prefill,
                                 decode_fn=self.decode, stop=stop, tag="hf.generate")
            for i, answer in zip(group, tokens):
                out[i] = answer
        return force_last_tokens(out, limits, forced_eos_id(self.model))


    def suspend(self) -> None:
        """Between calls of a kept session (``piecegraph/hf/reuse.py``): the model as it was, the session kept."""
        if self._own_wrapper and not self.closed:
            self.model.suspend()

    def resume(self) -> bool:
        """Ready again after :meth:`suspend`; ``False`` when the model changed hands meanwhile (build anew)."""
        if self.closed:
            return False
        return self.model.resume() if self._own_wrapper else self.model.wrapped

    def close(self) -> None:
        """Give the model back as it was when this session wrapped it (a model the caller wrapped or compiled
        stays wrapped) and drop the compiled modules, cache and pool; idempotent. Also the end of a ``with``."""
        if self._own_wrapper:
            self.model.close()
        self.prefill = self.decode = self.cache = self.pool = None
        self.closed = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def generate(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None, *,
             max_length: int | None = None, eos_token_id: int | Iterable[int] | None = None, mode: str | None = None,
             reuse: bool = True, **options: Any) -> list[list[int]]:
    """Greedy-decode ``prompts`` (token id lists) with a Hugging Face causal LM (or an :class:`HFDecoder`).

    Returns the new tokens per prompt, stopping at ``max_new_tokens`` (or ``max_length``, prompt included; neither:
    the model's ``generation_config``'s, see :func:`new_token_limits`) or an EOS id (default: the model's
    ``generation_config.eos_token_id``, one id or a list, as Hugging Face's ``generate``; the EOS token is
    included). A chat prompt is the tokenizer's ``apply_chat_template(messages, add_generation_prompt=True)``.
    ``mode`` and ``options`` are :class:`Session`'s (e.g. ``emulate_graphs=True``, ``compiler="eager"``,
    ``backend="torch"``).
    ``mode=None``: ``"graphs"``, except on CPU with no compile option given: ``"eager"`` (no CUDA graphs there;
    compiling costs more than one answer takes: ``piecegraph/hf/reuse.py``).
    The first call builds a :class:`Session` (tracing, compiling and capturing included) and keeps it on the model
    for the next calls (``reuse=False``: build one for this call only); either way a model this call wrapped is
    given back as it was after the call. The kept session is dropped when the model's weights, dtype or device
    change (:mod:`piecegraph.hf.reuse`).

    Example::

        hf = AutoModelForCausalLM.from_pretrained("path/to/qwen2", dtype=torch.bfloat16).cuda()
        tokens = piecegraph.hf.generate(hf, [[1, 2, 3], [4, 5]], max_new_tokens=32)
    """
    if not prompts:
        raise ValueError("generate() needs at least one prompt, and every prompt needs at least one token")
    limits = new_token_limits(model, prompts, max_new_tokens, max_length)
    longest = max(len(p) + max(n, 1) for p, n in zip(prompts, limits))
    mode = mode or reuse_.default_mode(model, options)
    return reuse_.run(model, lambda seqs, length: Session(model, max_seqs=seqs, max_len=length, mode=mode, **options),
                      lambda session: session.generate(prompts, max_new_tokens, eos_token_id, max_length=max_length),
                      max_seqs=len(prompts), max_len=longest, key=(mode, sorted(options.items())), reuse=reuse)
