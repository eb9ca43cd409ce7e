"""The host half of a FlashInfer plan: a step's CSR page layout, built for ``plan()`` to read cheaply, and the float
workspace a CUDA-graph plan reserves (:func:`graph_workspace_bytes`).

FlashInfer 0.5.3's ``plan()`` takes the largest query and KV length with Python's builtin ``max()`` over host
tensors (``max(kv_lens_arr_host).item()``, ``max(qo_indptr_host[1:] - qo_indptr_host[:-1]).item()``), which
iterates a tensor element by element: measured on CPU, 0.7-1.0 ms per call at 256 rows and 2.6-9 ms at 1024, in
every step's plan. It also computes the KV lengths itself when not given them (``get_seq_lens``) and copies them to
the device from that fresh, pageable tensor. So the lengths it reads go in as :class:`HostInts`: ``seq_lens`` (the
KV lengths, pinned, passed by the backend, so no pageable copy) and ``qo_indptr``, whose ``max()`` reads ints.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.nn.functional as F

from piecegraph.attention.metadata import SMALL_STEP, BatchLayout, host_tensor, to_device
from piecegraph.attention.pages import SCRATCH_PAGE, pages_for
from piecegraph.attention.types import PagedCache


class _Int(int):
    """An int with ``.item()``, as FlashInfer's ``max(tensor).item()`` expects of a tensor's elements."""

    def item(self) -> int:
        return int(self)


class HostInts(torch.Tensor):
    """A 1-d CPU int tensor whose iteration yields ints, not 0-d tensors: Python's ``max()`` over it costs
    microseconds, not a millisecond per 256 rows. Every other behaviour is the tensor's (results of torch ops on
    it stay ``HostInts``, so ``t[1:] - t[:-1]`` iterates fast too); kernels receive it as any tensor."""

    def __iter__(self) -> Iterator[Any]:
        if self.dim() != 1:
            return super().__iter__()
        return iter([_Int(v) for v in self.tolist()])


def _views(cpu: torch.Tensor, b1: int) -> dict[str, torch.Tensor]:
    """The named segments of a packed host buffer: qo_indptr | kv_indptr (``b1`` each) | last page lengths |
    KV lengths (``b1 - 1`` each)."""
    b = b1 - 1
    return {"qo_indptr": cpu[:b1].as_subclass(HostInts), "kv_indptr": cpu[b1:2 * b1],
            "kv_last_page_len": cpu[2 * b1:2 * b1 + b], "seq_lens": cpu[2 * b1 + b:].as_subclass(HostInts)}


def page_layout(layout: BatchLayout, device: torch.device, indices_only: bool = False,
                table: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """FlashInfer's page layout of ``layout``: int32 device tensors (``kv_indices``, ``kv_indptr``,
    ``kv_last_page_len``, in one packed copy) and int32 CPU tensors, pinned on CUDA (what ``plan()`` reads on the
    host: ``qo_indptr``, ``kv_indptr``, ``kv_last_page_len`` and ``seq_lens``; the first and last as
    :class:`HostInts`).
    ``indices_only``: no device indptr/last_page_len (a graph's live in its wrapper's fixed buffers).
    ``table``: the cache's device page table; with it (and ``layout.slots``) ``kv_indices`` is gathered on the
    device, so the host sends O(rows) ints, not every page."""
    if layout.num_tokens <= SMALL_STEP:  # a few rows: a Python loop costs less than the tensor ops below
        return page_layout_rows(layout, device, indices_only, table)
    # Whole-tensor ops on the rows' ints, no Python loop over rows or tokens: this runs every eager step over
    # 1000+ rows (it cost ~0.75 ms per step as a per-row loop).
    ps, i32 = layout.page_size, torch.int32
    gather = table is not None and layout.slots is not None
    kv = host_tensor(layout.kv_lens, i32)
    new = host_tensor(layout.num_new, i32)
    used = (kv + (ps - 1)).div_(ps, rounding_mode="floor")  # a table may hold pages reserved for later tokens
    cuda = device.type == "cuda"
    b = layout.num_seqs
    # plan() reads these on the host and copies them to the device: from pinned memory (pageable would wait for
    # the stream). qo_indptr | kv_indptr | kv_last_page_len | seq_lens, one buffer.
    cpu = torch.zeros(4 * b + 2, dtype=i32, pin_memory=cuda)
    torch.cumsum(new, 0, out=cpu[1:b + 1])
    torch.cumsum(used, 0, out=cpu[b + 2:2 * b + 2])
    torch.sub(kv, (used - 1).mul_(ps), out=cpu[2 * b + 2:3 * b + 2])
    cpu[3 * b + 2:] = kv
    views = _views(cpu, b + 1)
    host: dict[str, Any] = {}
    if gather:
        host.update(slots=layout.slots, used=used, starts=views["kv_indptr"][:-1])
    else:
        host["kv_indices"] = [p for pages, n in zip(layout.pages, used.tolist()) for p in pages[:n]]  # CPU tensor
    if not indices_only:
        host.update(kv_indptr=views["kv_indptr"], kv_last_page_len=views["kv_last_page_len"])
    dev = to_device(host, device, dtype=i32)
    if gather:
        dev["kv_indices"] = gather_indices(table, dev.pop("slots"), dev.pop("used"), dev.pop("starts"),
                                           int(views["kv_indptr"][-1]))  # a host tensor: no sync
    return dev, views


def page_layout_rows(layout: BatchLayout, device: torch.device, indices_only: bool, table: torch.Tensor | None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`page_layout` of a small step, row by row (equal outputs; tests/cpu/test_step_host_equal.py)."""
    ps = layout.page_size
    gather = table is not None and layout.slots is not None
    qo_indptr, kv_indptr, indices, last, used_pages = [0], [0], [], [], []
    for b, (new, kv) in enumerate(zip(layout.num_new, layout.kv_lens)):
        used = pages_for(kv, ps)  # a table may hold pages reserved for later tokens; FlashInfer must not see them
        if not gather:
            indices += layout.pages[b][:used]
        used_pages.append(used)
        qo_indptr.append(qo_indptr[-1] + new)
        kv_indptr.append(kv_indptr[-1] + used)
        last.append(kv - (used - 1) * ps)
    host: dict[str, Any] = {}
    if gather:  # flat positions in the device table, listed here: a few rows cost less than device index math
        width = table.shape[1]
        host["flat"] = [s * width + c for s, u in zip(layout.slots, used_pages) for c in range(u)]
    else:
        host["kv_indices"] = indices
    if not indices_only:
        host.update(kv_indptr=kv_indptr, kv_last_page_len=last)
    cpu = host_tensor([*qo_indptr, *kv_indptr, *last, *layout.kv_lens], torch.int32)
    if device.type == "cuda":  # plan() copies these to the device: from pageable memory that waits for the stream
        cpu = cpu.pin_memory()
    views = _views(cpu, len(qo_indptr))
    dev = to_device(host, device, dtype=torch.int32)
    if gather:
        dev["kv_indices"] = table.view(-1).index_select(0, dev.pop("flat"))
    return dev, views


def device_table(cache: PagedCache) -> torch.Tensor | None:
    """The cache's device page table (pending page changes flushed), or ``None`` for a cache without one."""
    table = getattr(cache, "device_table", None)
    return table() if table is not None else None


def pad_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t`` with ``pad`` zero rows appended (dim 0); ``t`` itself when there are none."""
    if pad == 0:
        return t
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))


def scratch_padded(layout: BatchLayout, pad: int, new: int) -> BatchLayout:
    """``layout`` with ``pad`` sequences appended for a CUDA graph's fixed batch, each of ``new`` new tokens (1: a
    decode graph's pad row, written at position 0; 0: a mixed graph's empty request) and one KV token on the
    scratch page (device-table slot 0, the all-scratch row), never a real page."""
    return BatchLayout(
        seq_ids=(*layout.seq_ids, *((None, i) for i in range(pad))), num_new=(*layout.num_new, *(new,) * pad),
        kv_lens=(*layout.kv_lens, *(1,) * pad), pages=(*layout.pages, *((SCRATCH_PAGE,),) * pad),
        page_size=layout.page_size, slots=None if layout.slots is None else (*layout.slots, *(0,) * pad),
    )


def gather_indices(table: torch.Tensor, slots: torch.Tensor, used: torch.Tensor, starts: torch.Tensor,
                   total: int) -> torch.Tensor:
    """CSR ``kv_indices`` (int32 ``[total]``) from the device page table: row ``b`` contributes the first
    ``used[b]`` pages of table row ``slots[b]``. Device ops only; ``output_size`` keeps repeat_interleave from
    reading the repeats back (a sync)."""
    rows = torch.repeat_interleave(slots.long(), used, output_size=total)
    cols = torch.arange(total, device=table.device) - torch.repeat_interleave(starts.long(), used, output_size=total)
    return table[rows, cols]


def graph_workspace_bytes(num_qo_heads: int, num_kv_heads: int, head_dim: int, size: int, num_sm: int,
                          seqs: int | None = None) -> int:
    """Float workspace bytes FlashInfer 0.5.3's plan needs for a CUDA-graph wrapper of ``size`` tokens over
    ``seqs`` request slots (default ``size``: a decode graph on tensor cores, whose plan is the prefill
    scheduler's): a graph plan reserves the split-KV partial outputs for the worst case,
    ``num_qo_heads x padded_tiles x cta_tile_q x (head_dim + 1)`` floats, where ``cta_tile_q`` follows the longest
    possible query, ``(size - seqs + 1) x group`` packed rows, and ``padded_tiles`` is
    ``max(2 * num_sm / num_kv_heads, ceil(size * group / cta_tile_q) + seqs - 1)`` (``scheduler.cuh``). This
    outgrows the usual 128 MiB with wide heads: 16 heads of 128 at 1024 rows take 136 MiB on an H200."""
    seqs = size if seqs is None else seqs
    group = num_qo_heads // num_kv_heads
    packed = (size - seqs + 1) * group
    cta_tile_q = 128 if packed > 64 and head_dim < 256 else 64 if packed > 16 else 16
    tiles = max(2 * num_sm // num_kv_heads, -(-size * group // cta_tile_q) + seqs - 1)
    floats = num_qo_heads * tiles * cta_tile_q
    return floats * head_dim * 4 + floats * 4 + 2 * 16  # tmp_v, tmp_s, each 16-byte aligned
