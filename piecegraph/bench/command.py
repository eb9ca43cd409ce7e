"""``piecegraph bench``: the command line of the benchmark (sweep, table, JSON, plot, optional profile)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from piecegraph.cli_common import (
    MODEL_HELP,
    default_model,
    int_list,
    load_model,
    resolve_run_options,
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


def _quants(text: str) -> list[str]:
    """``--quant``: one value or a comma list (``bf16,fp8``), each of ``QUANTS``, unrepeated; bf16 first (its
    logits are the accuracy reference of the others)."""
    from piecegraph.cli_common import QUANTS

    names = list(dict.fromkeys(q.strip() for q in text.split(",") if q.strip()))
    bad = [q for q in names if q not in QUANTS]
    if bad or not names:
        raise typer.BadParameter(f"{text!r}: one or more of {', '.join(QUANTS)}, comma-separated "
                                 f"(unknown: {', '.join(bad) or 'none given'})", param_hint="--quant")
    return sorted(names, key=lambda q: q != "bf16")


def _profile_specs(text: str | None) -> list[tuple[str, int]]:
    """``--profile``: ``MODE:BATCH`` or a comma list of them, e.g. ``full-static:1,baked-graph:1``."""
    if not text:
        return []
    from piecegraph.bench.modes import KNOWN_MODES

    specs = []
    for part in text.split(","):
        mode, _, batch = part.strip().rpartition(":")
        if mode not in KNOWN_MODES or not batch.isdigit() or int(batch) < 1:
            raise typer.BadParameter(f"{part!r}: expected MODE:BATCH (or a comma list of them) with a mode of "
                                     f"{', '.join(KNOWN_MODES)}, e.g. piecewise:1", param_hint="--profile")
        specs.append((mode, int(batch)))
    return specs


def bench(
    model: str = typer.Option("auto", help=MODEL_HELP),
    quant: str = typer.Option("bf16", help="bf16 | fp8 | bf16,fp8: the reference decoder's linears and experts in "
                              "e4m3 (FlashInfer's FP8 GEMMs on sm90, torch elsewhere); a comma list builds the model "
                              "once per value and writes every row, with its quant, into one result, plus each "
                              "quantized model's accuracy against bf16 (teacher-forced logits)"),
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
    profile: str | None = typer.Option(None, help="MODE:BATCH: also profile one decode step (e.g. piecewise:1); a "
                                       "comma list profiles each (the first goes to the result's profile, all of "
                                       "them to its profiles)"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    attention: str = typer.Option("auto", help="attention backend of the paged KV caches: auto | torch | flashinfer "
                                  "(auto: FlashInfer on a GPU that has it, else torch)"),
    hf: bool = typer.Option(False, "--hf", help="load --model PATH as the Hugging Face model itself "
                            "(piecegraph.hf) instead of the reference decoder"),
    tp: int = typer.Option(1, min=1, help="tensor-parallel ranks: one process per GPU under torchrun (started "
                           "for you), rank 0 reports; the JSON records the world size"),
) -> None:
    """Time every capture mode side by side on decode steps and packed prefills (CUDA-event medians)."""
    device, backend = resolve_run_options(device, attention, {"--json": json_path, "--plot": plot_path})
    batch_list, prefill_list = _ints(batches, "--batches"), _ints(prefill, "--prefill")
    if not batch_list:
        raise typer.BadParameter("at least one decode batch is needed", param_hint="--batches")
    mode_list, spec = _modes(modes, device, tp), _profile_specs(profile)
    quants = _quants(quant)
    run = start_tp(tp, device)  # --tp > 1 outside torchrun: runs this command as its ranks and exits here
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # bf16 is what serving runs; CPU tests need fp32
    state = _BenchRun(run=run, model=default_model(model, device), device=device, dtype=dtype, hf=hf,
                      backend=backend, attention=attention, quants=quants, modes=mode_list, batches=batch_list,
                      prefill=prefill_list, context=context, repeats=repeats, spec=spec, json_path=json_path,
                      partition_default=_inductor_graph_partition())  # before any mode patches Inductor's config
    for q in quants:  # one model at a time: the A2.7B shape is 28.6 GB in bf16
        state.sweep_quant(q)
    state.finish(plot_path)


@dataclass
class _BenchRun:
    """One ``piecegraph bench`` run: its resolved options (``backend``: what ``--attention`` resolved to,
    ``attention``: the option as given), its ``--tp`` place, and what the quants swept so far left behind."""

    run: Any  # piecegraph.parallel.launch.TPRun
    model: str
    device: str
    dtype: torch.dtype
    hf: bool
    backend: str
    attention: str
    quants: list[str]
    modes: list[str]
    batches: list[int]
    prefill: list[int]
    context: int
    repeats: int
    spec: list[tuple[str, int]]  # --profile's modes and batches
    json_path: Path | None
    partition_default: bool | None  # torch's default Inductor graph_partition
    done: Any = None  # the finished quants' rows, a SweepResult
    accuracy: list[dict[str, Any]] = field(default_factory=list)  # each quantized model's row against bf16
    extra: dict[str, Any] = field(default_factory=dict)  # more top-level result keys (expert kernel tables, ...)
    reference: torch.Tensor | None = None  # the bf16 model's teacher-forced logits
    facts: ModelFacts | None = None  # the model being swept (the last one's, once done)
    op_us: dict[str, Any] | None = None  # the attention op's cost, measured with the first model
    quant: str = ""  # the quant being swept
    profiled: dict | None = None

    def __post_init__(self) -> None:
        from piecegraph.bench.sweep import SweepResult

        self.done = SweepResult([])

    @property
    def label(self) -> str | None:
        """The quant each row is labelled with: only in a run of several."""
        return self.quant if len(self.quants) > 1 else None

    def env(self, result: Any) -> dict[str, Any]:
        """The result's ``env``; ``attention``: the backend the caches resolved --attention to."""
        from piecegraph.bench.harness import environment

        ranks = self.run.facts()
        return environment(self.facts, self.model, result.bandwidth_gbs,
                           attention=result.attention_backend or self.backend, quant=",".join(self.quants),
                           world_size=ranks["world_size"], attention_option=self.attention, context=self.context,
                           repeats=self.repeats, batches=self.batches, prefill=self.prefill, modes=self.modes,
                           inductor_graph_partition=self.partition_default, tp_backend=ranks["tp_backend"])

    def save_partial(self, result: Any) -> None:
        """After each mode: a run cut short still leaves the modes it finished (with --json, on the reporting
        rank)."""
        from piecegraph.bench.report import payload
        from piecegraph.results.schema import write_result

        if self.json_path and self.run.reports:
            result = _merged(self.done, result, self.label)
            data = payload({**self.env(result), "partial": True}, result.rows, result.modes, attention_op_us=self.op_us)
            write_result(self.json_path, **{**data, "rows": data["rows"] + self.accuracy, **self.extra})

    def log(self, line: str) -> None:
        """Plain: reasons and tracebacks hold brackets that rich would read as markup."""
        if self.run.reports:
            console.print(line, markup=False, highlight=False, soft_wrap=True)

    def sweep_quant(self, quant: str) -> None:
        """Build the model in ``quant``, judge its accuracy, sweep every mode over it, profile it if it is the
        last; then free it before the next is built."""
        from piecegraph.bench.profile import attention_op_us
        from piecegraph.bench.sweep import run_sweep
        from piecegraph.models import model_facts

        self.quant, solo = quant, self.run.solo
        net = shard_for_tp(load_model(self.model, self.device, self.dtype, hf=self.hf, quant=quant, optimize=solo),
                           self.run)
        self.facts = model_facts(net)  # asked once, after sharding: every stage below reads these
        if quant == self.quants[0]:
            _check_backend(self.facts, self.backend, net)
            self.op_us = attention_op_us(self.facts, self.backend, self.context)  # before the sweep: kept if cut short
        tables = _expert_tables(net)
        if tables:
            self.extra.setdefault("expert_kernels", {})[quant] = tables
        # A quantized model alone is also judged against its weights unquantized (seeded: the same random
        # weights); not kept here, so the sweep frees it after its references. With bf16 in the run, the bf16
        # rows and the accuracy row say that instead, and no second model is resident.
        alone = quant != "bf16" and solo and "bf16" not in self.quants
        self._judge_accuracy(net)
        result = run_sweep(net, self.modes, self.batches, self.prefill, context=self.context, repeats=self.repeats,
                           log=self.log, on_mode=self.save_partial, attention=self.backend, keep_going=solo,
                           float_model=load_model(self.model, self.device, self.dtype, hf=self.hf) if alone else None,
                           facts=self.facts)
        self.done = _merged(self.done, result, self.label)
        if self.spec and quant == self.quants[-1]:
            profiles = [_run_profile(net, self.facts, spec, self.context, self.backend, self.run.reports)
                        for spec in self.spec]
            self.profiled = profiles[0]
            if len(profiles) > 1:
                self.extra["profiles"] = profiles
        del net, result
        _free_device(self.device)

    def _judge_accuracy(self, net: torch.nn.Module) -> None:
        """With bf16 and other quants in one solo run of a reference decoder: keep bf16's teacher-forced logits
        (first in the run) and add each other quant's accuracy row against them."""
        from piecegraph.bench.accuracy import accuracy_row, teacher_forced_logits

        if not (self.run.solo and "bf16" in self.quants and len(self.quants) > 1 and hasattr(net, "logits")):
            return
        logits = teacher_forced_logits(net, self.facts, backend=self.backend)
        if self.quant == "bf16":
            self.reference = logits
            return
        self.accuracy.append(accuracy_row(self.quant, logits, self.reference))
        self.log(_accuracy_line(self.accuracy[-1]))

    def finish(self, plot_path: Path | None) -> None:
        """The small-linear kernel choices, the report (reporting rank) and the end of the ``--tp`` run."""
        from piecegraph.models.gemv import choice_table

        if choice_table():  # which small-batch linears took the Triton kernel, with both kernels' measured times
            self.extra["small_linear_choices"] = choice_table()
        if self.run.reports:
            _report(self.env(self.done), self.done, self.model, self.op_us, self.profiled, self.json_path, plot_path,
                    self.accuracy, self.extra)
        self.run.finish()


def _merged(done: Any, result: Any, quant: str | None) -> Any:
    """``done``'s rows and setup facts, then ``result``'s labelled with ``quant`` (a run of several --quant
    values: each row's ``quant``, setup keys ``"<mode> <quant>"``); the bandwidth and backend are ``result``'s."""
    from piecegraph.bench.sweep import SweepResult

    for row in result.rows:
        row.quant = quant
    modes = {(m if quant is None else f"{m} {quant}"): f for m, f in result.modes.items()}
    return SweepResult(done.rows + result.rows, {**done.modes, **modes}, result.bandwidth_gbs,
                       result.attention_backend)


def _expert_tables(net: torch.nn.Module) -> list[dict[str, Any]]:
    """The FP8 experts' measured choice per token count (:meth:`FP8Experts.kernel_table`; every layer shares
    its shape's), or ``[]``."""
    for module in net.modules():
        if hasattr(module, "kernel_table") and module.kernel_table():
            return module.kernel_table()
    return []


def _free_device(device: str) -> None:
    """The finished model's memory back before the next one builds."""
    import gc

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _accuracy_line(row: dict[str, Any]) -> str:
    """One accuracy row (:func:`piecegraph.bench.accuracy.accuracy_row`) for the log."""
    return (f"accuracy {row['quant']} vs {row['against']}: logits rel err {row['logits_rel_err']:.2e}, top-1 "
            f"agreement {row['top1_agreement']:.1%} over {row['tokens']} teacher-forced tokens")


def _report(env: dict[str, Any], result: Any, model: str, op_us: Any, profiled: Any, json_path: Path | None,
            plot_path: Path | None, accuracy: list[dict[str, Any]] | None = None,
            extra: dict[str, Any] | None = None) -> None:
    """The sweep's table, the attention op's cost, the compact summary; then the JSON and the PNG if asked.
    ``accuracy``: rows appended to the result's; ``extra``: more top-level keys (``expert_kernels``)."""
    from piecegraph.bench.report import compact, payload, rich_table
    from piecegraph.results.schema import write_result

    context, tp = env["context"], env.get("world_size", 1)
    quant = "" if env.get("quant") in (None, "bf16") else f" {env['quant']}"
    ranks = f" x{tp} (tp)" if tp > 1 else ""
    console.print(rich_table(result.rows, f"{model} {env['dtype']}{quant} on {env['gpu']}{ranks}"
                                          f", torch {env['torch']}, {env['attention']} attention, "
                                          f"context {context}"))
    console.print(_op_table(op_us, env["attention"]))
    data = payload(env, result.rows, result.modes, profiled, attention_op_us=op_us)
    data = {**data, "rows": data["rows"] + (accuracy or []), **(extra or {})}
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
        if key == "timeline":  # the per-kernel rows go to the JSON; the table keeps their summary
            value = {k: v for k, v in value.items() if k != "rows"}
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    return result
