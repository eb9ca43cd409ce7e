"""``piecegraph bench``: the command line of the benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.console import Console
from rich.table import Table

from piecegraph.cli_common import load_model, resolve_device

console = Console()


def bench(
    model: str = typer.Option("auto", help="tiny | qwen2.5-0.5b | PATH (auto: tiny on CPU, 0.5B shape on GPU)"),
    modes: str = typer.Option("auto", help="comma-separated: eager,full,full-compiled,piecewise,torch.compile,reduce-overhead,none"),
    batches: str = typer.Option("1,10,256,1024", help="decode batch sizes"),
    context: int = typer.Option(256, min=1, help="cached tokens per sequence"),
    repeats: int = typer.Option(20, min=1),
    json_path: Optional[Path] = typer.Option(None, "--json", help="write rows and environment as JSON"),
    device: str = typer.Option("auto"),
) -> None:
    """Time decode steps of every mode side by side (medians of CUDA-event timings)."""
    from piecegraph.bench.harness import DECODE_MODES, bench_decode, environment

    device = resolve_device(device)
    model = model if model != "auto" else ("qwen2.5-0.5b" if device == "cuda" else "tiny")
    net = load_model(model, device, torch.bfloat16 if device == "cuda" else torch.float32)
    if modes == "auto":
        mode_list = list(DECODE_MODES) if device == "cuda" else ["eager", "none"]
    else:
        mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    try:
        batch_list = [int(b) for b in batches.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{batches!r} is not a comma-separated list of ints", param_hint="--batches")
    rows = bench_decode(net, mode_list, batch_list, context=context, repeats=repeats, log=console.print)
    table = Table(title=f"decode step, {model}, {environment(net)['gpu']}, torch {torch.__version__}")
    for col in ("mode", "batch", "ms", "tok/s", "x eager", "rel err", "first call s", "pool MiB"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    eager = {r.batch: r.ms for r in rows if r.mode == "eager"}
    for r in rows:
        ratio = f"{eager[r.batch] / r.ms:.1f}" if r.batch in eager else "-"
        table.add_row(r.mode, str(r.batch), f"{r.ms:.3f}", f"{r.tok_s:.0f}", ratio, f"{r.rel_err:.1e}",
                      f"{r.setup_s:.1f}", f"{r.pool_mib:.0f}")
    console.print(table)
    if json_path:
        payload = {"env": {**environment(net), "model_name": model, "context": context},
                   "rows": [r.__dict__ for r in rows]}
        json_path.write_text(json.dumps(payload, indent=1))
        console.print(f"wrote {json_path}")
