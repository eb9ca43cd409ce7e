"""A step's new keys and values written into their paged caches by one kernel, not two ``index_copy_`` calls.

At batch 1 a full decode graph of a 16-layer model spent 71 us of its ~1.25 ms (H100) in the 32 ``index_copy_``
kernels that write K and V, about 2.2 us each whatever their size: one Triton kernel per layer writes both and
halves the launches. ``write_kv`` takes it on CUDA where Triton imports and the rows are laid out as the kernel
reads them (heads and head dims contiguous within a row, any row stride: a slice of a fused QKV output is fine),
and ``index_copy_`` everywhere else, with the same result: each row's values, cast to the cache's dtype, land at
its slot. Triton is imported only when the kernel runs (CPU installs and CI have none).
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from piecegraph.ops.triton_support import next_power_of_two, triton_available


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, k_row_stride, v_row_stride,
                        K_WIDTH: tl.constexpr, V_WIDTH: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        offs = tl.arange(0, BLOCK_K)
        keys = tl.load(k_ptr + row * k_row_stride + offs, mask=offs < K_WIDTH)
        tl.store(kc_ptr + slot * K_WIDTH + offs, keys.to(kc_ptr.dtype.element_ty), mask=offs < K_WIDTH)
        offs = tl.arange(0, BLOCK_V)
        values = tl.load(v_ptr + row * v_row_stride + offs, mask=offs < V_WIDTH)
        tl.store(vc_ptr + slot * V_WIDTH + offs, values.to(vc_ptr.dtype.element_ty), mask=offs < V_WIDTH)

    return write_kv_kernel


def _rows_contiguous(x: torch.Tensor) -> bool:
    """Each row of ``x [N, H, D]`` one contiguous run of ``H * D`` elements (rows may sit apart)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def fused_write_runs(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether :func:`write_kv` takes the one-kernel path for these tensors (else ``index_copy_``)."""
    on_device = k.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter: CPU tests only
    if not on_device or k.shape[0] == 0 or not (_rows_contiguous(k) and _rows_contiguous(v)):
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    if k_cache.shape[1:] != k.shape[1:] or v_cache.shape[1:] != v.shape[1:]:
        return False  # index_copy_ says what is wrong
    return triton_available()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, fused: bool = True) -> None:
    """``k [N, Hkv, D]`` and ``v [N, Hkv, Dv]`` into ``k_cache [S, Hkv, D]`` and ``v_cache [S, Hkv, Dv]`` (a paged
    cache viewed by flat slot) at rows ``slots [N]``, cast to each cache's dtype; the caches are written in place,
    ``k`` and ``v`` only read. Slots must be in range (neither path checks them on the device); rows sharing a
    slot (graph pad rows, all on the scratch page) leave one of them there, as ``index_copy_`` does.
    ``fused=False`` forces the two ``index_copy_``. The kernel compiles at its first call per signature: during
    a CUDA-graph capture use :class:`KVWriter`, which never compiles there."""
    if fused and fused_write_runs(k, v, k_cache, v_cache):
        k_width, v_width = k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]
        _kernel()[(k.shape[0],)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), K_WIDTH=k_width,
                                 V_WIDTH=v_width, BLOCK_K=next_power_of_two(k_width),
                                 BLOCK_V=next_power_of_two(v_width))
        return
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


class KVWriter:
    """:func:`write_kv` that takes the kernel during a CUDA-graph capture only for a call signature it has run
    eagerly before (warm-up runs do): Triton compiles a kernel per dtypes, widths and the 16-byte alignment of
    its pointers and strides, and a compile must never happen inside a capture. Unseen there: ``index_copy_``."""

    def __init__(self) -> None:
        self.seen: set[tuple] = set()
        self.failed: dict[tuple, str] = {}  # signatures whose kernel would not build: index_copy_ for good

    def __call__(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        tensors = (k, v, k_cache, v_cache, slots)
        signature = (tuple(t.dtype for t in tensors), k.shape[1:], v.shape[1:],
                     tuple(t.data_ptr() % 16 == 0 for t in tensors), k.stride(0) % 16 == 0, v.stride(0) % 16 == 0)
        if signature in self.failed or (_capturing(k) and signature not in self.seen):
            write_kv(*tensors, fused=False)
            return
        if signature in self.seen:
            write_kv(*tensors)
            return
        try:  # the first call of a signature builds the kernel: a build that fails leaves the caches untouched
            write_kv(*tensors)
        except Exception as exc:  # noqa: BLE001  (a Triton or driver that cannot build it: the copies still can)
            self.failed[signature] = f"{type(exc).__name__}: {exc}"[:300]
            warnings.warn(f"piecegraph: the one-kernel KV write did not build ({self.failed[signature]}); this "
                          "cache writes keys and values with index_copy_ instead", stacklevel=3)
            write_kv(*tensors, fused=False)
            return
        self.seen.add(signature)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()

