"""Where a serving step's host time goes: the 0.5B shape (bf16, FlashInfer attention when it imports) in an engine
of one mode (default piecewise), 256 requests of 512 prompt tokens and 32 new tokens submitted at once, stepped
under cProfile after a warm-up round. Prints the step kinds' phase means (host ms) and the top functions by own
time and by cumulative time, and writes them to OUT.json. CUDA only; the profiler's own overhead inflates every
number (read the ranking, not the absolute ms). Without CUDA: a dry run on the tiny shape, graphs emulated.
Usage: profile_serve_step.py OUT.json [MODE]"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

import torch

from piecegraph.attention import flashinfer_available
from piecegraph.models import QWEN2_5_0_5B, TINY, Decoder
from piecegraph.serve.config import EngineConfig
from piecegraph.serve.engine import Engine
from piecegraph.serve.request import SamplingParams


def _top(stats: pstats.Stats, key: str, count: int = 45) -> str:
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats(key).print_stats(count)
    return out.getvalue()


def main(out: str, mode: str = "piecewise") -> None:
    cuda = torch.cuda.is_available()
    backend = "flashinfer" if cuda and flashinfer_available(torch.device("cuda")) is None else "torch"
    shape, dtype, device = (QWEN2_5_0_5B, torch.bfloat16, "cuda") if cuda else (TINY, torch.float32, "cpu")
    model = Decoder.random(shape.replace(attention_backend=backend), dtype=dtype, device=device)
    engine = Engine(model, EngineConfig(mode=mode, max_num_seqs=256, max_num_batched_tokens=2048, max_seq_len=640,
                                        prefill_sizes=(1, 8, 64, 256, 512, 1024, 2048), emulate_graphs=not cuda))
    gen = torch.Generator().manual_seed(0)

    def submit(count: int) -> None:
        for _ in range(count):
            engine.add_request(torch.randint(0, min(1000, shape.vocab_size), (512,), generator=gen).tolist(),
                               SamplingParams(max_new_tokens=32))

    submit(64)
    engine.run()  # warm-up: every path once
    engine.reset_stats()
    submit(256)
    profiler = cProfile.Profile()
    profiler.enable()
    engine.run()
    profiler.disable()
    stats = pstats.Stats(profiler)
    summary = engine.stats()
    result = {"mode": mode, "backend": backend, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if cuda else "none (dry run)",
              "engine_stats": summary, "by_tottime": _top(stats, "tottime"), "by_cumtime": _top(stats, "cumulative")}
    Path(out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(summary, indent=1, default=str)[:3000])
    print(result["by_tottime"])
    print(result["by_cumtime"])


if __name__ == "__main__":
    main(*sys.argv[1:3])
