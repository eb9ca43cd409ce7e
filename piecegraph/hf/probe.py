"""The numeric self-check: a short probe through piecegraph's attention against the model's own forward.

A Hugging Face model is run by piecegraph only on evidence that piecegraph computes what the model computes.
:func:`verify` runs two short probe prompts, packed into one flat prefill on a small paged KV cache and then a
few batched decode steps, through the wrapped model (piecegraph's attention, eager: no compile, no graphs), and
compares them with the model's own forward (its configured attention, no cache) on the same tokens, called as
transformers' ``generate`` calls it (``position_ids`` 0, 1, ... where the forward takes them: RoBERTa's kin
number positions from their padding index only when not given any, which ``generate`` never lets happen):

- every decoder layer calls transformers' attention interface once per forward with its own ``layer_idx`` (or
  as often as it was given cache layers for when wrapped: differential attention, looped layers; see
  :mod:`piecegraph.hf.multi_call`), and the call is known as piecegraph's (a recurrent, convolutional or
  hand-written attention layer does not call it, and would run wrong);
- every layer's hidden states and the logits agree within the dtype's tolerance (:data:`TOLERANCE`, relative,
  over all probe rows), and each greedy token the model's own forward picks is piecegraph's greedy token too
  (a near-tie within rounding excepted).

The decode steps are fed the model's own greedy tokens (teacher forcing), so one early difference cannot hide the
later ones. A failure raises :class:`~piecegraph.hf.arch.UnsupportedModelError` naming the model type, the first
decoder layer whose hidden states differ and by how much. The verdict is kept per model instance, dtype, device
and attention implementation, so it is paid once.
"""

from __future__ import annotations

import inspect
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from piecegraph.attention.kv_cache import KVCache
from piecegraph.attention.metadata import AttentionMetadata
from piecegraph.context import forward_context
from piecegraph.hf.arch import UnsupportedModelError, decoder_layers, model_type
from piecegraph.hf.attention import NAME, is_flat
from piecegraph.hf.multi_call import calls_per_layer

# Relative tolerance (Frobenius norm of the difference over that of the reference) per dtype, for every
# layer's hidden states and the logits. float32 runs agree to ~1e-6; a wrong computation differs by ~1e-1.
TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
PROMPT_LENS = (13, 6)  # two sequences packed in one prefill: a token mixing them would show
NEW_TOKENS = 4  # greedy steps compared; all but the last run as decode steps on the paged cache
PAGE_SIZE = 4  # small pages: every probe sequence spans several
DROPPED = "dropped"  # an attention call of the flat forward carrying neither piecegraph's keyword nor its mask
_verdicts: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Verdict:
    """What :func:`verify` found for one model. ``ok``: piecegraph may run it. ``reason``: why not (else "").
    ``logits_error`` / ``logits_max_abs``: relative and largest absolute logit difference over the probe rows.
    ``layer``: the first decoder layer whose hidden states differ beyond ``tolerance`` (``None`` if none), with
    ``layer_error`` / ``layer_max_abs`` its differences. ``tokens``: greedy tokens compared."""

    model_type: str
    ok: bool
    reason: str = ""
    tolerance: float = 0.0
    logits_error: float = 0.0
    logits_max_abs: float = 0.0
    tokens: int = 0
    layer: int | None = None
    layer_error: float = 0.0
    layer_max_abs: float = 0.0

    def summary(self) -> str:
        """One line: the verdict and its evidence."""
        if not self.ok:
            return f"refused: {self.reason}"
        return (f"supported: model_type {self.model_type!r}: {self.tokens} greedy tokens equal the model's own, "
                f"logits within {self.tolerance:g} (relative error {self.logits_error:.2g}, largest absolute "
                f"{self.logits_max_abs:.2g})")


def cached(model: torch.nn.Module) -> Verdict | None:
    """The verdict :func:`verify` reached for ``model`` (a Hugging Face model) as it is now, if any."""
    return _verdicts.get(model, {}).get(_key(model))


def verify(decoder: Any, *, raise_on_failure: bool = True) -> Verdict:
    """Check numerically that ``decoder`` computes what its Hugging Face model computes (see the module docstring).

    ``decoder``: a wrapped :class:`~piecegraph.hf.HFDecoder` (:func:`piecegraph.hf.verify` takes a Hugging Face
    model too). Returns the :class:`Verdict`, cached per model instance, dtype, device and
    attention implementation; raises :class:`UnsupportedModelError` with its reason when the model is refused,
    unless ``raise_on_failure`` is False. Costs ``NEW_TOKENS`` forwards of the model per probe prompt (about 20
    tokens) and one prefill and ``NEW_TOKENS - 1`` decode steps through piecegraph's attention, eager.
    """
    hf = decoder.hf
    key = _key(hf)
    verdict = _verdicts.get(hf, {}).get(key)
    if verdict is None:
        verdict = _run(decoder)
        _verdicts.setdefault(hf, {})[key] = verdict
    if raise_on_failure and not verdict.ok:
        raise UnsupportedModelError(verdict.reason)
    return verdict


def _key(model: torch.nn.Module) -> tuple:
    param = next(model.parameters(), None)
    where = (param.dtype, str(param.device)) if param is not None else (None, None)
    return (*where, getattr(model.config, "_attn_implementation", None))


def probe_prompts(vocab_size: int) -> list[list[int]]:
    """The probe's prompts: fixed pseudo-random ids in ``[min(3, vocab), vocab)`` (past the usual special ids)."""
    generator = torch.Generator().manual_seed(20240611)
    low = min(3, vocab_size - 1)
    return [torch.randint(low, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _run(decoder: Any) -> Verdict:
    name = model_type(decoder.hf_config)
    hf, layers = decoder.hf, decoder_layers(decoder.hf)
    prompts = probe_prompts(decoder.config.vocab_size)
    ref_tokens, ref_logits, ref_hidden = [], [], []
    for prompt in prompts:
        tokens, logits, hidden = _reference(hf, layers, prompt)
        ref_tokens.append(tokens)
        ref_logits.append(logits)
        ref_hidden.append(hidden)
    try:
        got_logits, got_hidden, calls = _through_piecegraph(decoder, layers, prompts, ref_tokens)
    except UnsupportedModelError as err:  # piecegraph's attention refused what the model asked of it
        return Verdict(name, False, str(err))
    except Exception as err:  # noqa: BLE001  (any failure of the flat forward is a refusal, named)
        return Verdict(name, False, f"model_type {name!r}: its forward fails under piecegraph's flat attention "
                                    f"({type(err).__name__}: {str(err).strip()[:300]})")
    problem = _attention_calls(name, calls, calls_per_layer(decoder, layers))
    if problem:
        return Verdict(name, False, problem)
    return _compare(name, decoder, layers, ref_tokens, ref_logits, ref_hidden, got_logits, got_hidden)


def _hooks(layers: list[torch.nn.Module], into: list[list[torch.Tensor]]) -> list[Any]:
    def hook(i: int):
        def record(module: torch.nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            into[i].append(out.detach().reshape(-1, out.shape[-1]).float())
        return record
    return [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]


def _reference(hf: torch.nn.Module, layers: list, prompt: list[int]) -> tuple[list[int], torch.Tensor, list]:
    """The model's own greedy tokens after ``prompt`` (full forwards, no cache), and the logits and every
    layer's hidden states of the last forward (over ``prompt`` and all but the last greedy token)."""
    device = next(hf.parameters()).device
    numbered = _takes_position_ids(hf)
    ids, tokens = list(prompt), []
    hidden: list[list[torch.Tensor]] = [[] for _ in layers]
    for step in range(NEW_TOKENS):
        last = step == NEW_TOKENS - 1
        handles = _hooks(layers, hidden) if last else []
        try:
            positions = {"position_ids": torch.arange(len(ids), device=device)[None]} if numbered else {}
            logits = hf(input_ids=torch.tensor([ids], device=device), use_cache=False, **positions).logits[0].float()
        finally:
            for h in handles:
                h.remove()
        tokens.append(int(logits[-1].argmax()))
        if not last:
            ids.append(tokens[-1])
    return tokens, logits, [rows[-1] for rows in hidden]  # a layer run more than once (loops): its last run


def _takes_position_ids(hf: torch.nn.Module) -> bool:
    """Whether transformers' ``generate`` passes ``hf`` position ids (a decoder-only model whose forward takes them:
    its ``_prepare_position_ids_for_generation`` then counts them from 0 for an unpadded prompt)."""
    try:
        takes = "position_ids" in inspect.signature(hf.forward).parameters
    except (TypeError, ValueError):
        return False
    return takes and not getattr(hf.config, "is_encoder_decoder", False)


def _through_piecegraph(decoder: Any, layers: list, prompts: list[list[int]], ref_tokens: list[list[int]]
                        ) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[tuple[int, Any]]]:
    """Per prompt, the logits and every layer's hidden states of a packed prefill and decode steps fed the
    reference tokens, through the wrapped model on a paged cache (torch backend); and the attention calls made
    (decoder layer, ``layer_idx``)."""
    from transformers import AttentionInterface

    param = next(decoder.hf.parameters())
    longest = max(map(len, prompts)) + NEW_TOKENS
    cache = KVCache.for_sequences(decoder.config, len(prompts), longest, PAGE_SIZE, dtype=param.dtype,
                                  device=param.device, backend="torch")
    steps: list[list[list[torch.Tensor]]] = []  # per step, per layer: [rows, hidden]
    logits: list[torch.Tensor] = []
    calls: list[tuple[int, Any]] = []
    current = [-1]
    mapping = AttentionInterface._global_mapping
    own = mapping[NAME]

    def counting(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        mask = args[3] if len(args) > 3 else kwargs.get("attention_mask")
        calls.append((current[0], getattr(module, "layer_idx", None) if is_flat(mask, kwargs) else DROPPED))
        return own(module, *args, **kwargs)

    def enter(i: int):
        return lambda module, args: current.__setitem__(0, i)

    per_layer: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = _hooks(layers, per_layer) + [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(layers)]
    mapping[NAME] = counting
    try:
        for step in range(NEW_TOKENS):
            if step == 0:
                meta = AttentionMetadata.for_batch(cache, [(i, 0, len(p)) for i, p in enumerate(prompts)])
                ids = [t for p in prompts for t in p]
            else:
                meta = AttentionMetadata.for_decode(cache, [(i, len(p) + step - 1) for i, p in enumerate(prompts)])
                ids = [ref[step - 1] for ref in ref_tokens]
            with forward_context(meta):
                hidden = decoder(torch.tensor(ids, device=param.device), meta.positions)
            logits.append(decoder.logits(hidden[: len(ids)]).float())
            steps.append([rows.pop() for rows in per_layer])
    finally:
        mapping[NAME] = own
        for h in handles:
            h.remove()
    lens = [len(p) for p in prompts]
    return _per_prompt(logits, lens), [_per_prompt(list(layer), lens) for layer in zip(*steps)], calls


def _per_prompt(steps: list[torch.Tensor], lens: list[int]) -> list[torch.Tensor]:
    """Rows of a packed prefill and of decode steps (one row per prompt) regrouped per prompt, in order."""
    prefill = steps[0][: sum(lens)].split(lens)
    return [torch.cat([prefill[i]] + [s[i: i + 1] for s in steps[1:]]) for i in range(len(lens))]


def _attention_calls(name: str, calls: list[tuple[int, Any]], expected: list[int]) -> str:
    """Why the attention calls of the probe's forwards show a layer piecegraph does not run, or "". ``expected``:
    per decoder layer, the calls per forward it was given cache layers for (:mod:`piecegraph.hf.multi_call`)."""
    num_layers = len(expected)
    dropped = sorted({layer for layer, idx in calls if idx is DROPPED})
    if dropped:
        return (f"model_type {name!r}: decoder layers {dropped} call attention without the keyword arguments or the "
                "attention mask the base model was given, so piecegraph's flat forward cannot reach their attention")
    per_forward = len(calls) // NEW_TOKENS if calls else 0
    first = calls[:per_forward]
    counts = [sum(1 for layer, _ in first if layer == i) for i in range(num_layers)]
    missing = [i for i, n in enumerate(counts) if n == 0]
    if missing:
        return (f"model_type {name!r}: decoder layers {missing} never call transformers' attention interface (a "
                "recurrent, convolutional or linear-attention layer, or attention computed in the modeling code): "
                "piecegraph's paged attention would not run there")
    many = [i for i, n in enumerate(counts) if n != expected[i]]
    if many or len(calls) != NEW_TOKENS * sum(expected):
        return (f"model_type {name!r}: decoder layers {many or 'some'} call the attention interface more than once "
                f"per forward ({counts} calls per layer, where a cache layer was given to {expected} of them when "
                "wrapped); piecegraph's paged cache holds one attention per call")
    indices = [idx for _, idx in dict.fromkeys(first)]  # a module called again (its own cache layer) counts once
    if sorted(i for i in indices if isinstance(i, int)) != list(range(num_layers)):
        return (f"model_type {name!r}: its attention modules' layer_idx are {indices}, not one per layer "
                f"(0..{num_layers - 1}): layers sharing or skipping a KV cache are not supported")
    return ""


def _error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(relative error by norm, largest absolute difference)."""
    diff = (got - want).abs()
    return (diff.norm() / want.norm().clamp_min(1e-30)).item(), diff.max().item()


def _compare(name: str, decoder: Any, layers: list, ref_tokens: list, ref_logits: list, ref_hidden: list,
             got_logits: list, got_hidden: list) -> Verdict:
    dtype = next(decoder.hf.parameters()).dtype
    tol = TOLERANCE.get(dtype, 5e-2)
    got_shape, want_shape = tuple(torch.cat(got_logits).shape), tuple(torch.cat(ref_logits).shape)
    if got_shape != want_shape:
        return Verdict(name, False, f"model_type {name!r}: piecegraph's output head gives logits of shape {got_shape}, "
                                    f"the model's own forward {want_shape} (its output head computes more than the "
                                    "modules piecegraph found for it). It is refused rather than run wrong",
                       tolerance=tol)
    rel, biggest = _error(torch.cat(got_logits), torch.cat(ref_logits))
    layer, layer_rel, layer_abs = None, 0.0, 0.0
    for i in range(len(layers)):
        r, a = _error(torch.cat(got_hidden[i]), torch.cat([h[i] for h in ref_hidden]))
        if r > tol:
            layer, layer_rel, layer_abs = i, r, a
            break
    found = dict(tolerance=tol, logits_error=rel, logits_max_abs=biggest, layer=layer, layer_error=layer_rel,
                 layer_max_abs=layer_abs, tokens=sum(map(len, ref_tokens)))
    wrong = _token_mismatch(ref_tokens, ref_logits, got_logits, tol)
    if rel <= tol and layer is None and not wrong:
        return Verdict(name, True, **found)
    where = (f"decoder layer {layer} ({type(layers[layer]).__name__}) is the first whose hidden states differ: "
             f"relative error {layer_rel:.3g}, largest absolute {layer_abs:.3g}" if layer is not None else
             "every decoder layer's hidden states agree, but the logits do not (the model's output head computes "
             "more than lm_head, a logit scale and a final softcap)")
    tokens = f"; greedy tokens differ ({wrong})" if wrong else ""
    return Verdict(name, False, f"model_type {name!r}: piecegraph's attention does not reproduce the model's own "
                                f"forward on a probe prompt (tolerance {tol:g} for "
                                f"{str(dtype).removeprefix('torch.')}): {where}; "
                                f"logits relative error {rel:.3g}, largest absolute {biggest:.3g}{tokens}. "
                                "It is refused rather than run wrong", **found)


def _token_mismatch(ref_tokens: list, ref_logits: list, got_logits: list, tol: float) -> str:
    """The first greedy token piecegraph would pick differently from the model (not a near-tie), or ""."""
    for p, (tokens, want, got) in enumerate(zip(ref_tokens, ref_logits, got_logits)):
        start = want.shape[0] - len(tokens)
        for j, token in enumerate(tokens):
            row_want, row_got = want[start + j], got[start + j]
            mine = int(row_got.argmax())
            margin = (row_want[token] - row_want[mine]).item()
            if mine != token and margin > tol * row_want.abs().max().item():
                return f"probe prompt {p}, step {j}: the model picks {token}, piecegraph {mine}"
    return ""


ENV = "PIECEGRAPH_HF_VERIFY"


def enabled(verify: bool | None) -> bool:
    """Whether to run :func:`verify`: ``verify`` when given, else on unless the environment variable
    ``PIECEGRAPH_HF_VERIFY`` is ``0`` (or ``false`` / ``no`` / ``off``): a switch for users who checked their
    model already."""
    if verify is not None:
        return bool(verify)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")
