"""Check a freshly captured size before trusting it: replay on fresh inputs, compare with no graphs."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Sequence

import torch

log = logging.getLogger("piecegraph")


def _fresh(x: Any, td: int, perm: torch.Tensor) -> Any:
    # Permuting rows keeps every value valid for the model (token ids stay ids), yet changes what each row holds,
    # so a value read on the host at capture time and baked into the graph shows up as a mismatch.
    if not isinstance(x, torch.Tensor):
        return x
    return x.index_select(td, perm.to(x.device))


def _rel_error(got: Sequence[Any], want: Sequence[Any], n: int, td: int, token_outputs: Sequence[bool]) -> float:
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


def verify_size(runner: Any, flat: Sequence[Any], padded: Sequence[Any], n: int, size: int, outputs: Any) -> Any:
    """Replay ``size`` on token inputs rolled by one row and compare with the same program without graphs.

    On a mismatch beyond ``config.verify_tol`` the size is dropped (its graphs freed, later calls run without a
    graph) and a warning names it. Either way the real inputs run last, so side effects (a KV-cache write) hold
    the real call's values; returns the real call's outputs.
    """
    td = runner.config.token_dim
    perm = torch.arange(n).roll(1)  # every row moves (a random permutation may leave the one that matters)
    fresh = [_fresh(x, td, perm) if i in runner.token_idx else x for i, x in enumerate(flat)]
    user_replays = runner.replays  # verification replays are not the user's
    staged = runner._stage(fresh, n, size)
    replayed = [o.clone() if isinstance(o, torch.Tensor) else o for o in runner._replay(staged, n, size)]
    reference = runner._run(staged)
    error = _rel_error(replayed, reference, n, td, runner.program.token_outputs)
    if error <= runner.config.verify_tol:
        log.info("piecegraph: verified size %d (rel. error %.2e)", size, error)
        outputs = runner._replay(runner._stage(flat, n, size), n, size)
        runner.replays = user_replays
        return outputs
    runner.replays = user_replays
    runner.dropped[size] = error
    runner.capture_s.pop(size, None)
    for piece in runner.program.pieces:
        piece.captured.pop(size, None)
    warnings.warn(
        f"piecegraph: size {size} replayed on fresh inputs differs from the same model without graphs "
        f"(rel. error {error:.2e} > verify_tol {runner.config.verify_tol}). Something read on the host at capture "
        "time was baked into the graph (a CPU tensor's values, a Python number from the context?). This size "
        "now runs without a graph; `piecegraph doctor` can locate the op.",
        stacklevel=4,
    )
    return runner._run(flat)
