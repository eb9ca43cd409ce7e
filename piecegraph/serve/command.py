"""``piecegraph serve-bench``: the serving benchmark's command line (closed-loop clients per concurrency)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from piecegraph.cli_common import (
    MODEL_HELP,
    default_model,
    int_list,
    load_model,
    resolve_run_options,
    shard_for_tp,
    start_tp,
)

console = Console()
if not console.is_terminal:  # logs and pipes: rich would wrap the wide table at 80 columns
    console = Console(width=200)

DEFAULT_MODES = "eager,breakable,piecewise,auto,auto-sync"


def _modes(text: str) -> list[str]:
    from piecegraph.serve.sweep import BENCH_MODES as ENGINE_MODES  # engine modes and auto's variant rows

    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in ENGINE_MODES]
    if unknown or not names:
        raise typer.BadParameter(f"unknown modes {unknown}; choose from {', '.join(ENGINE_MODES)}",
                                 param_hint="--modes")
    repeated = sorted({m for m in names if names.count(m) > 1})
    if repeated:  # the result file keeps each mode's setup under its name
        raise typer.BadParameter(f"{', '.join(repeated)} given more than once; use --repeats to run a mode again",
                                 param_hint="--modes")
    return names


def _counts(text: str, concurrencies: list[int]) -> dict[int, int]:
    """``--requests``: empty (the rounds rule), one count for all, or one per concurrency."""
    values = int_list(text, "--requests")
    if len(values) == 1:
        values = values * len(concurrencies)
    if values and len(values) != len(concurrencies):
        raise typer.BadParameter(f"{len(values)} counts for {len(concurrencies)} concurrencies; give one, or one per "
                                 "concurrency", param_hint="--requests")
    return dict(zip(concurrencies, values))


@contextlib.contextmanager
def capture_progress() -> Iterator[Any]:
    """A rich progress bar for graph capture; yields ``progress(mode)`` -> the engine's per-size callback."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} sizes"),
                   TimeElapsedColumn(), console=console, transient=False)

    def for_mode(mode: str) -> Any:
        tasks: list[Any] = []  # added on the first size: a mode without graphs (eager) shows no bar

        def update(kind: str, size: int, done: int, total: int) -> None:
            if not tasks:
                tasks.append(bar.add_task(mode, total=total))
            what = "captured" if kind == "done" else f"{kind} size {size}" + (" (trace, compile)" if not done else "")
            bar.update(tasks[0], completed=done, total=total, description=f"{mode}: {what}")

        return update

    with bar:
        yield for_mode


def serve_bench(
    model: str = typer.Option("auto", help=MODEL_HELP),
    quant: str = typer.Option("bf16", help="bf16 | fp8: the reference decoder's linears and experts in e4m3 "
                              "(FlashInfer's FP8 GEMMs on sm90, torch elsewhere)"),
    modes: str = typer.Option(DEFAULT_MODES, help="comma-separated engine modes: eager,breakable,piecewise,auto; "
                              "auto-sync (the synchronous loop), auto-freeze (on a frozen heap), "
                              "auto-shared (the full module from the shared trace), auto-pieces (that, compiled by "
                              "pieces), auto-noprefix (without the prefix cache), auto-nomixed (prompt steps all "
                              "piecewise); with --workload shared-prefix the "
                              "default is auto,auto-noprefix"),
    concurrency: str = typer.Option("1,10,256,1024", help="closed-loop clients, comma-separated"),
    requests: str = typer.Option("", help="requests per concurrency: one count, or one per concurrency "
                                 "(default: --rounds per client within --min-requests..--max-requests)"),
    rounds: float = typer.Option(3.0, min=0.0, help="requests per client when --requests is not given"),
    min_requests: int = typer.Option(4, min=1, help="fewest requests per concurrency (rounds rule)"),
    max_requests: int = typer.Option(1024, min=1, help="most requests per concurrency (rounds rule; shortens "
                                     "high concurrencies, never below one per client)"),
    input_len: int = typer.Option(0, min=0, help="mean prompt tokens (0: 512 on GPU, 32 on CPU)"),
    output_len: int = typer.Option(0, min=0, help="mean output tokens, no EOS: each request runs its length (0: "
                                   "128 on GPU, 8 on CPU)"),
    range_ratio: float = typer.Option(0.25, min=0.0, max=0.99, help="lengths uniform in len*(1 -/+ ratio)"),
    workload: str = typer.Option("random", help="random | shared-prefix: every prompt starts with one of "
                                 "--num-prefixes common prefixes of --prefix-len tokens, then --input-len random "
                                 "tokens (rows report the prefix cache's hit rate and TTFT)"),
    prefix_len: int = typer.Option(0, min=0, help="shared-prefix tokens (0: 1024 on GPU, 128 on CPU)"),
    num_prefixes: int = typer.Option(1, min=1, help="distinct shared prefixes (shared-prefix workload)"),
    prefix_cache: bool = typer.Option(True, "--prefix-cache/--no-prefix-cache", help="the engines' prefix cache "
                                      "(each run starts it cold)"),
    max_batched_tokens: int = typer.Option(2048, min=1, help="per-step token budget (chunked prefill above it)"),
    max_num_seqs: int = typer.Option(0, min=0, help="most running requests (0: the largest concurrency)"),
    num_pages: int = typer.Option(0, min=0, help="KV pages (0: room for every running request at full length "
                                   "when that fits in 85% of the free GPU memory, else what fits)"),
    page_size: int = typer.Option(16, min=1, help="tokens per KV page"),
    compiler: str = typer.Option("inductor", help="inductor | eager (piecegraph's compiler of the pieces)"),
    emulate: bool | None = typer.Option(None, "--emulate/--no-emulate", help="emulate graph replay (default: on "
                                        "CPU, where CUDA graphs cannot run; the dispatch is then still measured)"),
    warmup: int = typer.Option(2, min=0, help="short warm-up requests per mode before timing"),
    repeats: int = typer.Option(1, min=1, help="runs per concurrency; the run with the median output tok/s is "
                                "reported, every run's in repeats_output_tok_s (a GPU host's runs vary 10-20%)"),
    interleave: bool = typer.Option(False, "--interleave/--sequential", help="start every mode's engine first (one "
                                    "shared KV cache), then run each concurrency's repeats mode after mode, the "
                                    "order rotated each repeat: for comparing close modes (one after another, a "
                                    "GPU host's drift favours the mode run first); needs every engine's graphs "
                                    "in memory at once"),
    reference: bool = typer.Option(True, "--reference/--no-reference", help="also time a decode-only full-graph "
                                   "loop at concurrency 1 (in auto mode): the ITL floor"),
    seed: int = typer.Option(0, help="seed of the random workload"),
    json_path: Path | None = typer.Option(None, "--json", help="write the result file (the one result schema: "
                                          "benchmark, env, rows, setup)"),
    plot_path: Path | None = typer.Option(None, "--plot", help="write a PNG: throughput, TTFT, ITL by concurrency"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    attention: str = typer.Option("auto", help="auto | torch | flashinfer (auto: FlashInfer on a GPU that has it)"),
    tp: int = typer.Option(1, min=1, help="tensor-parallel ranks: one process per GPU under torchrun (started "
                           "for you), every rank runs the same engine, rank 0 reports; the JSON has the world size"),
    url: str | None = typer.Option(None, "--url", help="drive a running OpenAI-compatible server (piecegraph serve, "
                                   "vLLM, SGLang) at this base URL over HTTP instead, streaming; engine options "
                                   "then do not apply"),
) -> None:
    """Serve random requests with closed-loop clients per concurrency and mode; throughput, TTFT, ITL, graphs."""
    from piecegraph.results.schema import write_result
    from piecegraph.serve.bench import Workload
    from piecegraph.serve.config import EngineConfig
    from piecegraph.serve.interleave import run_interleaved
    from piecegraph.serve.report import payload
    from piecegraph.serve.sweep import Plan, run_sweep

    device, backend = resolve_run_options(device, attention, {"--json": json_path, "--plot": plot_path})
    mode_list, conc = _modes(modes), int_list(concurrency, "--concurrency")
    if not conc:
        raise typer.BadParameter("at least one concurrency is needed", param_hint="--concurrency")
    counts = _counts(requests, conc)
    gpu = device == "cuda"
    if workload not in ("random", "shared-prefix"):
        raise typer.BadParameter(f"{workload!r} is not random or shared-prefix", param_hint="--workload")
    shared = (prefix_len or (1024 if gpu else 128)) if workload == "shared-prefix" else 0
    work = Workload(input_len or (512 if gpu else 32), output_len or (128 if gpu else 8), range_ratio, seed,
                    shared, num_prefixes)
    if shared and modes == DEFAULT_MODES:
        mode_list = ["auto", "auto-noprefix"]
    if url:  # the same closed loop over HTTP: this project's server and its peers measured by one client
        from piecegraph.serve.http_bench import run_cli

        return run_cli(url, work, conc, counts, (rounds, min_requests, max_requests), warmup, json_path, plot_path,
                       console, repeats)
    if compiler not in ("inductor", "eager"):
        raise typer.BadParameter(f"{compiler!r} is not inductor or eager", param_hint="--compiler")
    run = start_tp(tp, device)  # --tp > 1 outside torchrun: runs this command as its ranks and exits here
    reports = run.reports
    model = default_model(model, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    net = shard_for_tp(load_model(model, device, dtype, quant=quant, optimize=run.solo), run)  # fused after sharding
    max_len = min(-(-work.max_len // page_size) * page_size, net.config.max_seq_len)  # whole pages when it can
    if work.max_len > net.config.max_seq_len:
        raise typer.BadParameter(f"requests of up to {work.max_len} tokens exceed the model's max_seq_len "
                                 f"{net.config.max_seq_len}", param_hint="--input-len")
    engine = EngineConfig(max_num_seqs=max_num_seqs or max(conc), max_num_batched_tokens=max_batched_tokens,
                          num_pages=num_pages or None, page_size=page_size, max_seq_len=max_len, compiler=compiler,
                          emulate_graphs=not gpu if emulate is None else emulate, attention_backend=backend,
                          auto_opaque=True,  # as the bench: a library kernel nobody adapted is wrapped in every mode
                          prefix_cache=prefix_cache)
    plan = Plan(tuple(mode_list), tuple(conc), work, engine, counts=counts, rounds=rounds,
                min_requests=min_requests, max_requests=max_requests, warmup=warmup, reference=reference,
                repeats=repeats)
    env = _environment(model, device, dtype, backend, plan, quant, interleave=interleave, **run.facts())

    def log(line: str) -> None:  # plain: tracebacks hold brackets that rich would read as markup
        if reports:
            console.print(line, markup=False, highlight=False, soft_wrap=True)

    def save(results: list[dict[str, Any]]) -> None:  # after each mode: a run cut short keeps what it finished
        if json_path and reports:
            kernels = sorted({r["attention_kernel"] for r in results if r.get("attention_kernel")})
            write_result(json_path, **payload({**env, "attention_kernel": "; ".join(kernels) or None}, results))

    if reports:
        console.print(f"[bold]serve-bench[/]: {model} on {env['gpu']} ({env['dtype']}, {backend} attention"
                      f"{f', tp {tp}' if tp > 1 else ''}), modes {', '.join(mode_list)}, concurrency {conc}, "
                      f"requests {[plan.num_requests(c) for c in conc]}")
    with capture_progress() if reports else contextlib.nullcontext(lambda mode: None) as progress:
        sweep = run_interleaved if interleave else run_sweep
        results = sweep(net, plan, log=log, progress=progress, on_mode=save, keep_going=run.solo)
    save(results)
    run.finish()
    if reports:
        _report(results, f"{model} {env['dtype']} on {env['gpu']}{f' x{tp} (tp)' if tp > 1 else ''}, torch "
                f"{env['torch']}, {backend} attention", json_path, plot_path)


def _report(results: list[dict[str, Any]], title: str, json_path: Path | None, plot_path: Path | None) -> None:
    """The capture, phase and serving tables; the PNG if asked; exit 1 when a mode failed."""
    from piecegraph.serve.report import capture_table, phase_table, plot, table

    console.print(capture_table(results))
    console.print(phase_table(results))
    console.print(table(results, f"serving: {title}; latencies in ms"))
    if json_path:
        console.print(f"wrote {json_path}")
    if plot_path:
        plot(results, plot_path, title=title)
        console.print(f"wrote {plot_path}")
    if any(r.get("error") for r in results):
        raise typer.Exit(1)


def _environment(model: str, device: str, dtype: torch.dtype, backend: str, plan: Any, quant: str = "bf16",
                 world_size: int = 1, **extra: Any) -> dict[str, Any]:
    """The result's ``env`` (the one result schema's keys, ``attention`` the resolved backend) and the run's
    settings: workload, engine config, concurrencies, requests, warm-up, repeats, how times are taken."""
    from dataclasses import asdict

    from piecegraph.results.schema import device_name, environment

    return environment(
        attention=backend, model=model, dtype=dtype, quant=quant, world_size=world_size, gpu=device_name(device),
        workload=asdict(plan.workload), engine=asdict(plan.engine), concurrency=list(plan.concurrencies),
        requests={c: plan.num_requests(c) for c in plan.concurrencies}, warmup=plan.warmup, repeats=plan.repeats,
        timing="wall time (perf_counter) when each step's tokens reach the host (a device sync on GPU)", **extra)
