"""A stand-in for FlashInfer's paged-attention API, written from its documented semantics, for CPU tests.

It has the signatures of FlashInfer 0.5.3's ``BatchDecodeWithPagedKVCacheWrapper`` and
``BatchPrefillWithPagedKVCacheWrapper`` (NHD layout) and computes the same function with plain loops over the CSR
page layout (``indptr``/``indices``/``last_page_len``): the keys piecegraph wrote at its flat slots are read back
through the pages FlashInfer would read, so the two layouts must agree. In CUDA-graph mode (decode, and prefill
with fixed buffers), ``plan`` copies into the caller's buffers and ``run`` reads only those, as the real wrapper's
captured kernels do, so a backend that hands ``run`` anything else is caught. It never shares code with piecegraph.
"""

from __future__ import annotations

import torch

__version__ = "0.5.3+fake"
_TENSOR_CORE_FREE_GROUPS = (1, 2, 3, 4, 8)  # the plain decode kernel's group sizes (it refuses 7)


def _attend(q, keys, values, scale, causal_offset=None):
    """q [m, H, D] against keys/values [L, Hkv, D]; row i sees keys j <= causal_offset + i (None: all)."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys = keys.repeat_interleave(heads // kv_heads, dim=1).float()
    values = values.repeat_interleave(heads // kv_heads, dim=1).float()
    scores = torch.einsum("mhd,lhd->hml", q.float(), keys) * scale
    if causal_offset is not None:
        rows = torch.arange(q.shape[0])[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > rows, float("-inf"))
    return torch.einsum("hml,lhd->mhd", torch.softmax(scores, dim=-1), values)


class _Paged:
    def _lengths(self, indptr, last_page_len, page_size, seq_lens):
        """The KV lengths and their max as 0.5.3's plan() takes them: ``seq_lens`` when given (``.cpu()``), else
        derived from the CSR layout; the max by Python's ``max(...).item()``, as the real one. A ``seq_lens`` that
        disagrees with the layout would mis-schedule the real kernels: here it raises."""
        derived = torch.clamp(indptr[1:] - indptr[:-1] - 1, min=0) * page_size + last_page_len
        lens = derived if seq_lens is None else seq_lens.cpu()
        if lens.tolist() != derived.tolist():
            raise ValueError(f"seq_lens {lens.tolist()} disagree with the page layout's {derived.tolist()}")
        self._max_kv_len = max(lens).item() if len(lens) else 0

    def _store(self, indptr, indices, last_page_len):
        for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must have dtype torch.int32, got {t.dtype}")
        if self._use_cuda_graph:
            if len(last_page_len) != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed in cudagraph mode")
            self._paged_kv_indptr_buf.copy_(indptr)
            self._paged_kv_last_page_len_buf.copy_(last_page_len)
            self._paged_kv_indices_buf[: len(indices)].copy_(indices)
        else:
            self._paged_kv_indptr_buf = indptr.to(self.device)
            self._paged_kv_indices_buf = indices.to(self.device)
            self._paged_kv_last_page_len_buf = last_page_len.to(self.device)
        self.plans = getattr(self, "plans", 0) + 1

    def _kv(self, paged_kv_cache, b):
        k_cache, v_cache = paged_kv_cache
        ps = k_cache.shape[1]
        lo, hi = int(self._paged_kv_indptr_buf[b]), int(self._paged_kv_indptr_buf[b + 1])
        pages = self._paged_kv_indices_buf[lo:hi].long()
        length = (hi - lo - 1) * ps + int(self._paged_kv_last_page_len_buf[b])
        shape = (-1, *k_cache.shape[2:])
        return k_cache[pages].reshape(shape)[:length], v_cache[pages].reshape(shape)[:length]


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        assert kv_layout == "NHD"
        self.device = float_workspace_buffer.device
        self._use_cuda_graph, self._use_tensor_cores = use_cuda_graph, use_tensor_cores
        self._paged_kv_indptr_buf = paged_kv_indptr_buffer
        self._paged_kv_indices_buf = paged_kv_indices_buffer
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer
        if use_cuda_graph:
            self._fixed_batch_size = len(paged_kv_last_page_len_buffer)
            assert len(paged_kv_indptr_buffer) == self._fixed_batch_size + 1

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None, non_blocking=True,
             **newer):
        group = num_qo_heads // num_kv_heads
        if not self._use_tensor_cores and group not in _TENSOR_CORE_FREE_GROUPS:
            raise RuntimeError(f"Unsupported group_size: {group}")
        self._store(indptr, indices, last_page_len)
        self._lengths(indptr.to("cpu"), last_page_len.to("cpu"), page_size, newer.get("seq_lens"))
        self._scale = sm_scale if sm_scale is not None else head_dim ** -0.5
        self._q_dtype = q_data_type

    def run(self, q, paged_kv_cache, out=None, **kwargs):
        assert q.dtype == self._q_dtype, (q.dtype, self._q_dtype)
        out = torch.empty_like(q) if out is None else out
        for b in range(q.shape[0]):
            keys, values = self._kv(paged_kv_cache, b)
            out[b] = _attend(q[b:b + 1], keys, values, self._scale)[0].to(out.dtype)
        return out


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    """In CUDA-graph mode (fixed buffers), as 0.5.3's: the batch size is the buffers' and every plan keeps it; the
    tokens of a plan may not exceed the first plan's (``_max_total_num_rows``); ``run`` reads the query layout
    from ``qo_indptr_buf`` on the device, as the captured kernels do, and writes no output row outside it."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None, **kwargs):
        assert kv_layout == "NHD"
        self.device = float_workspace_buffer.device
        self._use_cuda_graph = use_cuda_graph
        self._max_total_num_rows = None
        if use_cuda_graph:
            self._fixed_batch_size = len(qo_indptr_buf) - 1
            assert len(paged_kv_indptr_buf) == self._fixed_batch_size + 1
            assert len(paged_kv_last_page_len_buf) == self._fixed_batch_size
            self._qo_indptr_buf, self._paged_kv_indptr_buf = qo_indptr_buf, paged_kv_indptr_buf
            self._paged_kv_indices_buf, self._paged_kv_last_page_len_buf = (paged_kv_indices_buf,
                                                                            paged_kv_last_page_len_buf)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             non_blocking=True, **newer):
        if qo_indptr.dtype != torch.int32:
            raise ValueError("qo_indptr must have dtype torch.int32")
        host_qo = qo_indptr.to("cpu")
        if self._use_cuda_graph:
            total = int(host_qo[-1])
            if self._max_total_num_rows is None:
                self._max_total_num_rows = total
            elif total > self._max_total_num_rows:
                raise ValueError(f"The total number of rows in qo_indptr {total} in cuda graph mode cannot exceed "
                                 f"the number of rows set during initialization {self._max_total_num_rows}.")
            if len(qo_indptr) - 1 != self._fixed_batch_size:
                raise ValueError("The batch size should be fixed during the lifecycle of the wrapper in cuda graph "
                                 "mode")
            if len(paged_kv_indices) > len(self._paged_kv_indices_buf):
                raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
            self._qo_indptr_buf.copy_(qo_indptr)
        self._store(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        self._qo_indptr = host_qo
        self._max_q_len = max(host_qo[1:] - host_qo[:-1]).item()
        self._lengths(paged_kv_indptr.to("cpu"), paged_kv_last_page_len.to("cpu"), page_size, newer.get("seq_lens"))
        self._causal = causal
        self._scale = sm_scale if sm_scale is not None else head_dim_qk ** -0.5
        self._q_dtype = q_data_type

    def run(self, q, paged_kv_cache, out=None, **kwargs):
        assert q.dtype == self._q_dtype, (q.dtype, self._q_dtype)
        out = torch.empty_like(q) if out is None else out
        qo_indptr = self._qo_indptr_buf.cpu() if self._use_cuda_graph else self._qo_indptr
        for b in range(len(qo_indptr) - 1):
            lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
            if lo == hi:
                continue  # a request of no query tokens (a CUDA-graph batch's pad slot): no work
            keys, values = self._kv(paged_kv_cache, b)
            offset = keys.shape[0] - (hi - lo) if self._causal else None  # causal aligned bottom-right
            out[lo:hi] = _attend(q[lo:hi], keys, values, self._scale, offset).to(out.dtype)
        return out
