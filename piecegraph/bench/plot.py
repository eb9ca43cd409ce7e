"""The benchmark's PNG: ms per step by batch (decode) and by token count (prefill), one line per mode.

matplotlib with the Agg backend, selected before pyplot is imported, so it works headless (CI, GPU boxes).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from piecegraph.bench.harness import Row
from piecegraph.results.schema import Result

_PANELS = (("decode", "decode batch (sequences)"), ("prefill", "prefill tokens (packed, mixed lengths)"))


def _series(rows: Sequence[Row], phase: str) -> dict[str, tuple[list[int], list[float]]]:
    """Measured points per mode (and quantization, in a run of several) for one phase, sorted by size; skipped
    rows leave gaps, not zeros."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for r in sorted((r for r in rows if r.phase == phase and r.ms), key=lambda r: r.size):
        xs, ys = series.setdefault(r.mode if r.quant is None else f"{r.mode} {r.quant}", ([], []))
        xs.append(r.size)
        ys.append(r.ms)
    return series


def plot(rows: Sequence[Row], path: Path, title: str = "") -> Path:
    """Write a PNG with a decode panel and, when prefill rows were measured, a prefill panel (log-log axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(phase, label) for phase, label in _PANELS if _series(rows, phase)]
    if not panels:
        panels = [_PANELS[0]]  # nothing measured: still write a (labelled, empty) figure
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (phase, label) in zip(axes[0], panels):
        _draw(ax, _series(rows, phase), label)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw(ax: Any, series: dict[str, tuple[list[int], list[float]]], xlabel: str) -> None:
    for mode, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=mode, linestyle="--" if mode.split()[0] == "eager" else "-")
    if series:
        from matplotlib.ticker import FormatStrFormatter, NullFormatter

        ax.set_xscale("log")
        ax.set_yscale("log")
        sizes = sorted({x for xs, _ in series.values() for x in xs})
        ax.set_xticks(sizes)  # label the measured sizes, not powers of ten the run never used
        ax.xaxis.set_major_formatter(FormatStrFormatter("%d"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ys = [y for _, values in series.values() for y in values]
        # Under one decade there is no major tick to read: label the minor ones instead (plain numbers).
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g") if max(ys) < 10 * min(ys) else NullFormatter())
        ax.legend(fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ms per step (median)")
    ax.grid(True, which="both", alpha=0.3)


def plot_result(result: Result, path: Path) -> Path:
    """Redraw a saved result's PNG: a ``bench`` file's ms by batch and by tokens, a ``serve-bench`` file's
    throughput, TTFT and ITL by concurrency. Raises ``ValueError`` for any other benchmark (nothing to draw)."""
    env = result.env
    if result.benchmark == "bench":
        timed = [Row.from_json(r) for r in result.rows if r.get("phase") in ("decode", "prefill")]  # no accuracy
        return plot(timed, path,
                    title=f"{env.get('model')} {env.get('dtype')}, {env.get('gpu')}, torch {env.get('torch')}, "
                          f"{env.get('attention') or '?'} attention")
    if result.benchmark == "serve-bench":
        from piecegraph.serve.report import plot as serve_plot
        from piecegraph.serve.report import results_of

        return serve_plot(results_of(result), path, title=f"{env.get('model')} {env.get('dtype')} on {env.get('gpu')}, "
                          f"torch {env.get('torch')}, {env.get('attention') or '?'} attention")
    raise ValueError(f"{result.path or 'this result'}: nothing to plot for benchmark {result.benchmark!r} "
                     "(bench and serve-bench files only)")
