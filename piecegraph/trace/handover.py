"""A program's compiled pieces handed to another program cut from the same trace.

An engine's piecewise and full modules build from one Dynamo trace (``EngineConfig(share_trace=True)``), and with
``full_compile="pieces"`` the full module cuts that trace at the same split ops into the same pieces. Compiling
them a second time costs a fake-value pass through every piece and one Inductor cache hit per distinct piece
(1.1 s of the 0.5B shape's 2.5 s full-module setup on CPU). Instead the second program takes the first one's
compiled code, piece by piece, when the two cuts are the same program: the same split module code, each piece the
same graph node for node (read before compiling: Inductor rewrites the graphs it is given), the same inputs
(dtype, device, symbolic sizes and strides of every graph input, which with the graphs fix every piece's inputs),
and the same compiler. A piece holding a constant tensor or a submodule (values no key compares) hands nothing
over. Any difference, and the program compiles its own pieces, as before.

A compiled piece is a function of its arguments (Inductor's code allocates its outputs per call), so two programs
may call and capture it each on their own buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..program import PieceInfo
from .same_pieces import graph_key, input_key


@dataclass(frozen=True)
class CompiledPieces:
    """What one program offers another: its cut's fingerprint (:func:`cut_fingerprint`), the compiler that
    compiled it, and each compiled piece's code for a symbolic token count, by piece name."""

    fingerprint: tuple
    compiler: str
    fns: dict[str, Callable[..., Any]]


def cut_fingerprint(split_gm: torch.fx.GraphModule, infos: list[PieceInfo], fake_args: list[Any]) -> tuple | None:
    """What decides the code of ``split_gm``'s pieces: every graph input's fake metadata, the split module's code
    (how the pieces are wired), and each piece's name and graph (node for node, targets by identity: see
    :func:`~piecegraph.trace.same_pieces.graph_key`). ``None`` when an input or a compiled piece holds what the key
    cannot compare by value (a constant tensor, a submodule): then nothing is handed over. Call it before
    compiling the pieces."""
    inputs = tuple(input_key(a) for a in fake_args)
    if any(k is None for k in inputs):
        return None
    pieces = []
    for info in infos:
        sub = getattr(split_gm, info.name)
        graph = sub.code if info.is_split else graph_key(sub)  # a split op's piece is the caller's own, not taken
        if graph is None:
            return None
        pieces.append((info.name, info.is_split, graph))
    return inputs, split_gm.code, tuple(pieces)


def offer(fingerprint: tuple | None, compiler: str, compiled: dict[str, Callable[..., Any]]) -> CompiledPieces | None:
    """The pieces a program just compiled, as another program of the same cut may take them (``None``: none)."""
    return None if fingerprint is None else CompiledPieces(fingerprint, compiler, dict(compiled))


def take(offered: CompiledPieces | None, split_gm: torch.fx.GraphModule, infos: list[PieceInfo],
         fake_args: list[Any], compiler: str) -> dict[str, Callable[..., Any]] | None:
    """``offered``'s compiled pieces for ``split_gm`` (by name), or ``None`` when the cut differs in anything that
    decides their code (then compile). ``split_gm`` is not changed."""
    if offered is None or offered.compiler != compiler:
        return None
    if cut_fingerprint(split_gm, infos, fake_args) != offered.fingerprint:
        return None
    wanted = [info.name for info in infos if info.compiled]
    if any(name not in offered.fns for name in wanted):
        return None
    return {name: offered.fns[name] for name in wanted}
