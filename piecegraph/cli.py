"""``piecegraph demo | bench | report``: the command line."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from piecegraph.bench.command import bench
from piecegraph.cache.command import cache_app
from piecegraph.cli_common import MODEL_HELP, default_model, load_model, resolve_attention, resolve_device
from piecegraph.diagnose.command import doctor
from piecegraph.serve.command import serve_bench
from piecegraph.server.command import serve

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Piecewise CUDA graphs for PyTorch inference.")
console = Console()


@app.command()
def demo(
    model: str = typer.Option("auto", help=MODEL_HELP),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    steps: int = typer.Option(16, min=2, help="tokens to generate per prompt"),
    attention: str = typer.Option("auto", help="auto | torch | flashinfer (auto: FlashInfer on a GPU that has it)"),
    hf: str | None = typer.Option(None, "--hf", help="a local Hugging Face directory: run that transformers model "
                                  "itself (piecegraph.hf), unmodified"),
    engine: bool = typer.Option(False, "--engine", help="serve the prompts with the continuous-batching engine "
                                "instead, and show which graph each step used"),
) -> None:
    """Generate greedily with eager and graphed models on a paged KV cache; check the tokens agree, show speed."""
    import piecegraph
    from piecegraph.attention import KVCache
    from piecegraph.models import generate

    device = resolve_device(device)
    backend = resolve_attention(attention, device)
    model = hf or default_model(model, device)
    # FlashInfer attends in bf16/fp16 only; the torch backend runs float32, where graphed tokens must be exact.
    dtype = torch.bfloat16 if backend == "flashinfer" else torch.float32
    net = load_model(model, device, dtype, hf=hf is not None)
    if engine:  # the serving engine: prompts arriving over time, full graphs for decode, piecewise otherwise
        from piecegraph.serve.demo import engine_demo

        expected, got = engine_demo(net, steps, backend, graphs=device == "cuda", console=console)
        return _report_agreement(expected, got, exact=dtype == torch.float32)
    prompts = [[11, 22, 33, 44, 55, 66, 77], [5, 4, 3], [100, 101, 102, 103, 104], [9]]
    prompts = [[t % net.config.vocab_size for t in p] for p in prompts]
    graphs = device == "cuda"
    prefill = piecegraph.compile(net, mode="piecewise" if graphs else "none", max_tokens=32)
    decode = piecegraph.compile(net, mode="full" if graphs else "none", capture_sizes=(len(prompts),))
    longest = max(map(len, prompts)) + steps

    def new_cache():
        return KVCache.for_sequences(net.config, len(prompts), longest, dtype=dtype, device=device, backend=backend)

    graphed_cache = new_cache()  # one for every graphed run: full graphs bake the cache they captured with

    def run(**fns):
        cache = graphed_cache if fns else new_cache()
        start = time.perf_counter()
        tokens = generate(net, prompts, steps, cache=cache, **fns)
        if graphs:
            torch.cuda.synchronize()
        return tokens, time.perf_counter() - start

    console.print(f"[bold]piecegraph demo[/]: {model} on {device} ({str(dtype).removeprefix('torch.')}, "
                  f"{backend} attention, paged KV cache), {len(prompts)} prompts x {steps} tokens")
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
    _report_agreement(expected, got, exact=dtype == torch.float32)


def _report_agreement(expected: list[list[int]], got: list[list[int]], exact: bool) -> None:
    if got == expected:
        console.print("[green]graphed tokens equal eager tokens[/]")
        return
    same = sum(a == b for e, g in zip(expected, got) for a, b in zip(e, g))
    total = sum(map(len, expected))
    if exact:
        console.print(f"[red]graphed tokens differ from eager tokens ({same}/{total} equal) in float32[/]")
        raise typer.Exit(1)
    # bf16: Inductor's fused kernels round differently from eager ones; a near-tie can flip one greedy token,
    # and everything after it differs. That is rounding, not a graph bug (float32 runs must agree exactly).
    console.print(f"[yellow]bf16: {same}/{total} graphed tokens equal eager ones (greedy decoding diverges after "
                  "a rounding-level near-tie; run with --attention torch for an exact float32 check)[/]")


@app.command()
def report(
    files: list[Path] = typer.Argument(..., help="one result file (its rows) or two (compared: A, B and B/A)"),
    name: bool = typer.Option(False, "--name", help="print each file's committed name, <date>_<gpu>_<what>.json"),
    what: str | None = typer.Option(None, "--what", help="with --name: what the run measured (default: from the "
                                    "benchmark and its env, e.g. bench_modes_flashinfer)"),
    plot: Path | None = typer.Option(None, "--plot", help="redraw the PNG of one bench or serve-bench file"),
    columns: str | None = typer.Option(None, "--columns", help="comma-separated columns to show or compare"),
    key: str | None = typer.Option(None, "--key", help="comma-separated columns that match rows of two files "
                                   "(default: mode, phase, batch, tokens, concurrency and other naming columns)"),
) -> None:
    """Show a result file (benchmarks/results/*.json) as a table, or compare two files row by row."""
    from piecegraph.results.report import canonical_name, report_lines
    from piecegraph.results.schema import SchemaError, load_result

    def names(text: str | None, option: str) -> list[str] | None:
        picked = [c.strip() for c in (text or "").split(",") if c.strip()]
        if text is not None and not picked:
            raise typer.BadParameter("give at least one column name", param_hint=option)
        return picked or None

    try:
        results = [load_result(f) for f in files]
    except (OSError, SchemaError) as err:
        raise typer.BadParameter(str(err), param_hint="FILES") from None
    if name:
        for result in results:
            console.print(canonical_name(result, what), markup=False, highlight=False)
        return
    if plot is not None:
        from piecegraph.bench.plot import plot_result

        if len(results) != 1:
            raise typer.BadParameter("--plot draws one file", param_hint="--plot")
        try:
            console.print(f"wrote {plot_result(results[0], plot)}")
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--plot") from None
        return
    if len(results) > 2:
        raise typer.BadParameter(f"one file (its rows) or two (compared); got {len(results)}", param_hint="FILES")
    try:
        lines = report_lines(results, names(columns, "--columns"), names(key, "--key"))
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--columns/--key") from None
    out = console if console.is_terminal else Console(width=200)  # logs and pipes: no wrapping at 80 columns
    for line in lines:
        if isinstance(line, str):
            out.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            out.print(line)


# Each stage owns its command; the CLI only registers them.
app.command()(bench)
app.command()(doctor)
app.command(name="serve-bench")(serve_bench)
app.add_typer(cache_app, name="cache")
app.command()(serve)

if __name__ == "__main__":
    app()
