"""``piecegraph demo --engine``: a handful of prompts through the serving engine, and which graph each step used."""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from piecegraph.serve.config import EngineConfig
from piecegraph.serve.engine import Engine
from piecegraph.serve.request import SamplingParams

PROMPTS = [[11, 22, 33, 44, 55, 66, 77, 88, 99, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [5, 4, 3],
           [100, 101, 102, 103, 104], [9], [42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
ARRIVALS = [0, 0, 0, 3, 5]  # the step each prompt arrives at: later ones join running decodes (mixed steps)


def engine_demo(net: torch.nn.Module, steps: int, backend: str, *, graphs: bool, console: Console
                ) -> tuple[list[list[int]], list[list[int]]]:
    """Print what the engine captured and a table of its steps; returns ``(eager tokens, engine tokens)``."""
    with console.status("eager reference, one prompt at a time"):
        expected = reference(net, steps, backend)
    with console.status("engine start: tracing, compiling, capturing every size"):
        got, records = run_demo(net, steps, console, graphs=graphs, backend=backend)
    console.print(step_table(records))
    return expected, got


def run_demo(net: torch.nn.Module, steps: int, console: Console, *, graphs: bool, backend: str | None = None,
             progress: Any = None) -> tuple[list[list[int]], list[Any]]:
    """Serve :data:`PROMPTS` (arriving at :data:`ARRIVALS`) with ``mode="auto"``; returns the outputs per prompt
    and the step records. ``graphs``: real CUDA graphs (a GPU), else emulated replay (CPU)."""
    prompts = [[t % net.config.vocab_size for t in p] for p in PROMPTS]
    config = EngineConfig(mode="auto", max_num_seqs=4, max_num_batched_tokens=16,
                          max_seq_len=max(map(len, prompts)) + steps, emulate_graphs=not graphs,
                          compiler="inductor" if graphs else "eager", attention_backend=backend)
    engine = Engine(net, config, progress=progress)
    report = engine.capture_report()
    for kind, module in report["modules"].items():
        console.print(f"captured {kind} graphs for sizes {module['sizes']} in {module['setup_s']:.1f} s "
                      f"(trace + compile + capture)")
    console.print(f"graph pool: {report['pool_mib']:.1f} MiB" + ("" if graphs else " (emulated replay on CPU)"))
    requests, step = [None] * len(prompts), 0
    while engine.has_work() or None in requests:
        for i, at in enumerate(ARRIVALS):
            if at == step and requests[i] is None:
                requests[i] = engine.add_request(prompts[i], SamplingParams(max_new_tokens=steps), id=f"p{i}")
        engine.step()
        step += 1
    return [list(r.output) for r in requests], engine.steps


def step_table(records: list[Any]) -> Table:
    """One line per step: the graph kind it replayed, its tokens and padding, decode rows and prefill tokens."""
    table = Table(title="engine steps (auto: full graphs for pure decode, piecewise for the rest)")
    for col in ("step", "graph", "tokens", "padded to", "rows", "decode rows", "prefill tokens", "ms"):
        table.add_column(col, justify="left" if col == "graph" else "right")
    for i, s in enumerate(records):
        table.add_row(str(i), s.kind, str(s.tokens), str(s.padded), str(s.seqs), str(s.decode_rows),
                      str(s.prefill_tokens), f"{s.seconds * 1e3:.2f}")
    return table


def reference(net: torch.nn.Module, steps: int, backend: str | None = None) -> list[list[int]]:
    """Each prompt generated alone, eagerly (greedy): what the engine must reproduce."""
    from piecegraph.attention.kv_cache import KVCache
    from piecegraph.models import generate, model_facts

    facts = model_facts(net)
    prompts = [[t % facts.vocab_size for t in p] for p in PROMPTS]
    out = []
    for p in prompts:
        cache = KVCache.for_sequences(facts.config, 1, len(p) + steps, dtype=facts.dtype, device=facts.device,
                                      backend=backend)
        out.append(generate(net, [p], steps, cache=cache)[0])
    return out
