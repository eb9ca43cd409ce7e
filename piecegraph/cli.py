"""``piecegraph demo | bench``: the command line."""

from __future__ import annotations

import time

import torch
import typer
from rich.console import Console
from rich.table import Table

from piecegraph.bench.command import bench
from piecegraph.doctor.command import doctor
from piecegraph.cli_common import load_model, resolve_device

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Piecewise CUDA graphs for PyTorch inference.")
console = Console()


@app.command()
def demo(
    model: str = typer.Option("auto", help="tiny | qwen2.5-0.5b | PATH (auto: tiny on CPU, 0.5B shape on GPU)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    steps: int = typer.Option(16, min=2, help="tokens to generate per prompt"),
) -> None:
    """Generate greedily with eager and graphed models; check the tokens agree and show the speed."""
    import piecegraph
    from piecegraph.models import generate

    device = resolve_device(device)
    model = model if model != "auto" else ("qwen2.5-0.5b" if device == "cuda" else "tiny")
    net = load_model(model, device, torch.float32)
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



# Each stage owns its command; the CLI only registers them.
app.command()(bench)
app.command()(doctor)

if __name__ == "__main__":
    app()
