"""Staging a call for its graphs: the caller's tensors copied into static buffers, the padded tail zeroed, the
inputs the program writes saved and restored around piecegraph's own runs, and copied back to the caller."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from ..program import ArgSpec, InputKind, Program, TokenCountMismatch, describe


class Staging:
    """The static inputs a program's graphs read, and the copies in and out of them.

    A graph reads the addresses it was captured with, so every call's tensors are copied in: token inputs into
    buffers allocated once at the largest capture size (rows ``n..size`` zeroed), static inputs the caller passes
    (a temperature, a table) into a copy made on first use. The caller's tensors are written only where the model
    writes its inputs, once per call, as eager would (:meth:`write_back`); piecegraph's own runs (warm-up, capture,
    verification) work on saved copies that are restored afterwards.
    """

    def __init__(self, program: Program, token_dim: int, names: Sequence[str]):
        self.program = program
        self.token_dim = token_dim
        self.names = list(names)  # inputs' labels in errors: the caller's argument names once bound
        self.token_idx = [i for i, k in enumerate(program.kinds) if k is InputKind.TOKENS]
        self.count_idx = [i for i, k in enumerate(program.kinds) if k is InputKind.COUNT]
        self.caller_static_idx: list[int] = []  # static inputs the caller passes (not parameters): staged too
        self.set_caller_statics(program.caller_inputs)
        self.buffers: list[torch.Tensor] | None = None
        self.buffer_specs: list[ArgSpec] = []
        self.views: dict[int, list[torch.Tensor]] = {}  # size -> the buffers' first ``size`` rows
        self.accepted: set[tuple] = set()  # (input, ArgSpec.key) already checked against the buffers
        self.caller_statics: dict[int, torch.Tensor] = {}
        self.caller_static_specs: dict[int, ArgSpec] = {}
        self.written: set[int] = set(program.mutated_inputs)  # inputs seen written: copied back to the caller

    def set_caller_statics(self, indices: Sequence[int]) -> None:
        """Static inputs at ``indices`` come from the caller: graphs read piecegraph's copy, refilled every call."""
        self.caller_static_idx = [i for i in indices if i not in self.token_idx and i not in self.count_idx]

    # -- reading the call -------------------------------------------------------------------------------
    def num_tokens(self, flat: Sequence[Any]) -> int:
        """The call's token count: dim ``token_dim`` of every token input, which must agree."""
        td = self.token_dim
        first = self.token_idx[0]
        for i in self.token_idx:
            x = flat[i]
            if not isinstance(x, torch.Tensor) or x.dim() <= td:
                raise ValueError(f"input {self.names[i]} is {describe(x)}: it has no dim token_dim={td}; every token "
                                 f"input needs one (the dim that counts tokens), as when the model was traced")
        counts = [flat[i].shape[td] for i in self.token_idx]
        n = counts[0]
        for i, c in zip(self.token_idx, counts):
            if c != n:
                raise TokenCountMismatch(
                    f"inputs {self.names[first]} and {self.names[i]} disagree on the token count "
                    f"(dim {td}: {n} vs {c}); every token input needs the same number of rows. If "
                    f"{self.names[i]} is not token-aligned (a memory, a table), name it in "
                    f"Config(static_inputs=({self.names[i]!r},))",
                    dict(zip(self.token_idx, counts)),
                )
        if n == 0:
            raise ValueError(f"input {self.names[first]} has no tokens (dim {td} is 0)")
        return n

    def with_count(self, flat: Sequence[Any], n: int) -> Sequence[Any]:
        """``flat`` with the token-count inputs (the symbolic size, passed as an int) set to ``n``."""
        if not self.count_idx:
            return flat
        flat = list(flat)
        for i in self.count_idx:
            flat[i] = n
        return flat

    # -- copies in --------------------------------------------------------------------------------------
    def stage(self, flat: Sequence[Any], n: int, size: int, largest: int) -> list[Any]:
        """The inputs a graph of ``size`` reads for a call of ``n`` tokens: views of the static buffers (allocated
        on first use at ``largest`` rows), the call's rows copied in and the rest zeroed."""
        td = self.token_dim
        if self.buffers is None:
            self.buffers = [_buffer_like(flat[i], td, largest) for i in self.token_idx]
            # The buffers pin dtype, device and every size but the token count from now on.
            self.buffer_specs = [ArgSpec.of(self.names[i], buf, td) for i, buf in zip(self.token_idx, self.buffers)]
        padded = list(flat)
        views = self.views.get(size)
        if views is None:
            views = self.views[size] = [buf.narrow(td, 0, size) for buf in self.buffers]
        for i, buf, spec, view in zip(self.token_idx, self.buffers, self.buffer_specs, views):
            x = flat[i]
            key = (i, spec.key(x))
            if key not in self.accepted:
                spec.check(x)
                self.accepted.add(key)
            if size > n:
                buf.narrow(td, 0, n).copy_(x)
                buf.narrow(td, n, size - n).zero_()  # garbage in pad rows can leak NaN into real rows
            else:
                view.copy_(x)
            padded[i] = view
        for i in self.count_idx:
            padded[i] = size
        for i in self.caller_static_idx:  # graphs read our copy: a new tensor next call is copied in, not theirs
            x = flat[i]
            if isinstance(x, torch.Tensor):
                if i not in self.caller_statics:  # once: graphs bake this buffer's address in
                    self.caller_statics[i] = torch.empty_like(x, memory_format=torch.contiguous_format)
                    self.caller_static_specs[i] = ArgSpec.of(self.names[i], x, None)
                self.caller_static_specs[i].check(x)
                self.caller_statics[i].copy_(x)
                padded[i] = self.caller_statics[i]
        return padded

    # -- piecegraph's own runs --------------------------------------------------------------------------
    def save_written(self, padded: Sequence[Any]) -> dict[int, torch.Tensor]:
        """Copies of the inputs the program may write in place, before a size's extra runs: those the trace
        shows written (trace/mutation.py); for a program over an eager model, every staged input (its module
        state is kept by ``program.keep_state``)."""
        idx = set(self.program.mutated_inputs)
        if self.program.keep_state is not None:
            idx |= set(self.token_idx) | set(self.caller_static_idx)
        return {i: padded[i].clone() for i in sorted(idx) if isinstance(padded[i], torch.Tensor)}

    @staticmethod
    def restore(padded: Sequence[Any], saved: dict[int, torch.Tensor]) -> None:
        for i, value in saved.items():
            padded[i].copy_(value)

    def extra_runs(self) -> contextlib.AbstractContextManager[None]:
        """Around runs that are piecegraph's own: an eager model's buffers are kept (``program.keep_state``)."""
        keep = self.program.keep_state
        return keep() if keep is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def recording_writes(self, padded: Sequence[Any], saved: dict[int, torch.Tensor]) -> Iterator[None]:
        """Inputs among ``saved`` that the block writes in place are written by the model: copied back on every
        call from now on. Version counters tell, since an in-place write bumps them even when only recorded."""
        versions = {i: padded[i]._version for i in saved}
        try:
            yield
        finally:
            self.written |= {i for i, v in versions.items() if padded[i]._version != v}

    # -- copies out -------------------------------------------------------------------------------------
    def write_back(self, flat: Sequence[Any], padded: Sequence[Any], n: int) -> None:
        """The model wrote a token input or a caller static in place: so does this call, into the caller's
        tensor, as eager would (the graphs wrote piecegraph's staged copy)."""
        td = self.token_dim
        for i in self.written:
            if i in self.token_idx:
                flat[i].narrow(td, 0, n).copy_(padded[i].narrow(td, 0, n))
            elif i in self.caller_static_idx and isinstance(flat[i], torch.Tensor):
                flat[i].copy_(padded[i])


def _buffer_like(x: torch.Tensor, td: int, largest: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[td] = largest
    return torch.zeros(shape, dtype=x.dtype, device=x.device)
