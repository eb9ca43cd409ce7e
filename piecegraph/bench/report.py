"""The benchmark's outputs: the rich table, the result file, a compact pivot, and the results file name.

``python -m piecegraph.bench.report RESULTS.json [--plot OUT.png] [--name]`` works on a saved file (so does
``piecegraph report``).

The file is the one result schema (:mod:`piecegraph.results.schema`; ``benchmarks/README.md`` documents it for
readers of committed results) with ``benchmark`` ``"bench"``::

    {"benchmark": "bench",
     "env": {<the schema's keys>, "attention_option", "cuda", "python", "piecegraph", "model_config",
             "bandwidth_gbs", "context", "repeats", "batches", "prefill", "modes", "inductor_graph_partition",
             "tp_backend", "partial"?},
     "rows": [{"mode", "phase", "batch" | "tokens", "ms", "tok_s", "hbm_frac", "loop_ms"?, "loop_hbm_frac"?
               (decode: calls back to back, the overlapped engine's pace), "setup_s", "pool_mib",
               "rel_err", "rel_err_float"? (--quant: against the unquantized weights), "seqs"?, "skipped"?,
               "note"?, "quant"? (a run of several --quant values)},
              {"key": "accuracy", "phase": "accuracy", "quant", "against", "tokens", "logits_rel_err",
               "logits_rel_err_max", "top1_agreement", ...}? (one per quantized model: piecegraph.bench.accuracy)],
     "setup": {"<mode>" ("<mode> <quant>" in a run of several --quant values): {"setup_s", "capture_s",
               "pool_mib", "pieces", "sizes", ...} | {"skipped": reason}},
     "attention_op_us": {"decode_1", "prefill_512", "failed"?: {case: reason}},
     "profile": {...}?,
     "expert_kernels": {"<quant>": [{"tokens", "kernel", "fp8_us", "dense_us", "triton_us"}]}?
                       (FP8Experts.kernel_table)}
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from piecegraph.bench.harness import Row
from piecegraph.results.report import canonical_name
from piecegraph.results.schema import check, load_result


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _eager_ms(rows: Sequence[Row]) -> dict[tuple[str, int, str | None], float]:
    return {(r.phase, r.size, r.quant): r.ms for r in rows if r.mode == "eager" and r.ms}


def mode_label(row: dict[str, Any]) -> str:
    """A JSON row's column in :func:`compact` and its key under ``setup``: the mode, with the quantization in a
    run of several (``"piecewise fp8"``)."""
    return row["mode"] if row.get("quant") is None else f"{row['mode']} {row['quant']}"


def rich_table(rows: Sequence[Row], title: str) -> Table:
    """Every row, grouped by phase and size, with the speed-up over eager and the skip reasons; where decode rows
    have ``loop_ms``, its columns (``loop ms``, ``loop HBM``) follow ``HBM floor``."""
    table = Table(title=title)
    floats = any(r.rel_err_float is not None for r in rows)  # a quantized model: also against its float weights
    quants = any(r.quant is not None for r in rows)  # a run of several --quant values: which one each row is
    loops = any(r.loop_ms is not None for r in rows)  # decode steps back to back (older results have none)
    for col in ("phase", "size", "mode", *(("quant",) if quants else ()), "ms", "tok/s", "x eager", "HBM floor",
                *(("loop ms", "loop HBM") if loops else ()), "rel err", *(("vs unquantized",) if floats else ()),
                "setup s", "pool MiB"):
        table.add_column(col, justify="left" if col in ("phase", "mode", "quant") else "right")
    table.add_column("note", justify="left", overflow="fold", max_width=48)
    eager = _eager_ms(rows)
    for r in sorted(rows, key=lambda r: (r.phase != "decode", r.size)):
        base = eager.get((r.phase, r.size, r.quant))
        ratio = f"{base / r.ms:.1f}" if base and r.ms else "-"
        table.add_row(r.phase, str(r.size), r.mode, *((r.quant or "",) if quants else ()), _fmt(r.ms, ".3f"),
                      _fmt(r.tok_s, ",.0f"), ratio, _fmt(r.hbm_frac, ".1%"),
                      *((_fmt(r.loop_ms, ".3f"), _fmt(r.loop_hbm_frac, ".1%")) if loops else ()),
                      _fmt(r.rel_err, ".1e"),
                      *((_fmt(r.rel_err_float, ".1e"),) if floats else ()), _fmt(r.setup_s, ".1f"),
                      _fmt(r.pool_mib, ".0f"), r.skipped or r.note or "")
    return table


def payload(env: dict[str, Any], rows: Sequence[Row], modes: dict[str, Any],
            profile: dict[str, Any] | None = None, attention_op_us: dict[str, Any] | None = None) -> dict[str, Any]:
    """The result file's object (the one result schema): ``modes`` (each mode's setup facts) goes under ``setup``;
    ``attention_op_us`` and ``profile`` are extra keys where given."""
    data: dict[str, Any] = {"benchmark": "bench", "env": env, "rows": [r.to_json() for r in rows], "setup": modes}
    if attention_op_us is not None:
        data["attention_op_us"] = attention_op_us
    if profile is not None:
        data["profile"] = profile
    return data



def compact(data: dict[str, Any]) -> str:
    """A plain-text pivot of a JSON payload: one line per (phase, size), one column of ms per mode, then one line
    of ``loop_ms`` per decode batch where the rows have it.

    Plain text on purpose: it goes into logs and closing notes, where a rich table's box drawing gets mangled.
    """
    accuracy = [r for r in data["rows"] if r.get("phase") == "accuracy"]  # quantized vs unquantized logits
    rows = [r for r in data["rows"] if r.get("phase") != "accuracy"]
    modes = list(dict.fromkeys(mode_label(r) for r in rows))
    keys = list(dict.fromkeys((r["phase"], r.get("batch", r.get("tokens"))) for r in rows))
    cell = {(r["phase"], r.get("batch", r.get("tokens")), mode_label(r)): r for r in rows}
    width = max(9, *(len(m) + 1 for m in modes))
    env = data.get("env", {})
    title = (f"ms per step, median ({env.get('gpu')}, torch {env.get('torch')}, {env.get('model')} "
             f"{env.get('dtype')}, {env.get('attention') or '?'} attention, context {env.get('context')}, "
             f"{env.get('bandwidth_gbs')} GB/s copy)")
    lines = [title,
             f"{'phase':8s}{'size':>6s}" + "".join(f"{m:>{width}s}" for m in modes)]
    for phase, size in keys:
        values = []
        for m in modes:
            r = cell.get((phase, size, m), {})
            values.append("skip" if r.get("skipped") or r.get("ms") is None else f"{r['ms']:.3f}")
        lines.append(f"{phase:8s}{size:>6d}" + "".join(f"{v:>{width}s}" for v in values))
    lines += _loop_lines(cell, [size for phase, size in keys if phase == "decode"], modes, width)
    facts = data.get("setup", {})
    for label, key, spec in (("setup s", "setup_s", ".1f"), ("pool MiB", "pool_mib", ".0f")):
        lines.append(f"{label:14s}" + "".join(f"{_fmt(facts.get(m, {}).get(key), spec):>{width}s}" for m in modes))
    for r in accuracy:
        lines.append(f"accuracy {r['quant']} vs {r['against']} over {r['tokens']} teacher-forced tokens: logits "
                     f"rel err {r['logits_rel_err']:.2e} (worst token {r['logits_rel_err_max']:.2e}), top-1 "
                     f"agreement {r['top1_agreement']:.1%}")
    op_us = data.get("attention_op_us") or {}
    if op_us:
        cells = [f"{k} {'-' if v is None else format(v, '.1f')}" for k, v in op_us.items() if k != "failed"]
        lines.append(f"attention op CPU us per call: {', '.join(cells)}"
                     + (f" (failed: {op_us['failed']})" if op_us.get("failed") else ""))
    profile = data.get("profile") or {}
    if profile:
        lines.append(f"profile {profile.get('mode')} batch {profile.get('batch')}: "
                     f"{profile.get('verdict') or profile.get('skipped')}")
    return "\n".join(lines)


def _loop_lines(cell: dict[tuple[str, int, str], dict[str, Any]], sizes: Sequence[int], modes: Sequence[str],
                width: int) -> list[str]:
    """:func:`compact`'s decode ``loop_ms`` lines, one per batch that has any (none for older results)."""
    sizes = [s for s in sizes if any(cell.get(("decode", s, m), {}).get("loop_ms") is not None for m in modes)]
    if not sizes:
        return []
    lines = ["decode loop ms per step (calls back to back, no sync: the overlapped engine's pace)"]
    for size in sizes:
        values = [_fmt(cell.get(("decode", size, m), {}).get("loop_ms"), ".3f") for m in modes]
        lines.append(f"{'loop':8s}{size:>6d}" + "".join(f"{v:>{width}s}" for v in values))
    return lines


def result_stem(data: dict[str, Any]) -> str:
    """The committed name of a result without ``.json`` (scripts add ``.json`` and ``.png``):
    ``<date>_<gpu>_bench_modes_<attention>[...]`` (:func:`~piecegraph.results.report.default_what`)."""
    return canonical_name(check(data)).removesuffix(".json")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m piecegraph.bench.report RESULTS.json [--plot OUT.png] [--name]``: print the compact table,
    redraw the plot from saved rows, or print the result's committed name without ``.json``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m piecegraph.bench.report")
    parser.add_argument("results", type=Path)
    parser.add_argument("--plot", type=Path, help="draw the PNG from the saved rows")
    parser.add_argument("--name", action="store_true", help="print <date>_<gpu>_bench_modes_<attention> and exit")
    args = parser.parse_args(argv)
    result = load_result(args.results)
    data = result.to_json()
    if args.name:
        print(result_stem(data))
        return
    if args.plot:
        from piecegraph.bench.plot import plot_result

        plot_result(result, args.plot)
    print(compact(data))


if __name__ == "__main__":
    main(sys.argv[1:])
