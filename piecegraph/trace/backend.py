"""The trace stage's program builder: split the Dynamo graph at split ops, compile each piece once, wrap for capture."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode

from ..config import Config
from ..graphs.capture import GraphedPiece
from ..graphs.memory import GraphMemory, estimate_graph_memory
from ..ops.split import split_op_names
from ..program import CaptureState, PieceInfo, Program
from .aot_load import bind_pieces
from .aot_package import PackageRecorder
from .handover import CompiledPieces, cut_fingerprint, offer, take
from .inputs import (
    UnsupportedGraph,
    classify_inputs,
    fake_value,
    token_outputs,
    token_symbols,
    traced_token_count,
)
from .mixing import MixingOp, find_token_mixing
from .mutation import mutated_inputs
from .same_pieces import fresh_outputs, piece_key
from .split import split_graph
from .static import compile_static, returns_one_value

log = logging.getLogger("piecegraph")


def _compile_piece(sub: torch.fx.GraphModule, fake_args: list[Any], compiler: str,
                   packages: PackageRecorder | None = None, has_split_op: bool = False) -> Callable[..., Any]:
    if compiler == "eager":
        return sub
    packaged = packages.compile(sub, fake_args, has_split_op) if packages is not None else None
    if packaged is not None:
        return packaged
    fn = _inductor_compile(sub, fake_args)
    if packages is not None:
        packages.compiled(fn)
    return fn


def _inductor_compile(sub: torch.fx.GraphModule, fake_args: list[Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    # AOTAutograd's cache key hashes the module's attribute dict as pickled, in insertion order, and a piece built
    # under Dynamo (a cold start: lazy recompilation re-inserts _code last) orders it differently from one built
    # from the cache's restored graph (a warm start): every first warm start missed that cache (Inductor's FX
    # cache still hit) and re-ran AOTAutograd's trace. A fresh module with its attributes in sorted order.
    fresh = torch.fx.GraphModule(sub, sub.graph, class_name=type(sub).__name__)
    attributes = sorted(vars(fresh).items())
    vars(fresh).clear()
    vars(fresh).update(attributes)
    # Called positionally, like the submodule it replaces (compile_fx unflattens non-tuple outputs itself).
    return compile_fx(fresh, list(fake_args))


def _compile_pieces(
    split_gm: torch.fx.GraphModule, infos: list[PieceInfo], fake_args: list[Any], fake_mode: Any, config: Config,
    token_symbols: Any, sizes: tuple[int, ...], packages: PackageRecorder | None = None,
) -> tuple[dict[str, Callable[..., Any]], dict[str, dict[int, Callable[..., Any]]], float]:
    """Propagate fake values through ``split_gm`` and compile each non-split piece for its symbolic inputs (with
    ``packages``: packaged by AOTInductor where it can), and again per static compile size in ``sizes``
    (``{piece: {size: fn}}``, with the seconds those took)."""
    wanted = {info.name for info in infos if info.compiled}
    compiled: dict[str, Callable[..., Any]] = {}
    static: dict[str, dict[int, Callable[..., Any]]] = {}
    seconds = [0.0]
    done: dict[tuple, str] = {}  # piece_key -> the first piece compiled for it (see trace/same_pieces.py)
    ran: dict[tuple, tuple[Any, list[Any]]] = {}  # piece_key -> that piece's fake outputs and inputs

    class _Compiler(torch.fx.Interpreter):
        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            key = writes = None
            if target in wanted:
                sub = getattr(split_gm, target)
                key, writes = piece_key(sub, list(args)), mutated_inputs(sub)  # read before Inductor rewrites sub
                twin = done.get(key) if key is not None else None
                if twin is not None:
                    log.debug("piecegraph: %s is the same program as %s: compiled once", target, twin)
                    compiled[target] = compiled[twin]
                    if twin in static:
                        static[target] = static[twin]
                    outputs = fresh_outputs(*ran[key]) if key in ran and not kwargs else None
                    if outputs is not None:  # the twin's fake run stands for this one's
                        return outputs
                else:
                    log.debug("piecegraph: compiling %s", target)
                    single = returns_one_value(sub)  # read before Inductor rewrites it (see compile_static)
                    compiled[target] = _compile_piece(sub, list(args), config.compiler, packages)
                    if sizes:
                        static[target], took = compile_static(sub, list(args), token_symbols, sizes, target,
                                                              single)
                        seconds[0] += took
                    if key is not None:
                        done[key] = target
            outputs = super().call_module(target, args, kwargs)
            if key is not None and key not in ran and not writes:  # one that writes its inputs runs each time
                ran[key] = (outputs, list(args))
            return outputs

    # Under the Python dispatcher, as Dynamo and AOTAutograd run graphs on fakes: without it a C++ composite
    # kernel may read concrete sizes (torch 2.11's matmul does, in transformers' rotary embedding), which
    # specialises the token count and fails the trace with a ConstraintViolationError.
    with fake_mode, enable_python_dispatcher():
        _Compiler(split_gm).run(*fake_args)
    return compiled, static, seconds[0]


def _static_sizes(config: Config, token_symbols: Any, works_along_tokens: bool) -> tuple[int, ...]:
    """The sizes that get a static compile: none for a static trace (it is one already) or the eager compiler.
    Under ``compile_sizes="reductions"``: every capture size when the program reduces or works along the token
    dimension outside split ops (``works_along_tokens``) and the choice per size will be measured (CUDA, real
    graphs), else none."""
    if not token_symbols or config.compiler != "inductor":
        return ()
    if config.compile_sizes == "reductions":
        measured = torch.cuda.is_available() and not config.emulate_graphs
        return config.sizes if measured and works_along_tokens else ()
    return config.static_compile_sizes


def build_program(gm: torch.fx.GraphModule, example_inputs: list[Any], config: Config,
                  packages: PackageRecorder | None = None, offered: CompiledPieces | None = None) -> Program:
    """Split ``gm`` (mode piecewise / none) or keep it whole (mode full), compile, and wrap pieces for capture.

    ``example_inputs`` are what Dynamo hands a backend. Every compiled piece is compiled once, for the symbolic
    token count, under the fake mode of the trace. ``packages``: compile by AOTInductor packages where the
    program allows (see trace/aot_package.py). ``offered``: another program's compiled pieces (its
    ``Program.offered``, trace/handover.py), which ``mode="full"`` compiled by pieces takes instead of compiling
    when its cut is the same program (``Program.took_pieces``). Returns a :class:`Program`; nothing is captured
    yet; a piecewise program offers its compiled pieces in ``Program.offered``.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds, sym, names, caller = classify_inputs(placeholders, config.token_dim)
    fake_args = [fake_value(n) for n in placeholders]
    fake_mode = next((a.fake_mode for a in fake_args if hasattr(a, "fake_mode")), None)
    if fake_mode is None:
        fake_mode = detect_fake_mode(example_inputs)
        fake_mode = fake_mode or torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
    # Fill in only the inputs the trace kept no fake value for: fakes made anew from the real inputs would have
    # the trace's sizes as constants, and running the symbolic graph on them specialises the token count.
    missing = [name for name, a in zip(names, fake_args) if a is None]
    fake_args = [(fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x) if a is None else a
                 for a, x in zip(fake_args, example_inputs)]
    if missing:
        log.debug("piecegraph: no fake value recorded for graph inputs %s; made from the real ones", missing)
    num_tokens = None if sym else traced_token_count(example_inputs, kinds, config.token_dim)
    # The ops working along the token dimension: they decide padding (below) and static code ("reductions")
    wanted = sym and (config.token_mixing != "pad" or config.compile_sizes == "reductions")
    found = find_token_mixing(gm, sym) if wanted else []
    mixing = _token_mixing(found, config)
    state = CaptureState.for_config(config)
    written = mutated_inputs(gm)
    # Measuring runs a piece several times on the same arguments and captures it into a throwaway graph: only
    # for programs that write no input, and never for mode="full", whose one graph holds the split ops (they may
    # plan or write state that only their own capture may touch).
    measure = config.compile_sizes in ("auto", "reductions") and not written and config.mode != "full"
    static_sizes = _static_sizes(config, sym, bool(found))
    if packages is not None:
        _refuse_packages(packages, config, sym, static_sizes, written)
    offers, took, by_pieces = None, False, False
    if config.mode == "full":
        infos = [PieceInfo("graph", False, sum(1 for n in gm.graph.nodes if n.op == "call_function"))]
        single = returns_one_value(gm)
        by_pieces = _compiles_by_pieces(config, packages, static_sizes)
        if by_pieces and packages is not None:  # in the background (else refused): the worker packages the whole
            with fake_mode:  # graph, so a warm start runs it fused across the split ops, as full_compile="whole"
                packages.compile(gm, fake_args, has_split_op=True)
            # "auto": a graph that cannot be packaged would stay by pieces for good, so it compiles whole
            by_pieces = config.full_compile == "pieces" or packages.active
        if by_pieces:
            fn, took = _compiled_by_pieces(gm, fake_args, fake_mode, config, sym, offered)
            if packages is not None:
                packages.compiled(fn)
        else:
            with fake_mode:
                fn = _compile_piece(gm, fake_args, config.compiler, packages, has_split_op=True)
        static, static_s = compile_static(gm, fake_args, sym, static_sizes, "graph", single) if static_sizes \
            else ({}, 0.0)
        pieces = [GraphedPiece("graph", fn, state, static, measure)]
        call = pieces[0]
    else:
        split_gm, infos = split_graph(gm, split_op_names(config.split_ops))
        if packages is not None:
            packages.keep_skeleton(split_gm, infos)
        fingerprint = cut_fingerprint(split_gm, infos, fake_args)  # before compiling: Inductor rewrites pieces
        compiled, statics, static_s = _compile_pieces(split_gm, infos, fake_args, fake_mode, config, sym,
                                                      static_sizes, packages)
        offers = offer(fingerprint, config.compiler, compiled)
        graphed = {info.name: GraphedPiece(info.name, compiled[info.name], state, statics.get(info.name), measure)
                   for info in infos if info.name in compiled}
        call = bind_pieces(split_gm, infos, graphed)
        pieces = list(graphed.values())
    if static_s:
        log.info("piecegraph: static compiles for sizes %s took %.1f s", static_sizes, static_s)
    return Program(
        call=call,
        state=state,
        pieces=pieces,
        infos=infos,
        kinds=kinds,
        token_outputs=token_outputs(gm, config.token_dim, sym, num_tokens),
        dynamic=bool(sym),
        names=names,
        caller_inputs=caller,
        token_mixing=mixing,
        mutated_inputs=written,
        static_compile_s=static_s,
        offered=offers,
        took_pieces=took,
        by_pieces=by_pieces,
    )


def _compiles_by_pieces(config: Config, packages: PackageRecorder | None, static_sizes: tuple[int, ...]) -> bool:
    """Whether ``mode="full"`` compiles its graph by pieces: ``full_compile="pieces"``, or ``"auto"`` where a
    background worker will package the whole graph to swap in (Inductor only, no static compiles)."""
    if config.compiler != "inductor" or static_sizes:
        return False
    if config.full_compile == "auto":
        return packages is not None and packages.active and packages.background and packages.worker_expected
    return config.full_compile == "pieces"


def _refuse_packages(packages: PackageRecorder, config: Config, token_symbols: Any, static_sizes: tuple[int, ...],
                     written: list[int]) -> None:
    """Stop ``packages`` for a program whose code it cannot stand for (the units then compile as usual)."""
    if config.compiler != "inductor":
        packages.refuse(f"compiler={config.compiler!r}")
    elif not token_symbols:
        packages.refuse("the trace has a fixed token count")
    elif static_sizes:
        packages.refuse(f"static compiles for sizes {static_sizes} (compile_sizes)")
    elif written:
        packages.refuse("the program writes its inputs")
    elif config.mode == "full" and config.full_compile == "pieces" and not packages.background:
        packages.refuse("full_compile='pieces' packages in the background only (aot_background=True)")


def _compiled_by_pieces(gm: torch.fx.GraphModule, fake_args: list[Any], fake_mode: Any, config: Config,
                        token_symbols: Any, offered: CompiledPieces | None) -> tuple[Callable[..., Any], bool]:
    """``gm`` as ``Config(full_compile="pieces")`` compiles it for a full graph: cut at the split ops, each piece
    compiled as piecewise compiles it (identical pieces once), or taken from ``offered`` when that is the same cut
    (trace/handover.py), and the whole run as one plain function that the one :class:`GraphedPiece` of
    ``mode="full"`` captures, split ops included. Same inputs and outputs as ``gm``; also whether it took them."""
    split_gm, infos = split_graph(gm, split_op_names(config.split_ops))
    compiled = take(offered, split_gm, infos, fake_args, config.compiler)
    if compiled is not None:
        log.info("piecegraph: the full graph's pieces are the piecewise program's, compiled once for both")
        return bind_pieces(split_gm, infos, compiled), True
    if offered is not None:
        log.info("piecegraph: the full graph's cut differs from the offered program's; compiling its pieces")
    compiled, _, _ = _compile_pieces(split_gm, infos, fake_args, fake_mode, config, token_symbols, ())
    return bind_pieces(split_gm, infos, compiled), False


def graph_memory(gm: torch.fx.GraphModule, config: Config) -> GraphMemory | None:
    """The graphs' memory per capture size, estimated from ``gm`` before it is split or compiled (see
    graphs/memory.py); ``None`` for a mode without graphs or a static trace (one size, known at its capture)."""
    if config.mode not in ("piecewise", "full"):
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sym = token_symbols([fake_value(n) for n in placeholders], config.token_dim)
    if not sym:
        return None
    return estimate_graph_memory(gm, sym, config.sizes, split_op_names(config.split_ops), config.compiler,
                                 config.mode)


def _token_mixing(found: list[MixingOp], config: Config) -> list[MixingOp]:
    """Of the ops ``found`` working along the token dimension (none in a static trace: it only runs its own
    size), those that make padding unsafe: refused here under ``token_mixing="error"``, ignored under ``"pad"``."""
    if config.token_mixing == "pad":
        return []
    if found and config.token_mixing == "error":
        raise UnsupportedGraph(
            f"{found[0]} mixes rows over the token dimension{f' (and {len(found) - 1} more ops)' if found[1:] else ''}"
            "; padding a call to a capture size would change its result. Use Config(token_mixing='exact') to "
            "capture exact token counts only, or move the op into a split op."
        )
    return found
