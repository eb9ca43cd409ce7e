"""The serving benchmark's outputs: a rich table, the result file, and a PNG (matplotlib, Agg backend).

The file is the one result schema (:mod:`piecegraph.results.schema`) with ``benchmark`` ``"serve-bench"``: one
row per mode and concurrency (``mode``, ``concurrency``, throughput, TTFT, ITL, steps by graph kind, ...), and the
extra key ``setup``: per mode, what is not a row (its engine's ``capture`` report, ``decode_reference``,
``gpu_bound`` estimates, ``error``, ``wall_s``). :func:`results_of` turns a loaded file back into the per-mode
results the tables and the plot take.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from rich.table import Table

from piecegraph.results.schema import Result

_COLUMNS = (
    ("mode", "mode", "{}"), ("conc", "concurrency", "{}"), ("reqs", "requests", "{}"),
    ("req/s", "request_throughput", "{:.2f}"), ("out tok/s", "output_tok_s", "{:.0f}"),
    ("total tok/s", "total_tok_s", "{:.0f}"), ("TTFT mean", "ttft_mean_ms", "{:.1f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.1f}"), ("TTFT p99", "ttft_p99_ms", "{:.1f}"),
    ("ITL mean", "itl_mean_ms", "{:.2f}"), ("ITL p50", "itl_p50_ms", "{:.2f}"), ("ITL p99", "itl_p99_ms", "{:.2f}"),
    ("graph steps", "graph_share", "{:.0%}"), ("pad", "padding_share", "{:.0%}"), ("preempt", "preemptions", "{}"),
    ("prefix hit", "prefix_hit_rate", "{:.0%}"),  # prompt tokens found in the prefix cache
)


def table(results: Sequence[dict[str, Any]], title: str) -> Table:
    """One row per mode and concurrency (ms for latencies); failed modes show their error. With a GPU-bound
    estimate (auto on CUDA), its rows and each row's share of it; the estimate's rows show its decode step (graph
    replay, LM head and argmax, back to back) under ITL p50: the ITL an engine with no host time left would see."""
    bounds = gpu_bounds(results)
    steps = {e["concurrency"]: e.get("decode_step_ms") for result in results for e in result.get("gpu_bound", ())}
    out = Table(title=title)
    for header, _, _ in _COLUMNS:
        out.add_column(header, justify="left" if header == "mode" else "right")
    out.add_column("of GPU bound", justify="right")
    itl_p50 = [key for _, key, _ in _COLUMNS].index("itl_p50_ms")
    blank = ["-"] * (len(_COLUMNS) - 5)  # the estimate's row: mode, conc, reqs, req/s, out tok/s, then these
    for result in results:
        if result.get("error"):
            out.add_row(result["mode"], "-", f"[red]failed: {result['error'][:80]}[/]")
        for row in result["rows"]:
            bound = bounds.get(row["concurrency"])
            share = row["output_tok_s"] / bound if bound and row.get("output_tok_s") else None
            out.add_row(*(_fmt(fmt, row.get(key)) for _, key, fmt in _COLUMNS), _fmt("{:.0%}", share))
        ref = result.get("decode_reference")
        if ref:
            out.add_row(f"{result['mode']}: decode-only full-graph loop", "1", "-", *["-"] * 6,
                        *(_fmt("{:.2f}", ref[k]) for k in ("itl_mean_ms", "itl_p50_ms", "itl_p99_ms")), "100%")
    for c, bound in sorted(bounds.items()):
        cells = list(blank)
        cells[itl_p50 - 5] = _fmt("{:.2f}", steps.get(c))
        out.add_row("GPU-bound estimate (graph steps back to back)", str(c), "-", "-", f"{bound:.0f}", *cells,
                    "100%")
    return out


def gpu_bounds(results: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Concurrency -> the GPU-bound output tok/s estimated in the sweep (see :mod:`piecegraph.serve.gpu_bound`)."""
    return {e["concurrency"]: e["gpu_bound_output_tok_s"] for result in results
            for e in result.get("gpu_bound", ()) if e.get("gpu_bound_output_tok_s")}


def capture_table(results: Sequence[dict[str, Any]]) -> Table:
    """What each mode's engine captured at start: sizes, seconds, pool MiB."""
    out = Table(title="graphs captured at engine start (auto: which module decode steps replay, per full size, and "
                      "steps with prompt tokens, per full-mixed size)")
    for header in ("mode", "module", "sizes", "trace s", "compile s", "JIT build s", "capture s",
                   "setup s (all of it)", "pool MiB", "before capture: estimated / measured MiB", "replays"):
        out.add_column(header, justify="left" if header in ("mode", "module", "sizes", "replays") else "right")
    for result in results:
        report = result.get("capture") or {"modules": {}, "pool_mib": 0.0}
        for kind, module in report["modules"].items():
            sizes = module["sizes"]
            shown = f"{len(sizes)}: {sizes[0]}..{sizes[-1]}" if sizes else "none"
            picks = {"full": _picks(report.get("decode_choice", {}), "full"),
                     "full-mixed": _picks(report.get("mixed_choice", {}), "full-mixed")}.get(kind, "")
            stages = module.get("startup") or {}
            out.add_row(result["mode"], kind, shown,
                        *(f"{stages.get(k) or 0.0:.1f}" for k in ("trace_s", "compile_s", "jit_build_s")),
                        f"{module['capture_s']:.1f}", f"{module['setup_s']:.1f}", f"{report['pool_mib']:.0f}",
                        _before_capture(module.get("graph_memory") or {}), picks)
    return out


def _before_capture(memory: dict[str, Any]) -> str:
    """``134 / 314``: the module's pool estimated from its graph and measured before its first capture (MiB; ``-``
    where there is none: CPU, or no estimate)."""
    return " / ".join("-" if not memory.get(key) else f"{memory[key] / 2**20:.0f}"
                      for key in ("pool_estimate_bytes", "pool_measured_bytes"))


def _picks(choice: dict[Any, dict[str, Any]], graph: str) -> str:
    """``full 10, piecewise 2 (measured)``: how many sizes replay ``graph`` (``full`` or ``full-mixed``) and how
    many the piecewise module (the JSON's capture report holds both times per size)."""
    if not choice:
        return ""
    counts = {k: sum(c["pick"] == k for c in choice.values()) for k in (graph, "piecewise")}
    how = sorted({c["by"] for c in choice.values()})
    return f"{graph} {counts[graph]}, piecewise {counts['piecewise']} ({', '.join(how)})"


def phase_table(results: Sequence[dict[str, Any]]) -> Table:
    """Where a step's host time goes, per mode, concurrency and graph kind (mean ms per step)."""
    from piecegraph.serve.stats import PHASES

    out = Table(title="mean ms per step by phase (forward_launch is host time; the device wait is in sample_sync, "
                      "overlapped: the previous step's tokens, read while this step runs); plan us: the attention "
                      "backend's plan, inside metadata or forward_launch")
    for header in ("mode", "conc", "kind", "steps", "ms / step", *PHASES, "plan us", "plans / step"):
        out.add_column(header, justify="left" if header in ("mode", "kind") else "right")
    for result in results:
        for row in result["rows"]:
            for kind, phases in row.get("phase_ms", {}).items():
                plan_us, plans = row.get("plan_us", {}).get(kind), row.get("plans_per_step", {}).get(kind)
                out.add_row(row["mode"], str(row["concurrency"]), kind, str(row["steps_by_kind"][kind]),
                            f"{row['ms_per_step'][kind]:.2f}", *(f"{phases[p]:.2f}" for p in PHASES),
                            _fmt("{:.0f}", plan_us), _fmt("{:.2f}", plans))
    return out


def _fmt(fmt: str, value: Any) -> str:
    return "-" if value is None else fmt.format(value)


def payload(env: dict[str, Any], results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The result file's object: every mode's rows in ``rows`` (each names its ``mode``), the rest of each mode's
    result under ``setup[mode]``. Constraint: mode names are unique (the command refuses a repeated one)."""
    rows = [{"mode": result["mode"], **row} for result in results for row in result["rows"]]
    setup = {result["mode"]: {k: v for k, v in result.items() if k not in ("mode", "rows")} for result in results}
    return {"benchmark": "serve-bench", "env": env, "rows": rows, "setup": setup}


def results_of(result: Result) -> list[dict[str, Any]]:
    """A loaded ``serve-bench`` file as the sweep's per-mode results (``mode``, ``rows`` and the mode's
    ``setup`` entries), modes in the order they ran, for :func:`table` and :func:`plot`."""
    setup = result.extra.get("setup") or {}
    modes = list(dict.fromkeys([*setup, *(row["mode"] for row in result.rows)]))
    return [{"mode": mode, **setup.get(mode, {}), "rows": [row for row in result.rows if row["mode"] == mode]}
            for mode in modes]



def plot(results: Sequence[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Output tok/s and TTFT p50 by concurrency (log x), one line per mode; the reference ITL as a note."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_tok_s", "output tokens / s"), ("ttft_p50_ms", "TTFT p50 (ms)"), ("itl_p50_ms", "ITL p50 (ms)"))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    concurrencies = sorted({r["concurrency"] for result in results for r in result["rows"]})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.4))
    for ax, (key, label) in zip(axes, panels):
        for i, result in enumerate(results):  # one color per mode in every panel
            points = sorted((r["concurrency"], r[key]) for r in result["rows"] if r.get(key) is not None)
            if points:
                ax.plot(*zip(*points), marker="o", label=result["mode"], color=colors[i % len(colors)])
            ref = result.get("decode_reference")
            if key == "itl_p50_ms" and ref:
                ax.plot([1], [ref["itl_p50_ms"]], marker="*", markersize=13, linestyle="none", color="black",
                        label="decode-only full-graph loop")
        ax.set_xscale("log")
        ax.set_yscale("log")
        if concurrencies:
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
            ax.minorticks_off()
        ax.set_xlabel("concurrency (closed-loop clients)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    for ax in (axes[0], axes[-1]):
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
