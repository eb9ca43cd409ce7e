"""Time capture modes side by side on one device, in one process, so their ratios hold."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

import piecegraph
from piecegraph.models import AttentionMetadata, Decoder, KVCache

DECODE_MODES = ("eager", "full", "full-compiled", "piecewise", "torch.compile", "reduce-overhead")


@dataclass
class Row:
    mode: str
    phase: str
    batch: int
    ms: float
    tok_s: float
    setup_s: float
    rel_err: float
    pool_mib: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def time_ms(fn: Callable[[int], Any], warmup: int = 3, repeats: int = 20) -> float:
    """Median milliseconds of ``fn(i)`` over ``repeats`` calls after ``warmup`` (CUDA events on GPU)."""
    for i in range(warmup):
        fn(i)
    cuda = torch.cuda.is_available()
    times = []
    for i in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def make_mode(name: str, model: Decoder, sizes: Sequence[int]) -> Callable[..., torch.Tensor]:
    """The callable that ``name`` times; graphed modes capture exactly ``sizes``."""
    sizes = tuple(sizes)
    if name == "eager":
        return model
    if name == "full":  # whole graph captured, ops as traced (no Inductor)
        return piecegraph.compile(model, mode="full", compiler="eager", capture_sizes=sizes)
    if name == "full-compiled":
        return piecegraph.compile(model, mode="full", compiler="inductor", capture_sizes=sizes)
    if name == "piecewise":
        return piecegraph.compile(model, mode="piecewise", compiler="inductor", capture_sizes=sizes)
    if name == "none":
        return piecegraph.compile(model, mode="none", compiler="inductor", capture_sizes=sizes)
    if name == "torch.compile":
        return torch.compile(model)
    if name == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    raise ValueError(f"unknown bench mode {name!r}; choose from {DECODE_MODES + ('none',)}")


def decode_case(model: Decoder, batch: int, context: int, variants: int = 3) -> tuple[list[torch.Tensor], torch.Tensor, AttentionMetadata]:
    """Input sets for one decode step of ``batch`` sequences that each hold ``context`` cached tokens."""
    param = next(model.parameters())
    cache = KVCache(model.config, num_slots=batch, max_len=context + 8, dtype=param.dtype, device=param.device)
    for k, v in zip(cache.k, cache.v):
        k.normal_(0, 1)
        v.normal_(0, 1)
    g = torch.Generator(device="cpu").manual_seed(batch)
    ids = [torch.randint(0, model.config.vocab_size, (batch,), generator=g).to(param.device) for _ in range(variants)]
    positions = torch.full((batch,), context, dtype=torch.int64, device=param.device)
    slots = torch.arange(1, batch + 1, dtype=torch.int64, device=param.device)
    return ids, positions, AttentionMetadata.for_decode(cache, slots, positions)


def bench_decode(model: Decoder, modes: Sequence[str], batches: Sequence[int], context: int = 256,
                 repeats: int = 20, log: Callable[[str], None] = print) -> list[Row]:
    """Decode-step median ms of each mode at each batch; every mode sees the same inputs and cache."""
    rows = []
    callables = {m: make_mode(m, model, batches) for m in modes}
    for batch in batches:
        ids, positions, meta = decode_case(model, batch, context)
        with piecegraph.forward_context(meta), torch.no_grad():
            reference = model(ids[0], positions).float()
            for mode, fn in callables.items():
                t0 = time.perf_counter()
                out = fn(ids[0], positions)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                setup = time.perf_counter() - t0
                rel = ((out.float() - reference).norm() / reference.norm()).item()
                ms = time_ms(lambda i: fn(ids[i % len(ids)], positions), repeats=repeats)
                stats = fn.stats() if hasattr(fn, "stats") else {}
                rows.append(Row(mode, "decode", batch, ms, batch / ms * 1e3, setup, rel,
                                stats.get("pool_bytes", 0) / 2**20))
                log(f"decode batch={batch:5d} {mode:16s} {ms:8.3f} ms  rel_err={rel:.2e}  first call {setup:.2f}s")
        del meta
    return rows


def environment(model: Decoder) -> dict[str, Any]:
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "dtype": str(next(model.parameters()).dtype),
        "model": asdict(model.config),
        "date": time.strftime("%Y-%m-%d"),
    }
