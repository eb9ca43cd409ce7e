"""``bmm_fp8`` shaped like FlashInfer's (``A [b, m, k]`` e4m3, ``B [b, k, n]`` column-major e4m3, per-tensor scales,
the output dtype, a ``backend`` Literal), behind the decorator, its loader in the call: the FP8 decoders'
``"flashinfer"`` kernel path on CPU, where FlashInfer does not run."""

from typing import Literal, Optional

import torch

from .loaders import get_module
from .utils import api


@api(backends=("cublas", "cutlass", "auto"))
def bmm_fp8(A: torch.Tensor, B: torch.Tensor, A_scale: torch.Tensor, B_scale: torch.Tensor, dtype: torch.dtype,
            out: Optional[torch.Tensor] = None, backend: Literal["cublas", "cutlass", "auto"] = "cublas"
            ) -> torch.Tensor:
    """``(A @ B) * A_scale * B_scale`` in ``dtype``, products of the e4m3 values summed in float32."""
    mod = get_module("bmm_fp8", A.dtype)
    y = (mod.run(torch.bmm, A.float(), B.float()) * (A_scale * B_scale)).to(dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
