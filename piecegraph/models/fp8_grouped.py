"""The ``"scaled_grouped_mm"`` kernel of :class:`~piecegraph.models.fp8_moe.FP8Experts`: e4m3 experts with one
scale per output channel through ``torch._scaled_grouped_mm``, or the model-dtype grouped GEMM, chosen per token
count by measurement.

- Weights: each expert's ``[N, K]`` matrix in e4m3 with a float32 scale per output row (``[E, N]``), kept
  ``[E, N, K]`` contiguous: its ``transpose(1, 2)`` is the column-major ``[E, K, N]`` operand torch requires.
- Activations: rows sorted by expert (group ends ``offs``, as :meth:`Experts._grouped`), quantized per row by one
  Triton kernel each (the gate/up input; the SwiGLU of the gate/up output and the down input's quantization are
  fused), so a pad row never changes a real row's scale.
- Choice: at build time, :func:`measure_table` times one expert layer both ways (CUDA graph replays, L2 flushed
  before each, CUDA-event medians) at 1, 2, 4, ... up to ``max_tokens`` tokens, once per (shape, device); FP8
  where it is faster, else the model-dtype path, whose weights are then kept beside the e4m3 ones. A call of ``T``
  tokens takes the choice of the smallest measured count ``>= T`` (the largest beyond them).
- Graphs: the sort, gather and combine are traced (Inductor fuses them); the branch on ``T`` and both paths are
  one opaque op (:func:`grouped_experts`), so Dynamo records one node while ``T`` is symbolic, and each captured
  size bakes in its own branch.

On CPU the FP8 path multiplies the same e4m3 values in float32 (the ``"torch"`` kernel's product with
per-channel scales) and the model-dtype path gathers each row's expert, so the choice and the dispatch are testable
there (with an injected ``timer``); a CUDA device where the native path does not run is refused by name
(:class:`~piecegraph.models.fp8_moe.FP8Experts`).
Error bound: :mod:`piecegraph.models.fp8`'s, per GEMM.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from piecegraph.models.fp8 import E4M3_MAX, FP8, quantize_rows
from piecegraph.models.fp8_grouped_triton import grouped_fp8_gemm
from piecegraph.ops.opaque import opaque
from piecegraph.ops.triton_support import triton_available

DEFAULT_MAX_TOKENS = 2048  # the engine's default max_num_batched_tokens
Timer = Callable[[str, int, Callable[[], Any]], float]  # (path "fp8" | "dense", tokens, run one layer) -> us


@dataclass(frozen=True)
class Pick:
    """One row of the choice table: at ``tokens`` tokens the layer runs ``kernel``: ``"fp8"`` (the e4m3 experts
    on ``torch._scaled_grouped_mm``), ``"fp8-triton"`` (on :mod:`~piecegraph.models.fp8_grouped_triton`'s kernel)
    or ``"dense"`` (the model-dtype experts); ``fp8_us`` / ``triton_us`` / ``dense_us`` are the measured medians
    in microseconds (``None``: not measured)."""

    tokens: int
    kernel: str
    fp8_us: float | None = None
    dense_us: float | None = None
    triton_us: float | None = None


def quantize_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``w [E, N, K]`` in e4m3 (contiguous), each output row scaled so its largest magnitude is
    448, and the float32 ``[E, N]`` scales that undo it."""
    scale = w.detach().abs().float().amax(-1).clamp(min=1e-12) / E4M3_MAX
    q = (w.detach().float() / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.contiguous(), scale.contiguous()


def token_sizes(max_tokens: int) -> list[int]:
    """``1, 2, 4, ...`` below ``max_tokens``, then ``max_tokens`` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sizes = [1 << i for i in range(max_tokens.bit_length()) if 1 << i < max_tokens]
    return sizes + [max_tokens]


def picks_fp8(tokens: int, sizes: list[int], use_fp8: list[bool]) -> bool:
    """The choice for ``tokens``: that of the smallest measured size ``>= tokens``, else of the largest."""
    return use_fp8[_size_index(tokens, sizes)]


def _size_index(tokens: int, sizes: list[int]) -> int:
    """The index of the smallest measured size ``>= tokens``, else of the largest."""
    for i, size in enumerate(sizes):
        if size >= tokens:
            return i
    return len(sizes) - 1


# ------------------------------------------------------------------------------------------------- CUDA kernels
@functools.cache
def _triton_kernels():
    """Two per-row quantizers (one program per row, the whole row in registers): of ``x``, and of
    ``silu(gate) * up`` from a ``[rows, 2W]`` gate/up output. float32 math, IEEE divisions, round to nearest."""
    import triton
    import triton.language as tl

    @triton.jit
    def _store_quantized(v, q, s, row, cols, mask, stride_q):
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12), 448.0)
        tl.store(s + row, scale)
        out = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)
        tl.store(q + row * stride_q + cols, out.to(q.dtype.element_ty), mask=mask)

    @triton.jit
    def quantize_rows_kernel(x, q, s, K, stride_x, stride_q, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        _store_quantized(v, q, s, row, cols, mask, stride_q)

    @triton.jit
    def swiglu_quantize_kernel(gu, q, s, W, stride_gu, stride_q, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < W
        gate = tl.load(gu + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu + row * stride_gu + W + cols, mask=mask, other=0.0).to(tl.float32)
        _store_quantized(gate * tl.sigmoid(gate) * up, q, s, row, cols, mask, stride_q)

    return quantize_rows_kernel, swiglu_quantize_kernel


def _launch(kernel: Any, src: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    rows = src.shape[0]
    q = torch.empty(rows, width, dtype=FP8, device=src.device)
    s = torch.empty(rows, dtype=torch.float32, device=src.device)
    if rows:
        block = triton.next_power_of_2(width)
        kernel[(rows,)](src, q, s, width, src.stride(0), q.stride(0), BLOCK=block,
                        num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)
    return q, s


def quantize_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~piecegraph.models.fp8.quantize_rows` of ``x [rows, K]`` (row-major), in one Triton kernel on CUDA."""
    if x.device.type == "cuda" and triton_available() and x.stride(-1) == 1:
        return _launch(_triton_kernels()[0], x, x.shape[1])
    return quantize_rows(x)


def swiglu_quantize(gate_up: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(silu(gate) * up)`` in float32 for ``gate_up [rows, 2 * width]`` (gate columns first), in
    one Triton kernel on CUDA."""
    if gate_up.device.type == "cuda" and triton_available() and gate_up.stride(-1) == 1:
        return _launch(_triton_kernels()[1], gate_up, width)
    g = gate_up[:, :width].float()
    return quantize_rows(nn.functional.silu(g) * gate_up[:, width:].float())


# ---------------------------------------------------------------------------------------------------- the paths
def _fp8_gemm(q: torch.Tensor, scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ends: torch.Tensor,
              expert: torch.Tensor, native: bool, triton: bool = False) -> torch.Tensor:
    """Sorted rows ``q [M, K]`` (per-row ``scale``) times their expert's ``w [E, N, K]`` (``w_scale [E, N]``):
    on the Triton kernel (``triton``), ``torch._scaled_grouped_mm`` (``native``) or in float32."""
    if triton:
        return grouped_fp8_gemm(q, scale, w, w_scale, ends)
    if native:
        return torch._scaled_grouped_mm(q, w.transpose(1, 2), scale, w_scale, offs=ends, out_dtype=torch.bfloat16)
    y = torch.bmm(w.index_select(0, expert).float(), q.float().unsqueeze(-1)).squeeze(-1)
    return y * (scale.unsqueeze(-1) * w_scale.index_select(0, expert))


def _fp8_mlp(xs, ends, expert, gate_up, gate_up_scale, down, down_scale, width, native, triton=False):
    q, scale = quantize_input(xs)
    gu = _fp8_gemm(q, scale, gate_up, gate_up_scale, ends, expert, native, triton)
    q, scale = swiglu_quantize(gu, width)
    return _fp8_gemm(q, scale, down, down_scale, ends, expert, native, triton).to(xs.dtype)


def _dense_mlp(xs, ends, expert, gate_up, down, width, grouped):
    def gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if grouped:  # torch._grouped_mm (bf16 on CUDA), as Experts._grouped
            return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)
        return torch.bmm(w.index_select(0, expert), a.unsqueeze(-1)).squeeze(-1)

    gu = gemm(xs, gate_up)
    return gemm(nn.functional.silu(gu[:, :width]) * gu[:, width:], down)


@opaque(fake="like:xs", name="fp8_grouped_experts")
def grouped_experts(xs: torch.Tensor, ends: torch.Tensor, expert: torch.Tensor, gate_up: torch.Tensor,
                    gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                    gate_up_dense: Optional[torch.Tensor], down_dense: Optional[torch.Tensor], width: int,
                    top_k: int, sizes: list[int], use_fp8: list[bool], use_triton: list[bool], native: bool,
                    grouped: bool) -> torch.Tensor:
    """The experts' SwiGLU on rows sorted by expert: ``xs [M, H]`` (``M = T * top_k``), ``ends`` int32 group ends,
    ``expert [M]`` each row's expert. FP8 (``gate_up``/``down`` e4m3 ``[E, N, K]``, scales ``[E, N]``) when
    :func:`picks_fp8` says so for ``T`` (on the Triton kernel where ``use_triton`` says so for ``T``), else the
    model-dtype weights (``gate_up_dense``/``down_dense``, which must then be given). ``native``:
    ``torch._scaled_grouped_mm`` (else its float32 product); ``grouped``:
    ``torch._grouped_mm`` for the dense path (else a gather). Returns a new ``[M, H]`` tensor in ``xs``' dtype.
    One opaque op: ``T`` is read here, eagerly, where it is a number."""
    pick = _size_index(xs.shape[0] // top_k, sizes)
    if use_fp8[pick]:
        return _fp8_mlp(xs, ends, expert, gate_up, gate_up_scale, down, down_scale, width, native, use_triton[pick])
    if gate_up_dense is None or down_dense is None:
        raise RuntimeError(f"the choice table picks the dense experts at {xs.shape[0] // top_k} tokens, but their "
                           "weights were dropped; build FP8Experts again (kernel='scaled_grouped_mm')")
    return _dense_mlp(xs, ends, expert, gate_up_dense, down_dense, width, grouped)


# ----------------------------------------------------------------------------------------------- the measurement
def cuda_graph_us(path: str, tokens: int, run: Callable[[], Any], repeats: int = 20) -> float:
    """Median microseconds of one replay of a CUDA graph of ``run()`` (captured after two warm-up calls on a side
    stream), with L2 flushed before each replay, as a layer's weights are cold after the other layers ran.
    ``path`` and ``tokens`` are not used: they are the :data:`Timer` signature's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # JIT builds and workspaces before capture
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")  # above any L2
    times = []
    for i in range(repeats + 3):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times)


_TABLES: dict[tuple, tuple[Pick, ...]] = {}  # (shape, device, max_tokens, timer) -> table: one per model shape


def measure_table(layer: Callable[..., torch.Tensor], key: tuple, *, hidden: int, num_experts: int, top_k: int,
                  dtype: torch.dtype, device: torch.device, max_tokens: int, timer: Timer | None,
                  triton: bool = False) -> tuple[Pick, ...]:
    """The choice table of a layer shape: for each of :func:`token_sizes`, ``timer(path, tokens, run)`` of the
    whole layer on random inputs forced to each path (``layer(x, ids, weights, sizes, use_fp8, use_triton)``):
    ``"fp8"``, ``"dense"`` and, with ``triton``, ``"fp8-triton"``; the fastest wins, a tie going to the dense path
    and then to ``torch._scaled_grouped_mm``. Cached under ``key`` (every layer of a model shares it). ``timer``
    None: nothing is measured and every size picks ``"fp8"`` (the times stay ``None``)."""
    cache_key = (*key, str(device), max_tokens, timer, triton)
    if cache_key in _TABLES:
        return _TABLES[cache_key]
    sizes = token_sizes(max_tokens)
    if timer is None:
        return _TABLES.setdefault(cache_key, tuple(Pick(n, "fp8") for n in sizes))
    gen = torch.Generator(device=device).manual_seed(0)
    paths = {"dense": ([False], [False]), "fp8": ([True], [False]), **({"fp8-triton": ([True], [True])}
                                                                      if triton else {})}
    picks = []
    for n in sizes:
        x = torch.randn(n, hidden, generator=gen, device=device).to(dtype)
        ids = torch.rand(n, num_experts, generator=gen, device=device).topk(top_k, dim=-1).indices
        weights = torch.softmax(torch.randn(n, top_k, generator=gen, device=device), -1).to(dtype)
        with torch.no_grad():
            us = {path: timer(path, n, functools.partial(layer, x, ids, weights, [1], *flags))
                  for path, flags in paths.items()}
        best = min(us, key=us.get)  # dict order breaks ties: dense, then fp8
        picks.append(Pick(n, best, round(us["fp8"], 2), round(us["dense"], 2),
                          round(us["fp8-triton"], 2) if triton else None))
    return _TABLES.setdefault(cache_key, tuple(picks))


def _ragged_groups(device: str) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """What both run-time checks share: a seeded generator and 21 rows over 3 experts (expert 1 gets no row;
    ragged groups), as each row's expert and the int32 group ends."""
    expert = torch.tensor([0] * 5 + [2] * 16, device=device)
    ends = torch.tensor([5, 5, 21], dtype=torch.int32, device=device)
    return torch.Generator(device=device).manual_seed(0), expert, ends


def _mismatch(run: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor], limit_log2: int) -> str | None:
    """The error ``run`` or ``reference`` raises, or ``run``'s relative distance from ``reference`` when it is not
    below ``2 ** limit_log2``; ``None`` when it is."""
    try:
        got, want = run().float(), reference().float()
    except Exception as exc:  # noqa: BLE001  (a torch without the kernel, a Triton that cannot build: not chosen)
        return f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    rel = ((got - want).norm() / want.norm()).item()
    if rel < 2.0**limit_log2:
        return None
    return f"relative error {rel:.3g} against the float32 product (limit 2^{limit_log2})"


@functools.cache
def native_failure(device: str) -> str | None:
    """Why the native FP8 path is not used on ``device`` (``"cuda:0"``): the error or the mismatch of the check
    :func:`scaled_grouped_mm_runs` describes, or ``None`` when it passed. Checked once per device."""
    gen, expert, ends = _ragged_groups(device)
    e, n, k, width = 3, 64, 48, 32
    xs = torch.randn(21, k, device=device, generator=gen).to(torch.bfloat16)
    gate_up, gu_scale = quantize_channels(torch.randn(e, n, k, device=device, generator=gen))
    down, d_scale = quantize_channels(torch.randn(e, k, width, device=device, generator=gen))
    mlp = functools.partial(_fp8_mlp, xs, ends, expert, gate_up, gu_scale, down, d_scale, width)
    return _mismatch(lambda: mlp(True), lambda: mlp(False), -5)


@functools.cache
def triton_gemm_failure(device: str) -> str | None:
    """Why the Triton FP8 GEMM is not measured on ``device``: no Triton, not CUDA, or its product of a small
    ragged case (an empty group) off the float32 one by more than e4m3 and bf16 rounding; ``None`` when it runs."""
    if not device.startswith("cuda") or not triton_available():
        return "needs Triton on a CUDA device"
    gen, expert, ends = _ragged_groups(device)
    q, scale = quantize_rows(torch.randn(21, 48, device=device, generator=gen))
    w, w_scale = quantize_channels(torch.randn(3, 64, 48, device=device, generator=gen))
    return _mismatch(lambda: grouped_fp8_gemm(q, scale, w, w_scale, ends),
                     lambda: _fp8_gemm(q, scale, w, w_scale, ends, expert, native=False), -7)


def scaled_grouped_mm_runs(device: torch.device | str) -> bool:
    """Whether the FP8 path runs natively on ``device``: CUDA sm90, ``torch._scaled_grouped_mm`` present, and a
    small layer (ragged groups, an empty one) equal to its float32 product within bf16 and e4m3 rounding (checked
    once per device; a torch or CUDA build without it raises or is wrong: then it is not chosen). Call eagerly."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return native_failure(str(device)) is None
