"""Where a serving step's host time goes: the 0.5B shape (bf16, FlashInfer attention when it imports) in an engine
of one mode (default auto), stepped under cProfile after a warm-up round, two workloads profiled apart: "c256"
(256 requests of 512 prompt tokens and 32 new tokens submitted at once: mixed steps, then decode at batch 256) and
"c1" (one request, 8 prompt tokens, 128 new: decode at batch 1). Prints each workload's step kinds and phase means
(host ms) and the top functions by own and by cumulative time, and writes them to OUT.json. The profiler's own
overhead inflates every number (read the ranking, not the absolute ms). Without CUDA: a dry run on the tiny shape,
graphs emulated. Usage: profile_serve_step.py OUT.json [MODE]"""

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


def main(out: str, mode: str = "auto") -> None:
    cuda = torch.cuda.is_available()
    backend = "flashinfer" if cuda and flashinfer_available(torch.device("cuda")) is None else "torch"
    shape, dtype, device = (QWEN2_5_0_5B, torch.bfloat16, "cuda") if cuda else (TINY, torch.float32, "cpu")
    model = Decoder.random(shape.replace(attention_backend=backend), dtype=dtype, device=device)
    engine = Engine(model, EngineConfig(mode=mode, max_num_seqs=256, max_num_batched_tokens=2048, max_seq_len=640,
                                        prefill_sizes=(1, 8, 64, 256, 512, 1024, 2048), emulate_graphs=not cuda))
    gen = torch.Generator().manual_seed(0)

    def submit(count: int, prompt: int, new: int) -> None:
        for _ in range(count):
            engine.add_request(torch.randint(0, min(1000, shape.vocab_size), (prompt,), generator=gen).tolist(),
                               SamplingParams(max_new_tokens=new))

    submit(64, 512, 32)
    engine.run()  # warm-up: every path once
    result = {"mode": mode, "backend": backend, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if cuda else "none (dry run)"}
    for name, (count, prompt, new) in {"c256": (256, 512, 32), "c1": (1, 8, 128)}.items():
        engine.reset_stats()
        submit(count, prompt, new)
        profiler = cProfile.Profile()
        profiler.enable()
        engine.run()
        profiler.disable()
        stats = pstats.Stats(profiler)
        summary = engine.stats()
        result[name] = {"engine_stats": summary, "by_tottime": _top(stats, "tottime"),
                        "by_cumtime": _top(stats, "cumulative")}
        Path(out).write_text(json.dumps(result, indent=1, default=str))
        print(f"== {name}: {count} requests, {prompt} prompt tokens, {new} new")
        print(json.dumps({k: summary.get(k) for k in ("by_kind", "ms_per_step", "phase_ms", "plan_us")},
                         default=str))
        print(result[name]["by_tottime"])
        print(result[name]["by_cumtime"])


if __name__ == "__main__":
    main(*sys.argv[1:3])
