"""Argument helpers every stage shares: a value described for an error message, which call arguments are token
inputs, and the model's buffers kept across extra runs. Imports only torch and the standard library."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def describe(value: Any, depth: int = 2) -> str:
    """``value`` for an error message: a tensor by dtype, shape and device (never its values, which can be huge or
    on a device), tuples, lists and dicts item by item (the first 8, two levels deep), anything else by its repr
    cut to 80 characters.

    Example: ``describe((torch.zeros(8, 16), None))`` is ``"(tensor(shape=(8, 16), dtype=float32, device=cpu), None)"``.
    """
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"tensor(shape={tuple(value.shape)}, dtype={dtype}, device={value.device})"
    if isinstance(value, (tuple, list, dict)):
        return _describe_items(value, depth - 1) if depth > 0 else f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe_items(value: tuple | list | dict, depth: int) -> str:
    is_dict = isinstance(value, dict)
    items = list(value.items()) if is_dict else list(enumerate(value))
    parts = [(f"{k!r}: " if is_dict else "") + describe(v, depth) for k, v in items[:8]]
    if len(items) > 8:
        parts.append(f"... {len(items) - 8} more")
    inner = ", ".join(parts)
    if is_dict:
        return "{" + inner + "}"
    if isinstance(value, list):
        return "[" + inner + "]"
    return "(" + inner + ("," if len(items) == 1 else "") + ")"


def token_arguments(values: dict[str, Any], token_dim: int, static_inputs: tuple[str, ...] = ()) -> set[str]:
    """The names of the call's token inputs: tensors whose dim ``token_dim`` equals the first such tensor's
    (not named in ``static_inputs``). Any other tensor is a static input: never marked dynamic, never padded.

    A static tensor whose size there happens to equal the token count cannot be told apart from one call; name it
    in ``Config(static_inputs=...)``. Taken for a token input, it is still never silently wrong: a later call of
    another token count fails naming it, and an op that mixes its rows is a token-mixing op (exact sizes only)."""
    unknown = set(static_inputs) - set(values)
    if unknown:
        raise TypeError(f"Config.static_inputs names {sorted(unknown)}, which the model was not called with; "
                        f"its arguments are {list(values)}")
    candidates = [(k, v) for k, v in values.items()
                  if isinstance(v, torch.Tensor) and v.dim() > token_dim and k not in static_inputs]
    if not candidates:
        return set()
    n = candidates[0][1].shape[token_dim]
    return {k for k, v in candidates if v.shape[token_dim] == n}


def check_token_dim(values: dict[str, Any], token_dim: int, static_inputs: tuple[str, ...] = ()) -> None:
    """Refuse a ``token_dim`` that no tensor argument has: every input would be taken for a static one, and the
    model would run without graphs, silently. 0-d tensors (a scalar) and ``static_inputs`` do not count."""
    tensors = {k: v for k, v in values.items()
               if isinstance(v, torch.Tensor) and v.dim() > 0 and k not in static_inputs}
    if not tensors or any(v.dim() > token_dim for v in tensors.values()):
        return
    name, first = next(iter(tensors.items()))
    raise ValueError(
        f"token_dim={token_dim} is beyond the inputs' dimensions: input {name!r} has shape {tuple(first.shape)} (dims "
        f"0..{first.dim() - 1}). token_dim must be the dim that counts tokens in the token inputs, e.g. "
        f"Config(token_dim=0) for (tokens, hidden) inputs"
    )


# A buffer this large is a weight (FP8 weights and their scales are buffers): a copy of every one would double the
# model on the device, so the large ones are watched through their version counters instead of copied.
COPY_LIMIT_BYTES = 16 << 20


@contextlib.contextmanager
def kept_buffers(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block the model may run any number of times; afterwards every buffer holds (and every buffer
    slot points at) what it held before: a counter or BatchNorm's statistics count the caller's calls only.

    Buffers under :data:`COPY_LIMIT_BYTES` are copied on their device and restored. Larger ones (weights) are not
    copied: one written in place inside the block raises ``RuntimeError`` naming it, since its old value is gone;
    an inference tensor, which keeps no version counter, is copied to host memory instead."""
    saved, watched = [], []
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            large = buf.numel() * buf.element_size() >= COPY_LIMIT_BYTES
            if large and not buf.is_inference():
                watched.append((module, name, buf, buf._version))
            else:
                saved.append((module, name, buf, buf.to("cpu", copy=True) if large else buf.clone()))
    failed = False
    try:
        yield
    except BaseException:
        failed = True  # the block's own error is the one to see, not the check below
        raise
    finally:
        for module, name, buf, value in saved:
            module._buffers[name] = buf  # a forward that re-assigned the buffer gets the original back
            buf.copy_(value)
        changed = [name for module, name, buf, version in watched if buf._version != version]
        for module, name, buf, _ in watched:
            module._buffers[name] = buf
        if changed and not failed:
            raise RuntimeError(
                f"the model wrote its large buffer(s) {', '.join(changed)} in place during piecegraph's own runs "
                f"(trace, warm-up, capture); buffers of {COPY_LIMIT_BYTES >> 20} MiB or more are taken for weights "
                f"and are not copied, so their values before those runs are lost. Keep state the forward updates "
                f"in smaller buffers, or update it outside the compiled forward")
