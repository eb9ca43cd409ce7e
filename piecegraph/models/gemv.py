"""Linear layers for a few rows (decode steps): a Triton GEMV-shaped kernel or cuBLAS, whichever measured faster.

``y [M, N] = x [M, K] @ w [N, K]^T (+ bias)`` for ``M <= MAX_ROWS``:

- Kernel (:func:`triton_linear`): each program owns ``BLOCK_N`` output features for all ``M`` rows; it streams its
  ``BLOCK_N`` weight rows (``K`` contiguous) once, loading the ``x`` tile once per ``K`` step. Below 16 rows it
  keeps a float32 lane per (row, feature, k) and sums the lanes across threads once, after the loop; with 16 rows
  ``tl.dot`` (float32 accumulation). The output is rounded once to ``x``'s dtype, after the bias. Configs
  (:data:`CONFIGS`) are autotuned per ``(N, K, row bucket, dtypes)``.
- Op (``torch.ops.piecegraph_models.small_linear``): one node for Dynamo (its fake gives the shape), and on CUDA
  the choice of the kernel per ``(N, K, row bucket, bias, dtype, device)``, measured once on first sight outside
  CUDA-graph capture (:func:`choice_table`). Without a measured choice inside a capture it runs cuBLAS: the
  measurement and Triton's autotuning launch many kernels and synchronize, which a capture must never see. So run
  each shape once eagerly before capturing (a warm-up step does) to get the measured choice in the graph.
- Modules: :class:`SmallBatchLinear` (an ``nn.Linear`` sharing its parameters) and :func:`use_small_batch_kernels`.

Triton is imported only when the kernel runs (CPU installs and CI have none): off CUDA, or without Triton, the op is
``torch.nn.functional.linear``. Defined on the DEF library of :mod:`piecegraph.attention.op` (as the MLA op), not
``torch.library.custom_op``: that one's FRAGMENT library broke ``torch.compile`` on torch 2.11 and costs ~2.4x
more per eager call (:mod:`piecegraph.ops.opaque`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from piecegraph.attention.op import LIBRARY
from piecegraph.graphs.capture import graph_ms
from piecegraph.ops.triton_support import next_power_of_two, triton_available

MAX_ROWS = 16  # the kernel's row tile: at most this many rows take the measured choice
KERNELS = ("auto", "cublas", "triton")
ENV = "PIECEGRAPH_SMALL_LINEAR"  # "cublas" / "triton" force a kernel for every call left at kernel="auto"
DEFAULT_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj",
                           "gate_up_proj", "down_proj", "lm_head"})
CALLS_PER_GRAPH = 20  # back-to-back calls per timed graph: launch gaps do not hide the kernels' time
REPLAYS = 5
MARGIN = 0.03  # Triton is chosen only when faster by more than this fraction (timing noise ties to cuBLAS)


# ------------------------------------------------------------------------------------------------------ kernel
def _prune(configs: list, named_args: dict, **kwargs: Any) -> list:
    """The configs a row tile can use: with 16 rows the ``tl.dot`` ones (``BLOCK_N >= 16``); below, the lane
    ones (``BLOCK_N < 16``) whose float32 lanes ``BLOCK_M * BLOCK_N * 8`` a thread stay within 64 registers."""
    block_m = {**named_args, **kwargs}["BLOCK_M"]
    if block_m >= 16:
        return [c for c in configs if c.kwargs["BLOCK_N"] >= 16]
    return [c for c in configs if c.kwargs["BLOCK_N"] < 16 and block_m * c.kwargs["BLOCK_N"] <= 8]


# (BLOCK_N, BLOCK_K, num_warps, num_stages). Lanes (BLOCK_N < 16, fewer than 16 rows): BLOCK_K = 256 * num_warps,
# so each thread loads 16 bytes per weight row and K step and the weight, x and lane tiles share one layout: no
# shared memory, barrier or shuffle in the loop and no spills (Triton 3.6's sm90 PTX, ptxas -v). Triton does not
# pipeline these loads (no cp.async; num_stages 1): the loads in flight come from many small programs per SM,
# which also gives N = 512 64..512 programs without splitting K. tl.dot (16 rows, BLOCK_N >= 16): loads pipelined.
CONFIGS = ((1, 1024, 4, 1), (2, 1024, 4, 1), (4, 1024, 4, 1), (8, 1024, 4, 1), (1, 2048, 8, 1), (2, 2048, 8, 1),
           (4, 2048, 8, 1), (2, 512, 2, 1), (4, 512, 2, 1), (8, 512, 2, 1),
           (16, 128, 4, 4), (16, 256, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (16, 512, 8, 3), (32, 256, 8, 3),
           (64, 128, 8, 3))


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """``(kernel, autotuned kernel)``: the first takes BLOCK_N, BLOCK_K, num_warps, num_stages from the caller."""
    import triton
    import triton.language as tl

    @triton.jit
    def small_linear_kernel(x, w, b, y, M, N, K, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features: rows of w
        m = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        n_ok = rows < N
        m_ok = m < M
        if BLOCK_M >= 16 and BLOCK_N >= 16:  # tensor cores on [M, K] and [N, K] tiles (loads pipelined)
            w_ptr = w + rows.to(tl.int64)[:, None] * K + ks[None, :]
            x_ptr = x + m.to(tl.int64)[:, None] * K + ks[None, :]
            w_ok, x_ok, k_at = n_ok[:, None], m_ok[:, None], ks[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:  # a float32 lane per (row, feature, k): 3-D tiles share one layout; one cross-thread sum at the end
            w_ptr = w + rows.to(tl.int64)[None, :, None] * K + ks[None, None, :]
            x_ptr = x + m.to(tl.int64)[:, None, None] * K + ks[None, None, :]
            w_ok, x_ok, k_at = n_ok[None, :, None], m_ok[:, None, None], ks[None, None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                wt = tl.load(w_ptr, mask=w_ok, other=0.0, eviction_policy="evict_first")  # read once
                xt = tl.load(x_ptr, mask=x_ok, other=0.0)
            else:
                k_ok = (k0 + k_at) < K
                wt = tl.load(w_ptr, mask=w_ok & k_ok, other=0.0, eviction_policy="evict_first")
                xt = tl.load(x_ptr, mask=x_ok & k_ok, other=0.0)
            if BLOCK_M >= 16 and BLOCK_N >= 16:
                acc += tl.dot(xt, tl.trans(wt))
            else:
                acc += xt.to(tl.float32) * wt.to(tl.float32)
            w_ptr += BLOCK_K
            x_ptr += BLOCK_K
        if BLOCK_M >= 16 and BLOCK_N >= 16:
            out_tile = acc
        else:
            out_tile = tl.sum(acc, axis=2)
        if HAS_BIAS:
            out_tile += tl.load(b + rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = y + m.to(tl.int64)[:, None] * N + rows[None, :]
        tl.store(out, out_tile.to(y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    even_k = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in CONFIGS]
    tuned = triton.autotune(configs, key=["N", "K", "BLOCK_M"], prune_configs_by={"early_config_prune": _prune})
    return even_k(small_linear_kernel), tuned(even_k(small_linear_kernel))


def row_bucket(rows: int) -> int:
    """The kernel's row tile for ``rows`` (1..MAX_ROWS): the next power of two."""
    return next_power_of_two(rows)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  config: Optional[tuple[int, int, int, int]] = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by the Triton kernel: ``x [M, K]`` (1 <= M <= MAX_ROWS) and ``weight [N, K]``
    contiguous, one dtype (bf16 or fp16 on CUDA; any float dtype under ``TRITON_INTERPRET=1``). Returns a new
    ``[M, N]`` tensor in ``x``'s dtype. ``config`` ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` skips autotuning
    (tests; the interpreter cannot time). Raises ValueError naming the argument that does not fit."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: need x [M, K] and weight [N, K]")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x has {x.shape[0]} rows; the kernel takes 1..{MAX_ROWS} (use F.linear beyond)")
    if x.is_cuda and x.dtype not in (torch.bfloat16, torch.float16):  # float32 would go through TF32 tl.dot
        raise ValueError(f"x is {x.dtype}: the kernel takes bfloat16 or float16 on CUDA")
    if not (x.is_contiguous() and weight.is_contiguous()) or weight.dtype != x.dtype:
        raise ValueError("x and weight must be contiguous and of one dtype; got "
                         f"{x.dtype} {x.stride()} and {weight.dtype} {weight.stride()}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{weight.shape[0]}] tensor in {x.dtype}; got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (x, weight, weight if bias is None else bias, y, m, n, k)
    plain, tuned = _kernels()
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        if config is None:
            tuned[lambda meta: (-(-n // meta["BLOCK_N"]),)](*args, HAS_BIAS=bias is not None, BLOCK_M=row_bucket(m))
        else:
            block_n, block_k, warps, stages = config
            plain[(-(-n // block_n),)](*args, HAS_BIAS=bias is not None, BLOCK_M=row_bucket(m), BLOCK_N=block_n,
                                       BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return y


# ------------------------------------------------------------------------------------------ the measured choice
@dataclass(frozen=True)
class Choice:
    """One measured row: which kernel a ``(N, K, rows bucket, bias, dtype, device)`` runs, and both per-call
    microseconds (CUDA-graph replays of CALLS_PER_GRAPH calls on weights that do not stay in L2)."""

    n: int
    k: int
    rows: int
    bias: bool
    dtype: str
    device: str
    kernel: str
    cublas_us: float
    triton_us: float
    error: str = ""  # why Triton was not chosen: not timed (out of memory, a build failure: times NaN), or wrong


# The measured-choice table, the module's one cache: key -> Choice, filled once per key by _measure (the op never
# measures during capture). choice_table() reports it; clear_choices() empties it (tests, a changed clock).
_CHOICES: dict[tuple, Choice] = {}


def choice_table() -> list[dict]:
    """Every measured choice so far, as dicts (the :class:`Choice` fields), sorted by shape: for reports."""
    return [asdict(c) for c in sorted(_CHOICES.values(), key=lambda c: (c.n, c.k, c.rows, c.bias, c.dtype))]


def clear_choices() -> None:
    """Forget every measured choice (the next eager call of each key measures again)."""
    _CHOICES.clear()


def _key(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple:
    return (weight.shape[0], weight.shape[1], row_bucket(x.shape[0]), bias is not None, str(x.dtype), str(x.device))


def _graph_us(calls: list[Callable[[], Any]]) -> float:
    """Median microseconds per call of ``calls`` run back to back as one CUDA graph (:func:`graph_ms`; its warm run
    builds and autotunes Triton's kernel and sets up cuBLAS's workspace before the capture)."""
    return graph_ms(lambda: [call() for call in calls], (), repeats=REPLAYS) * 1e3 / len(calls)


def _measure(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Choice:
    """Time both kernels at the bucket's row count on copies of ``weight`` spanning twice the L2 (the first is
    ``weight`` itself), as a decode step's weights arrive cold; record and return the choice."""
    key = _key(x, weight, bias)
    with torch.cuda.device(x.device), torch.no_grad():
        l2 = torch.cuda.get_device_properties(x.device).L2_cache_size
        size = weight.numel() * weight.element_size()
        copies = max(1, min(CALLS_PER_GRAPH, -(-2 * l2 // size)))
        weights = [weight] + [weight.clone() for _ in range(copies - 1)]
        rows = torch.randn(key[2], weight.shape[1], device=x.device).to(x.dtype)
        picks = [weights[i % copies] for i in range(CALLS_PER_GRAPH)]
        cublas = _graph_us([functools.partial(F.linear, rows, w, bias) for w in picks])
        triton_us = _graph_us([functools.partial(triton_linear, rows, w, bias) for w in picks])
        del weights, picks
        mismatch = _mismatch(rows, weight, bias)
    kernel = "triton" if triton_us < cublas * (1 - MARGIN) and not mismatch else "cublas"
    choice = Choice(*key, kernel=kernel, cublas_us=round(cublas, 3), triton_us=round(triton_us, 3), error=mismatch)
    return _CHOICES.setdefault(key, choice)


def _mismatch(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> str:
    """Why the Triton kernel's product of the timing rows is wrong, or ``""``: against the float32 product of the
    same values, within ``2**-7`` (bf16; ``2**-10`` fp16) of its largest magnitude plus one, twice the output's
    rounding. A kernel that disagrees is never chosen, whatever its speed."""
    reference = F.linear(rows.float(), weight.float(), None if bias is None else bias.float())
    bound = (2 ** -7 if rows.dtype == torch.bfloat16 else 2 ** -10) * (reference.abs().max().item() + 1)
    error = (triton_linear(rows, weight, bias).float() - reference).abs().max().item()
    return "" if error <= bound else f"Triton's product is off by {error:.3g} (bound {bound:.3g}): cuBLAS kept"


def _requested(kernel: str) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS}")
    if kernel == "auto":
        kernel = os.environ.get(ENV, "auto") or "auto"
        if kernel not in KERNELS:
            raise ValueError(f"{ENV}={kernel!r}: expected one of {KERNELS} (or unset)")
    return kernel


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether the Triton kernel takes these inputs (else F.linear runs); ``x``'s rows may be strided."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2 and weight.dim() == 2
            and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == weight.shape[1] and weight.shape[0] > 0
            and x.stride(-1) == 1 and weight.is_contiguous() and weight.dtype == x.dtype
            and weight.device == x.device
            and (bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0] and bias.dtype == x.dtype
                                  and bias.is_contiguous() and bias.device == x.device)))


def pick_kernel(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                kernel: str = "auto") -> str:
    """``"triton"`` or ``"cublas"`` (``F.linear``) for this call. Forced ``"triton"`` still falls back to
    F.linear where the kernel does not apply (not CUDA, not bf16/fp16, more than MAX_ROWS rows, a strided weight), and
    raises when Triton is missing. ``"auto"`` (and ``PIECEGRAPH_SMALL_LINEAR`` unset): the measured choice,
    measured now when eager (outside capture) and not yet known; cuBLAS during a capture without one, and where
    the measurement failed (no memory for its copies, a Triton build error: kept in the table's ``error``)."""
    kernel = _requested(kernel)
    if kernel == "cublas" or not _fits(x, weight, bias):
        return "cublas"
    if kernel == "triton":
        if not triton_available():
            raise RuntimeError(f"kernel='triton' (or {ENV}=triton) but Triton does not import; install triton or "
                               "use 'auto'")
        return "triton"
    if not triton_available():
        return "cublas"
    key = _key(x, weight, bias)
    choice = _CHOICES.get(key)
    if choice is None:
        if torch.cuda.is_current_stream_capturing():
            return "cublas"
        try:
            choice = _measure(x, weight, bias)
        except Exception as exc:  # noqa: BLE001  (no memory for the timing copies, a Triton that cannot build)
            error = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
            choice = _CHOICES.setdefault(key, Choice(*key, "cublas", float("nan"), float("nan"), error))
    return choice.kernel


# ---------------------------------------------------------------------------------------------------------- op
def _small_linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       use: str = "auto") -> torch.Tensor:
    if pick_kernel(x, weight, bias, use) == "triton":
        return triton_linear(x.contiguous(), weight, bias)  # rows picked from a longer tensor: a <= 16-row copy
    return F.linear(x, weight, bias)


def _small_linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                       use: str = "auto") -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


# "use", not "kernel": Inductor lowers the op as FallbackKernel.create(kernel, *args, **kwargs), and an argument
# named kernel collides with it (a LoweringException at the first compile).
LIBRARY.define("small_linear(Tensor x, Tensor weight, Tensor? bias=None, str use='auto') -> Tensor")
for _key_name in ("CPU", "CUDA"):
    LIBRARY.impl("small_linear", _small_linear_impl, _key_name)
torch.library.register_fake("piecegraph_models::small_linear", _small_linear_fake, lib=LIBRARY)
# small_linear(x [M, K], weight [N, K], bias [N] | None, kernel="auto") -> a new [M, N] in x's dtype: F.linear, or
# the Triton kernel where pick_kernel says so. No autograd (SmallBatchLinear calls F.linear when gradients are wanted).
small_linear = torch.ops.piecegraph_models.small_linear


# ----------------------------------------------------------------------------------------------------- modules
class SmallBatchLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :data:`small_linear` (any leading dims, flattened to rows). Build it
    with :meth:`from_linear`, which shares the Linear's Parameters. ``kernel``: ``"auto"`` (measured),
    ``"cublas"`` or ``"triton"``. With gradients wanted (grad mode on and a parameter or input requiring them)
    it is plain ``F.linear``: the op has no backward."""

    kernel: str = "auto"

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: str = "auto") -> "SmallBatchLinear":
        """A SmallBatchLinear holding ``linear``'s own ``weight`` and ``bias`` Parameters (no copy: tied weights
        stay tied, and loading into either changes both); ``linear``'s hooks are not carried over."""
        _requested(kernel)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.register_parameter("bias", linear.bias)
        self.kernel = kernel
        self.train(linear.training)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad):
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > MAX_ROWS and not torch.compiler.is_compiling():  # eager: no op dispatch for cuBLAS
            return F.linear(x, self.weight, self.bias)
        return small_linear(rows, self.weight, self.bias, self.kernel).reshape(*x.shape[:-1], self.out_features)


def _half_on_cuda(linear: nn.Linear) -> bool:
    return linear.weight.is_cuda and linear.weight.dtype in (torch.bfloat16, torch.float16)


def use_small_batch_kernels(model: nn.Module, names: Optional[Iterable[str]] = None, kernel: str = "auto",
                            require_cuda_half: bool = True) -> nn.Module:
    """Replace, in place, every child of ``model`` (at any depth) that is exactly ``nn.Linear`` (not a subclass)
    and named in ``names`` (default :data:`DEFAULT_NAMES`) by :meth:`SmallBatchLinear.from_linear` (parameters
    shared, so tied weights stay tied; one Linear under two names becomes one SmallBatchLinear). Only Linears
    whose weight is on CUDA in bf16/fp16 are replaced unless ``require_cuda_half=False`` (elsewhere the op is
    F.linear anyway): on a CPU or float32 model this is a no-op. Returns ``model``. Apply it before
    ``torch.compile`` / graph capture."""
    _requested(kernel)
    if isinstance(names, str):
        raise TypeError(f"names={names!r}: pass a collection of child names, e.g. [{names!r}]")
    wanted = DEFAULT_NAMES if names is None else frozenset(names)
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and name in wanted and (_half_on_cuda(child) or not require_cuda_half)]
    made: dict[int, SmallBatchLinear] = {}
    for parent, name, child in swaps:
        if id(child) not in made:
            made[id(child)] = SmallBatchLinear.from_linear(child, kernel)
        setattr(parent, name, made[id(child)])
    return model
