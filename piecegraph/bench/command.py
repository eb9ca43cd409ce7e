"""``piecegraph bench``: the command line of the benchmark (sweep, table, JSON, plot, optional profile)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from piecegraph.cli_common import (
    MODEL_HELP,
    check_writable,
    int_list,
    load_model,
    resolve_attention,
    resolve_device,
    shard_for_tp,
    start_tp,
)

if TYPE_CHECKING:
    from piecegraph.models import ModelFacts

console = Console()
if not console.is_terminal:  # logs and pipes: rich would wrap the wide table at 80 columns
    console = Console(width=180)


def _ints(text: str, option: str) -> list[int]:
    """``"1,10,256"`` -> ``[1, 10, 256]``; ``""`` or ``"none"`` -> ``[]``; anything else names the option."""
    return [] if text.strip().lower() == "none" else int_list(text, option)


# What --tp runs: piecegraph's own modes and eager. The others (torch.compile's, Meta's runner, the baked graph)
# would put the all-reduce where their own compilers decide, untested across ranks.
TP_MODES = ("eager", "full", "full-compiled", "piecewise", "breakable", "none")


def _modes(text: str, device: str, tp: int = 1) -> list[str]:
    from piecegraph.bench.modes import CPU_MODES, GPU_MODES, KNOWN_MODES

    if text == "all":
        names = list(GPU_MODES if device == "cuda" else CPU_MODES)
        return [m for m in names if m in TP_MODES] if tp > 1 else names
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in KNOWN_MODES]
    if unknown or not names:
        raise typer.BadParameter(f"unknown modes {unknown}; choose from {', '.join(KNOWN_MODES)}", param_hint="--modes")
    if tp > 1 and any(m not in TP_MODES for m in names):
        raise typer.BadParameter(f"--tp {tp} runs the modes {', '.join(TP_MODES)}; not "
                                 f"{', '.join(m for m in names if m not in TP_MODES)}", param_hint="--modes")
    return names


def _profile_spec(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    from piecegraph.bench.modes import KNOWN_MODES

    mode, _, batch = text.rpartition(":")
    if mode not in KNOWN_MODES or not batch.isdigit() or int(batch) < 1:
        raise typer.BadParameter(f"{text!r}: expected MODE:BATCH with a mode of {', '.join(KNOWN_MODES)}, "
                                 "e.g. piecewise:1", param_hint="--profile")
    return mode, int(batch)


def bench(
    model: str = typer.Option("auto", help=MODEL_HELP),
    quant: str = typer.Option("bf16", help="bf16 | fp8: the reference decoder's linears and experts in e4m3 "
                              "(FlashInfer's FP8 GEMMs on sm90, torch elsewhere)"),
    modes: str = typer.Option("all", help="comma-separated: eager,full,full-compiled,full-static,full-pieces,piecewise,"
                              "piecewise-static,breakable,auto,"
                              "torch.compile,reduce-overhead,graph-partition,baked-graph,meta-pcg,none "
                              "(all: every mode on GPU, eager,none on CPU)"),
    batches: str = typer.Option("1,10,256,1024", help="decode batch sizes (sequences per step)"),
    prefill: str = typer.Option("16,128,512,2048", help="packed prefill token totals, mixed lengths ('' for none)"),
    context: int = typer.Option(256, min=1, help="cached tokens per sequence in decode"),
    repeats: int = typer.Option(20, min=1, help="timed calls per cell (median reported)"),
    json_path: Path | None = typer.Option(None, "--json", help="write the result file (the one result schema: "
                                          "benchmark, env, rows, setup)"),  # noqa: B008
    plot_path: Path | None = typer.Option(None, "--plot", help="write a PNG: ms by batch, by tokens"),  # noqa: B008
    profile: str | None = typer.Option(None, help="MODE:BATCH: also profile one decode step (e.g. piecewise:1)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    attention: str = typer.Option("auto", help="attention backend of the paged KV caches: auto | torch | flashinfer "
                                  "(auto: FlashInfer on a GPU that has it, else torch)"),
    hf: bool = typer.Option(False, "--hf", help="load --model PATH as the Hugging Face model itself "
                            "(piecegraph.hf) instead of the reference decoder"),
    tp: int = typer.Option(1, min=1, help="tensor-parallel ranks: one process per GPU under torchrun (started "
                           "for you), rank 0 reports; the JSON records the world size"),
) -> None:
    """Time every capture mode side by side on decode steps and packed prefills (CUDA-event medians)."""
    from piecegraph.bench.harness import environment
    from piecegraph.bench.profile import attention_op_us
    from piecegraph.bench.report import payload
    from piecegraph.bench.sweep import run_sweep
    from piecegraph.models import model_facts
    from piecegraph.results.schema import write_result

    device = resolve_device(device)
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        check_writable(path, flag)
    backend = resolve_attention(attention, device)
    batch_list, prefill_list = _ints(batches, "--batches"), _ints(prefill, "--prefill")
    if not batch_list:
        raise typer.BadParameter("at least one decode batch is needed", param_hint="--batches")
    mode_list, spec = _modes(modes, device, tp), _profile_spec(profile)
    run = start_tp(tp, device)  # --tp > 1 outside torchrun: runs this command as its ranks and exits here
    reports = run.reports
    model = model if model != "auto" else ("qwen2.5-0.5b" if device == "cuda" else "tiny")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # bf16 is what serving runs; CPU tests need fp32
    net = shard_for_tp(load_model(model, device, dtype, hf=hf, quant=quant), run)
    facts = model_facts(net)  # asked once, after sharding: every stage below reads these
    _check_backend(facts, backend, net)
    op_us = attention_op_us(facts, backend, context)  # before the sweep: a sweep cut short still records it
    partition_default = _inductor_graph_partition()  # read before any mode patches Inductor's config

    def env_of(result: Any) -> dict[str, Any]:  # attention: the backend the caches resolved --attention to
        ranks = run.facts()
        return environment(facts, model, result.bandwidth_gbs, attention=result.attention_backend or backend,
                           quant=quant, world_size=ranks["world_size"], attention_option=attention,
                           context=context, repeats=repeats, batches=batch_list, prefill=prefill_list,
                           modes=mode_list, inductor_graph_partition=partition_default,
                           tp_backend=ranks["tp_backend"])

    def save_partial(result: Any) -> None:  # a run cut short still leaves the modes it finished
        if json_path and reports:
            data = payload({**env_of(result), "partial": True}, result.rows, result.modes, attention_op_us=op_us)
            write_result(json_path, **data)

    def log(line: str) -> None:  # plain: reasons and tracebacks hold brackets that rich would read as markup
        if reports:
            console.print(line, markup=False, highlight=False, soft_wrap=True)

    # A quantized model is also judged against its weights unquantized (seeded: the same random weights); not
    # kept here, so the sweep frees it after its references
    result = run_sweep(net, mode_list, batch_list, prefill_list, context=context, repeats=repeats, log=log,
                       on_mode=save_partial, attention=backend, keep_going=run.solo,
                       float_model=load_model(model, device, dtype, hf=hf) if quant != "bf16" and run.solo else None,
                       facts=facts)
    profiled = _run_profile(net, facts, spec, context, backend, reports) if spec else None
    if reports:
        _report(env_of(result), result, model, op_us, profiled, json_path, plot_path)
    run.finish()


def _report(env: dict[str, Any], result: Any, model: str, op_us: Any, profiled: Any, json_path: Path | None,
            plot_path: Path | None) -> None:
    """The sweep's table, the attention op's cost, the compact summary; then the JSON and the PNG if asked."""
    from piecegraph.bench.report import compact, payload, rich_table
    from piecegraph.results.schema import write_result

    context, tp = env["context"], env.get("world_size", 1)
    quant, ranks = " fp8" if env.get("quant") == "fp8" else "", f" x{tp} (tp)" if tp > 1 else ""
    console.print(rich_table(result.rows, f"{model} {env['dtype']}{quant} on {env['gpu']}{ranks}"
                                          f", torch {env['torch']}, {env['attention']} attention, "
                                          f"context {context}"))
    console.print(_op_table(op_us, env["attention"]))
    data = payload(env, result.rows, result.modes, profiled, attention_op_us=op_us)
    console.print(compact(data), markup=False, highlight=False, soft_wrap=True)
    if json_path:
        write_result(json_path, **data)
        console.print(f"wrote {json_path}")
    if plot_path:
        from piecegraph.bench.plot import plot

        plot(result.rows, plot_path, title=f"{model} {env['dtype']}, {env['gpu']}, torch {env['torch']}, "
                                           f"{env['attention']} attention")
        console.print(f"wrote {plot_path}")


def _check_backend(facts: ModelFacts, backend: str, net: torch.nn.Module) -> None:
    """Build a two-page cache with ``backend`` now, so a backend that cannot start here (a broken install, a
    dtype it does not attend in) is an error naming ``--attention`` before the sweep, not a traceback inside it."""
    from piecegraph.attention import KVCache

    try:
        cache = KVCache(facts.config, 2, dtype=facts.dtype, device=facts.device, backend=backend)
        if hasattr(net, "check_backend"):  # a Hugging Face model: its layers' constants (windows, softcaps)
            net.check_backend(cache.backend.name)
    except Exception as exc:  # noqa: BLE001  (whatever stops the backend, the user's fix is another --attention)
        raise typer.BadParameter(f"{backend!r} cannot run here: {type(exc).__name__}: {exc}",
                                 param_hint="--attention") from None


def _inductor_graph_partition() -> bool | None:
    """This torch's default ``torch._inductor.config.graph_partition`` (what reduce-overhead runs with)."""
    import torch._inductor.config as inductor_config

    return getattr(inductor_config, "graph_partition", None)


def _op_table(op_us: dict[str, Any], backend: str) -> Table:
    from piecegraph.bench.profile import OP_COST_CASES

    table = Table(title=f"attention op ({backend}): CPU us per call")
    table.add_column("case")
    table.add_column("us", justify="right")
    table.add_column("note", max_width=100, overflow="fold")
    failed = op_us.get("failed", {})
    for key, _, _ in OP_COST_CASES:
        value = op_us.get(key)
        table.add_row(key, "-" if value is None else f"{value:.1f}", failed.get(key, ""))
    return table


def _run_profile(net: torch.nn.Module, facts: ModelFacts, spec: tuple[str, int], context: int, backend: str,
                 reports: bool = True) -> dict:
    from piecegraph.bench.profile import profile_step

    mode, batch = spec
    try:
        result = profile_step(net, facts, mode, batch, context=context, attention=backend)
    except Exception as exc:  # noqa: BLE001  (the sweep's results still get written)
        result = {"mode": mode, "batch": batch, "skipped": f"failed: {type(exc).__name__}: {exc}"[:300]}
    if not reports:
        return result
    table = Table(title=f"profile: {mode}, decode batch {batch}")
    table.add_column("what")
    table.add_column("value", justify="right", max_width=100, overflow="fold")
    for key, value in result.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    return result
