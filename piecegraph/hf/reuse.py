"""What :func:`piecegraph.hf.generate` keeps between calls, and the CPU defaults it picks.

A second ``generate`` call on the same model reuses the :class:`~piecegraph.hf.Session` the first built (its
wrapper, checked once; its KV cache; its traced, compiled and captured modules) instead of building one again. The
session is kept on the model (an attribute that copies and pickles as empty) and between calls the model is given
back as it was (:meth:`HFDecoder.suspend` / :meth:`HFDecoder.resume`). It is dropped, and a new one built, when
the model's weights change (another tensor, a moved or cast one, or one written in place), when the call asks for
another mode or options, or when the model was wrapped or unwrapped by someone else meanwhile. A call for more
sequences or longer ones than the kept session holds builds one large enough for both. ``reuse=False`` (or
:func:`forget`) drops it.

On CPU there are no CUDA graphs, so ``mode="graphs"`` would run Inductor-compiled pieces (tens of seconds of
compile for a 135M model on 2 cores, more than the whole answer takes eager): a call that names no ``mode`` and no
compile option runs ``mode="eager"`` there (the wrapped model as it is, piecegraph's paged attention; the same
tokens). GPU calls keep ``mode="graphs"``. Naming ``mode`` (or any compile option) overrides it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger("piecegraph.hf")

ATTR = "_piecegraph_session"


class _Kept:
    """The kept session and what it was built for; copies and pickles as empty (a copy builds its own)."""

    def __init__(self, session: Any = None, key: Any = None, stamp: Any = None) -> None:
        self.session, self.key, self.stamp = session, key, stamp

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.session = self.key = self.stamp = None

    def __deepcopy__(self, memo: dict) -> "_Kept":
        return _Kept()


def model_device(model: Any) -> torch.device:
    """The device of the model's first parameter (CPU when it has none)."""
    hf = getattr(model, "hf", model)
    param = next(iter(hf.parameters()), None) if isinstance(hf, torch.nn.Module) else None
    return param.device if param is not None else torch.device("cpu")


def default_mode(model: Any, options: dict) -> str:
    """``"graphs"`` on a GPU, or whenever a compile option is given; ``"eager"`` on CPU otherwise (logged)."""
    device = model_device(model)
    if device.type == "cuda" or options:
        return "graphs"
    # INFO, at each call: shown only where the caller turned logging up, so it never floods a loop of calls
    log.info("piecegraph.hf.generate on CPU: mode='eager' (no CUDA graphs to capture there; compiling the "
             "pieces costs more than it saves for one answer); pass mode='graphs' or 'none' to compile")
    return "eager"


def stamp(model: Any) -> tuple:
    """What must not change for a kept session to stay valid: each parameter and buffer's identity, storage,
    dtype, device and in-place write count."""
    hf = getattr(model, "hf", model)
    rows = []
    for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
        try:
            version = t._version
        except RuntimeError:  # an inference tensor has no version counter
            version = None
        rows.append((name, id(t), t.data_ptr(), t.dtype, t.device, version))
    return tuple(rows)


def forget(model: Any) -> None:
    """Close and drop the session ``generate`` kept on ``model`` (if any)."""
    kept = getattr(model, "__dict__", {}).pop(ATTR, None)
    if kept is not None and kept.session is not None:
        kept.session.close()


def run(model: Any, build: Callable[[int, int], Any], call: Callable[[Any], Any], *, max_seqs: int, max_len: int,
        key: Any, reuse: bool) -> Any:
    """``call(session)`` on the session kept on ``model`` when it is still valid for ``key`` and large enough,
    else on ``build(max_seqs, max_len)`` (kept when ``reuse``, closed after the call otherwise)."""
    if not reuse:
        forget(model)
        with build(max_seqs, max_len) as session:
            return call(session)
    kept = model.__dict__.get(ATTR)
    session = kept.session if kept is not None else None
    if session is not None:
        fits = session.max_seqs >= max_seqs and session.max_len >= max_len
        if not (fits and kept.key == key and kept.stamp == stamp(model) and session.resume()):
            max_seqs, max_len = max(max_seqs, session.max_seqs), max(max_len, session.max_len)
            forget(model)
            session = None
    if session is None:
        session = build(max_seqs, max_len)
        model.__dict__[ATTR] = _Kept(session, key)
    try:
        return call(session)
    except BaseException:
        forget(model)
        raise
    finally:
        kept = model.__dict__.get(ATTR)
        if kept is not None and kept.session is session:
            session.suspend()
            kept.stamp = stamp(model)
