"""How many KV pages the engine's cache gets when ``EngineConfig.num_pages`` is not given.

Room for ``max_num_seqs`` sequences of ``max_seq_len`` tokens, when that fits in ``kv_cache_memory`` of the device
memory free at engine start (weights already loaded); else as many pages as fit there, and the scheduler makes the
rest wait or preempts (recompute), as vLLM sizes its cache from free memory. A mixture of experts with 16 KV heads
(the Qwen1.5-MoE-A2.7B shape: 3.1 MiB per 16-token page over 24 layers) at 1024 sequences of 800 tokens would ask
for ~150 GiB, more than an H200 has, and the engine used to die allocating it.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch

from piecegraph.attention.pages import pages_for

GIB = 2**30


@dataclass(frozen=True)
class KVBudget:
    """The cache's pages (scratch page included), their bytes, and what the config asked for."""

    pages: int
    page_bytes: int
    wanted: int  # room for max_num_seqs sequences of max_seq_len tokens, the scratch page included
    free_bytes: int | None  # device memory free at start (a CPU: its cache's share; None: not measured)
    cpu: bool = False  # free_bytes is cpu_kv_bytes()

    @property
    def trimmed(self) -> bool:
        return self.pages < self.wanted

    def describe(self) -> str:
        size = f"{self.pages} pages ({self.pages * self.page_bytes / GIB:.1f} GiB)"
        if not self.trimmed:
            return f"KV cache: {size}, room for every sequence at its longest"
        where = (f"the CPU's share ({self.free_bytes / GIB:.1f} GiB: serve/kv_budget.py cpu_kv_bytes)" if self.cpu
                 else f"EngineConfig.kv_cache_memory of the {self.free_bytes / GIB:.1f} GiB free")
        return (f"KV cache: {size}, what fits in {where}; max_num_seqs sequences of max_seq_len tokens would need "
                f"{self.wanted} pages "
                f"({self.wanted * self.page_bytes / GIB:.1f} GiB), so requests beyond it wait or are preempted "
                "(EngineConfig.num_pages sets it)")


def kv_budget(*, max_num_seqs: int, max_seq_len: int, page_size: int, page_bytes: int, fraction: float,
              free_bytes: int | None) -> KVBudget:
    """Pages for the engine's cache: every sequence at its longest when that fits in ``fraction`` of
    ``free_bytes`` (or ``free_bytes`` is ``None``), else what fits. ``page_bytes``: one page's keys and values
    over every layer (``page_size * ModelFacts.kv_bytes_per_token()``). Raises ``ValueError`` naming the settings
    when not even one sequence of ``max_seq_len`` tokens fits."""
    per_seq = pages_for(max_seq_len, page_size)
    wanted = max_num_seqs * per_seq + 1
    if free_bytes is None:
        return KVBudget(wanted, page_bytes, wanted, None)
    fits = int(fraction * free_bytes) // page_bytes
    if fits < per_seq + 1:
        raise ValueError(
            f"the KV cache cannot hold one sequence of max_seq_len={max_seq_len} tokens: {per_seq + 1} pages of "
            f"{page_bytes / 2**20:.1f} MiB need {(per_seq + 1) * page_bytes / GIB:.2f} GiB, and "
            f"EngineConfig.kv_cache_memory={fraction} of the {free_bytes / GIB:.1f} GiB free is "
            f"{fraction * free_bytes / GIB:.2f} GiB; lower max_seq_len, raise kv_cache_memory or free memory")
    return KVBudget(min(wanted, fits), page_bytes, wanted, free_bytes)


CPU_KV_SHARE = 0.25  # of the memory available at engine start: a CPU engine's default cache
CPU_KV_CAP = 4 * GIB


def cpu_kv_bytes(available: int | None = None) -> int:
    """The bytes a CPU engine's default KV cache may take: a quarter of the memory available now (``available``,
    else the OS's ``MemAvailable``), at most 4 GiB. A CPU has no free-memory query like CUDA's, and room for
    every sequence at its longest (32 sequences of 8192 tokens: 12 GiB of float32 keys and values for a 135M
    model) is more than a CPU engine serves at once; requests beyond the budget wait or are preempted."""
    if available is None:
        available = _available_memory()
    return int(min(available * CPU_KV_SHARE, CPU_KV_CAP))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 * CPU_KV_CAP  # unknown: the cap


def free_device_bytes(device: torch.device) -> int | None:
    """Bytes free on a CUDA device now: the driver's free memory plus what torch's caching allocator holds
    unused, after a garbage collection (an engine dropped in a reference cycle, serve-bench's previous mode,
    must not hold its cache against the next one); ``None`` elsewhere (no limit applied)."""
    if device.type != "cuda":
        return None
    gc.collect()
    held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return torch.cuda.mem_get_info(device)[0] + held
