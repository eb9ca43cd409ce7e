"""Checking a freshly captured size before trusting it (``FlatRunner._verify``): fresh inputs, the comparison, the
warning."""

from __future__ import annotations

from typing import Any, Sequence

import torch


def rolled_token_inputs(flat: Sequence[Any], token_idx: Sequence[int], n: int, td: int) -> list[Any]:
    """``flat`` with every token input's rows rolled by one along ``td``: every row moves (a random permutation
    may leave the one that matters), every value stays valid for the model (token ids stay ids), yet a value read
    on the host at capture time and baked into the graph shows up as a mismatch."""
    perm = torch.arange(n).roll(1)
    return [x.index_select(td, perm.to(x.device)) if i in token_idx and isinstance(x, torch.Tensor) else x
            for i, x in enumerate(flat)]


def rel_error(got: Sequence[Any], want: Sequence[Any], n: int, td: int, token_outputs: Sequence[bool]) -> float:
    """The worst ``||a - b|| / ||b||`` over the outputs (token outputs cut to ``n`` rows); inf where finiteness
    differs."""
    worst = 0.0
    for a, b, is_token in zip(got, want, token_outputs):
        if not isinstance(a, torch.Tensor):
            continue
        if is_token:
            a, b = a.narrow(td, 0, n), b.narrow(td, 0, n)
        a, b = a.double(), b.double()
        if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
            return float("inf")
        a, b = torch.nan_to_num(a), torch.nan_to_num(b)
        worst = max(worst, ((a - b).norm() / b.norm().clamp_min(1e-30)).item())
    return worst


def verify_tolerance(configured: float | None, outputs: Sequence[Any]) -> float:
    """``configured``, or by the outputs' precision: 1e-4 for float32/float64, 5e-2 when any is half precision
    (on the H200 a 24-layer bf16 decoder's FlashInfer outputs differed by 1.4e-2 between batch sizes: rounding)."""
    if configured is not None:
        return configured
    half = any(isinstance(o, torch.Tensor) and o.dtype in (torch.float16, torch.bfloat16) for o in outputs)
    return 5e-2 if half else 1e-4


def dropped_warning(size: int, error: float, tol: float) -> str:
    return (
        f"piecegraph: size {size} replayed on fresh inputs differs from the same model without graphs and "
        f"without padding (rel. error {error:.2e} > verify_tol {tol}). Something read on the host at capture "
        "time was baked into the graph (a CPU tensor's values, a Python number from the context?), or an op "
        "mixes the padded rows into the real ones. This size now runs without a graph; `piecegraph doctor` "
        "can locate the op."
    )
