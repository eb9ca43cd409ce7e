"""The benchmark's outputs: the rich table, the JSON file, a compact pivot, and the results file name.

``python -m piecegraph.bench.report RESULTS.json [--plot OUT.png] [--name]`` works on a saved file.

JSON layout (``benchmarks/README.md`` documents it for readers of committed results)::

    {"env": {"gpu", "torch", "cuda", "python", "piecegraph", "model", "model_config", "dtype", "date",
             "bandwidth_gbs", "context", "repeats", "attention", "attention_backend",
             "inductor_graph_partition", ...},
     "modes": {"<mode>": {"setup_s", "capture_s", "pool_mib", "pieces", "sizes"} | {"skipped": reason}},
     "rows": [{"mode", "phase", "batch" | "tokens", "ms", "tok_s", "hbm_frac", "setup_s", "pool_mib",
               "rel_err", "rel_err_float"? (--quant: against the unquantized weights), "seqs"?, "skipped"?,
               "note"?}],
     "attention_op_us": {"decode_1", "prefill_512", "failed"?: {case: reason}},
     "profile": {...}?}
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from piecegraph.bench.harness import Row


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _eager_ms(rows: Sequence[Row]) -> dict[tuple[str, int], float]:
    return {(r.phase, r.size): r.ms for r in rows if r.mode == "eager" and r.ms}


def rich_table(rows: Sequence[Row], title: str) -> Table:
    """Every row, grouped by phase and size, with the speed-up over eager and the skip reasons."""
    table = Table(title=title)
    floats = any(r.rel_err_float is not None for r in rows)  # a quantized model: also against its float weights
    for col in ("phase", "size", "mode", "ms", "tok/s", "x eager", "HBM floor", "rel err",
                *(("vs unquantized",) if floats else ()), "setup s", "pool MiB"):
        table.add_column(col, justify="left" if col in ("phase", "mode") else "right")
    table.add_column("note", justify="left", overflow="fold", max_width=48)
    eager = _eager_ms(rows)
    for r in sorted(rows, key=lambda r: (r.phase != "decode", r.size)):
        base = eager.get((r.phase, r.size))
        ratio = f"{base / r.ms:.1f}" if base and r.ms else "-"
        table.add_row(r.phase, str(r.size), r.mode, _fmt(r.ms, ".3f"), _fmt(r.tok_s, ",.0f"), ratio,
                      _fmt(r.hbm_frac, ".1%"), _fmt(r.rel_err, ".1e"),
                      *((_fmt(r.rel_err_float, ".1e"),) if floats else ()), _fmt(r.setup_s, ".1f"),
                      _fmt(r.pool_mib, ".0f"), r.skipped or r.note or "")
    return table


def payload(env: dict[str, Any], rows: Sequence[Row], modes: dict[str, Any],
            profile: dict[str, Any] | None = None, attention_op_us: dict[str, Any] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"env": env, "modes": modes, "rows": [r.to_json() for r in rows]}
    if attention_op_us is not None:
        data["attention_op_us"] = attention_op_us
    if profile is not None:
        data["profile"] = profile
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def compact(data: dict[str, Any]) -> str:
    """A plain-text pivot of a JSON payload: one line per (phase, size), one column of ms per mode.

    Plain text on purpose: it goes into logs and closing notes, where a rich table's box drawing gets mangled.
    """
    rows = data["rows"]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    keys = list(dict.fromkeys((r["phase"], r.get("batch", r.get("tokens"))) for r in rows))
    cell = {(r["phase"], r.get("batch", r.get("tokens")), r["mode"]): r for r in rows}
    width = max(9, *(len(m) + 1 for m in modes))
    env = data.get("env", {})
    title = (f"ms per step, median ({env.get('gpu')}, torch {env.get('torch')}, {env.get('model')} "
             f"{env.get('dtype')}, {env.get('attention_backend', '?')} attention, context {env.get('context')}, "
             f"{env.get('bandwidth_gbs')} GB/s copy)")
    lines = [title,
             f"{'phase':8s}{'size':>6s}" + "".join(f"{m:>{width}s}" for m in modes)]
    for phase, size in keys:
        values = []
        for m in modes:
            r = cell.get((phase, size, m), {})
            values.append("skip" if r.get("skipped") or r.get("ms") is None else f"{r['ms']:.3f}")
        lines.append(f"{phase:8s}{size:>6d}" + "".join(f"{v:>{width}s}" for v in values))
    facts = data.get("modes", {})
    for label, key, spec in (("setup s", "setup_s", ".1f"), ("pool MiB", "pool_mib", ".0f")):
        lines.append(f"{label:14s}" + "".join(f"{_fmt(facts.get(m, {}).get(key), spec):>{width}s}" for m in modes))
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


def result_name(env: dict[str, Any]) -> str:
    """``<date>_<gpu>_torch<version>_<attention>``: the file name of a committed result (benchmarks/README.md).

    ``NVIDIA H200`` -> ``h200``, ``2.11.0+cu128`` -> ``torch2.11.0``, the resolved attention backend last
    (absent in files from before paged attention): short, sortable by date, no spaces.
    """
    gpu = re.sub(r"[^a-z0-9]+", "-", str(env.get("gpu", "unknown")).lower().replace("nvidia", "")).strip("-")
    torch_version = str(env.get("torch", "unknown")).split("+")[0]
    name = f"{env.get('date', 'undated')}_{gpu or 'unknown'}_torch{torch_version}"
    backend = re.sub(r"[^a-z0-9]+", "-", str(env.get("attention_backend") or "").lower()).strip("-")
    return f"{name}_{backend}" if backend else name


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m piecegraph.bench.report RESULTS.json [--plot OUT.png] [--name]``: print the compact table,
    redraw the plot from saved rows, or print the result file name."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m piecegraph.bench.report")
    parser.add_argument("results", type=Path)
    parser.add_argument("--plot", type=Path, help="draw the PNG from the saved rows")
    parser.add_argument("--name", action="store_true", help="print <date>_<gpu>_torch<ver>_<attention> and exit")
    args = parser.parse_args(argv)
    data = json.loads(args.results.read_text())
    if args.name:
        print(result_name(data["env"]))
        return
    if args.plot:
        from piecegraph.bench.plot import plot

        env = data["env"]
        plot([Row.from_json(r) for r in data["rows"]], args.plot,
             title=f"{env.get('model')} {env.get('dtype')}, {env.get('gpu')}, torch {env.get('torch')}, "
                   f"{env.get('attention_backend', '?')} attention")
    print(compact(data))


if __name__ == "__main__":
    main(sys.argv[1:])
