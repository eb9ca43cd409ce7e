"""The shared types of a traced program: its inputs, its pieces and their capture state."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol

import torch


class InputKind(enum.Enum):
    """What a flat input of a program is, which decides how the runner stages it."""

    TOKENS = "tokens"  # tensor whose token dim is the symbolic token count: copied into padded static buffers
    COUNT = "count"  # the symbolic token count itself, passed as an int
    STATIC = "static"  # parameters, buffers, constants: must keep their address across replays


class TokenCountMismatch(ValueError):
    """Token inputs of one call disagree on the token count: ``sizes`` maps each input's index to its count."""

    def __init__(self, message: str, sizes: dict[int, int]):
        super().__init__(message)
        self.sizes = sizes


class Phase(enum.Enum):
    """What the pieces do on the call in flight; the runner sets it before every call."""

    RUN = "run"  # compiled piece, no graph (mode none, above the largest size, tracing)
    WARMUP = "warmup"  # eager run of a size before its capture
    CAPTURE = "capture"  # capture this size, then replay once so the outputs hold real values
    REPLAY = "replay"


@dataclass
class CaptureState:
    """What the owning runner tells its pieces about the call in flight; one per program, never global."""

    phase: Phase = Phase.RUN
    size: int = 0
    emulate: bool = False  # replay by re-running on the captured buffers (tests graph semantics on CPU)
    check_addresses: bool = True
    pool: Any = None
    stream: Any = None
    moved_inputs: int = 0  # replays that had to copy a moved input in

    @classmethod
    def for_config(cls, config: Any) -> "CaptureState":
        """The state a program starts with under ``config`` (a :class:`piecegraph.Config`): the one place it is
        made, for traced and breakable programs alike."""
        return cls(emulate=config.emulate_graphs, check_addresses=config.check_addresses)


@dataclass(frozen=True)
class PieceInfo:
    """One submodule of the split graph: a compilable piece, or a split op run eagerly."""

    name: str
    is_split: bool
    num_ops: int

    @property
    def compiled(self) -> bool:
        """Whether the piece is compiled: it has ops, and is not a split op (which runs eagerly)."""
        return not self.is_split and self.num_ops > 0


class Piece(Protocol):
    """A piece of a program: called with its inputs, it runs, captures or replays as its ``CaptureState``
    says; ``drop()`` forgets every captured size."""

    def __call__(self, *args: Any) -> Any: ...

    def drop(self) -> None: ...


@dataclass
class Program:
    """A traced graph split into pieces, ready to run at any token count.

    ``call(*flat_inputs)`` runs the pieces (captured or replayed per ``state``) and the split ops (eager) in
    order, and returns the graph's outputs as a tuple. ``state`` is created with the program, and its runner sets
    it before every call.
    """

    call: Callable[..., Any]
    state: CaptureState
    pieces: list[Piece]
    infos: list[PieceInfo]
    kinds: list[InputKind]
    token_outputs: list[bool]
    dynamic: bool  # False when Dynamo traced a fixed token count: only that size can be captured
    names: list[str]  # the placeholders' source names, for error messages
    single_output: bool = False  # breakable programs: the model returned one tensor, not a tuple
    caller_inputs: list[int] = field(default_factory=list)  # the caller's tensors (not module state)
    token_mixing: list[Any] = field(default_factory=list)  # ops that make padding unsafe (trace/mixing.py)
    mutated_inputs: list[int] = field(default_factory=list)  # inputs the program writes in place
    static_compile_s: float = 0.0  # seconds of the extra static compiles (Config.compile_sizes)
    # trace/handover.py: the compiled pieces this program offers a program cut from the same trace (offered), and
    # whether this one took another's instead of compiling (took_pieces)
    offered: Any = None
    took_pieces: bool = False
    by_pieces: bool = False  # a full graph compiled by pieces (Config.full_compile): its package is swapped in
    # Programs over an eager model (breakable) whose buffers are not inputs: keeps them across extra runs.
    keep_state: Callable[[], ContextManager[None]] | None = None

    @property
    def num_pieces(self) -> int:
        return len(self.pieces)


@dataclass(frozen=True)
class ArgSpec:
    """What a tensor argument looked like when the model was traced: every later call must match it.

    ``shape`` has ``None`` at the token dimension of a token input (the only size that may change). A call that
    differs in dtype, device, rank or any other size raises naming the argument, on every path (graphs or not):
    the compiled code would cast, fail deep inside Inductor, or compute garbage. A non-contiguous tensor where a
    contiguous one was traced is copied (a correct fallback; the caller's tensor is untouched). The
    GraphedModule checks the call's arguments with it, the runner its token inputs against its static buffers.
    """

    name: str
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int | None, ...]
    contiguous: bool

    @classmethod
    def of(cls, name: str, t: torch.Tensor, token_dim: int | None) -> ArgSpec:
        shape = tuple(None if i == token_dim else s for i, s in enumerate(t.shape))
        return cls(name, t.dtype, t.device, shape, t.is_contiguous())

    @functools.cached_property
    def token_at(self) -> int | None:
        """The dim that may change (a token input's), or ``None``."""
        return self.shape.index(None) if None in self.shape else None

    def key(self, t: torch.Tensor) -> tuple:
        """What decides whether ``t`` matches: checked once per distinct key (every call computes it: kept cheap)."""
        shape, td = t.shape, self.token_at
        if td is not None and len(shape) > td:
            shape = shape[:td] + shape[td + 1:]
        return (t.dtype, t.device, t.dim(), shape)

    def check(self, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"input {self.name} was a tensor when the model was traced and is now "
                            f"{type(value).__name__}; pass a tensor, or compile another model")
        if value.dtype != self.dtype or value.device != self.device:
            raise ValueError(
                f"input {self.name} is {value.dtype} on {value.device}; the model was traced with {self.dtype} "
                f"on {self.device}. Convert it (x.to(...)) or compile another model for this dtype/device."
            )
        if value.dim() != len(self.shape):
            raise ValueError(f"input {self.name} has rank {value.dim()}; it was traced with rank {len(self.shape)}")
        sizes = tuple(s for s, want in zip(value.shape, self.shape) if want is not None)
        if sizes != tuple(s for s in self.shape if s is not None):
            traced = tuple("tokens" if s is None else s for s in self.shape)
            raise ValueError(
                f"input {self.name} has shape {tuple(value.shape)}; it was traced as {traced}"
                + (" (only the token dimension may change)" if None in self.shape else " (a static input)")
            )


