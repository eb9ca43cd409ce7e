"""``piecegraph demo | bench``: the command line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Piecewise CUDA graphs for PyTorch inference.")
console = Console()


def _device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise typer.BadParameter("--device cuda, but torch sees no CUDA device; use --device cpu", param_hint="--device")
    return device


def _load_model(model: str, device: str, dtype: torch.dtype):
    from piecegraph.models import QWEN2_5_0_5B, TINY, Decoder, load_hf

    if model == "tiny":
        return Decoder.random(TINY, seed=0, dtype=dtype, device=device).eval()
    if model == "qwen2.5-0.5b":
        return Decoder.random(QWEN2_5_0_5B, seed=0, dtype=dtype, device=device).eval()
    if Path(model).is_dir():
        return load_hf(model, dtype=dtype, device=device).eval()
    raise typer.BadParameter(
        f"{model!r} is not 'tiny', 'qwen2.5-0.5b' or a local Hugging Face directory", param_hint="--model"
    )


@app.command()
def demo(
    model: str = typer.Option("auto", help="tiny | qwen2.5-0.5b | PATH (auto: tiny on CPU, 0.5B shape on GPU)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    steps: int = typer.Option(16, min=2, help="tokens to generate per prompt"),
) -> None:
    """Generate greedily with eager and graphed models; check the tokens agree and show the speed."""
    import piecegraph
    from piecegraph.models import generate

    device = _device(device)
    model = model if model != "auto" else ("qwen2.5-0.5b" if device == "cuda" else "tiny")
    net = _load_model(model, device, torch.float32)
    prompts = [[11, 22, 33, 44, 55, 66, 77], [5, 4, 3], [100, 101, 102, 103, 104], [9]]
    prompts = [[t % net.config.vocab_size for t in p] for p in prompts]
    graphs = device == "cuda"
    prefill = piecegraph.compile(net, mode="piecewise" if graphs else "none", max_tokens=32)
    decode = piecegraph.compile(net, mode="full" if graphs else "none", capture_sizes=(len(prompts),))
    console.print(f"[bold]piecegraph demo[/]: {model} on {device} (float32), {len(prompts)} prompts x {steps} tokens")

    def run(**fns):
        start = time.perf_counter()
        tokens = generate(net, prompts, steps, **fns)
        if graphs:
            torch.cuda.synchronize()
        return tokens, time.perf_counter() - start

    with console.status("eager generation"):
        expected, _ = run()
        expected, eager_s = run()
    with console.status("tracing, compiling and capturing (first call)"):
        _, setup_s = run(prefill_fn=prefill, decode_fn=decode)
    got, graphed_s = run(prefill_fn=prefill, decode_fn=decode)
    label = "piecewise prefill + full decode" if graphs else "compiled, no graphs (CPU)"
    table = Table(title="greedy generation")
    for col in ("mode", "ms / step", "tokens / s"):
        table.add_column(col, justify="right" if col != "mode" else "left")
    n_tokens = len(prompts) * steps
    for name, seconds in (("eager", eager_s), (label, graphed_s)):
        table.add_row(name, f"{seconds / steps * 1e3:.2f}", f"{n_tokens / seconds:.0f}")
    console.print(table)
    console.print(f"setup (trace + compile + capture): {setup_s:.1f} s; decode graphs: {decode.stats()['sizes']}")
    if got != expected:
        console.print("[red]graphed tokens differ from eager tokens[/]")
        raise typer.Exit(1)
    console.print("[green]graphed tokens equal eager tokens[/]")


@app.command()
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

    device = _device(device)
    model = model if model != "auto" else ("qwen2.5-0.5b" if device == "cuda" else "tiny")
    net = _load_model(model, device, torch.bfloat16 if device == "cuda" else torch.float32)
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


if __name__ == "__main__":
    app()
