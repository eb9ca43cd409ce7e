"""A wrapper class with a ``run`` method, shaped like FlashInfer's ``SegmentGEMMWrapper``: the model builds one
object (its workspace) and calls ``obj.run(...)``; the JIT loader runs inside the method. Automatic opaque must wrap
the method of that one object, not a module function."""

from typing import Optional

import torch

from .loaders import get_module

# Calls a GPU would have faulted on (a negative segment length or an end past the rows: FlashInfer's sm90 grouped
# GEMM raises an illegal instruction there, which ends the CUDA context). Raising alone would not model that:
# automatic opaque's probe catches a failing run and goes on. Tests assert this stays empty.
DEVICE_FAULTS: list = []


class SegmentGemm:
    """Grouped GEMM over row segments: rows ``seg_indptr[i]:seg_indptr[i+1]`` of ``x`` times ``weights[i]``."""

    def __init__(self, workspace: torch.Tensor, backend: str = "auto") -> None:
        self.workspace, self.backend = workspace, backend

    def run(self, x: torch.Tensor, weights: torch.Tensor, batch_size: int, weight_column_major: bool,
            out: Optional[torch.Tensor] = None, seg_indptr: Optional[torch.Tensor] = None,
            weight_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``y[rows of segment i] = x[rows] @ W[i]`` (``W[i]`` is ``weights[weight_indices[i]]`` when given;
        ``[d_out, d_in]`` when column major). Rows in no segment are zero."""
        mod = get_module("segment_gemm", x.dtype)
        d_out = weights.shape[1] if weight_column_major else weights.shape[2]
        y = torch.zeros(x.shape[0], d_out, dtype=x.dtype, device=x.device)
        bounds = seg_indptr.tolist()  # data-dependent segment sizes: fine eagerly, a break under Dynamo
        if any(hi < lo for lo, hi in zip(bounds, bounds[1:])) or min(bounds) < 0 or max(bounds) > x.shape[0]:
            DEVICE_FAULTS.append(bounds)
            raise RuntimeError(f"device fault: seg_indptr {bounds} over {x.shape[0]} rows")
        for i in range(batch_size):
            w = weights[int(weight_indices[i]) if weight_indices is not None else i]
            w = w.t() if weight_column_major else w
            lo, hi = bounds[i], bounds[i + 1]
            y[lo:hi] = mod.run(torch.matmul, x[lo:hi], w)
        if out is None:
            return y
        out.copy_(y)
        return out
