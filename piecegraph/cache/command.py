"""``piecegraph cache info | clear``: what the artifact cache holds, and emptying it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import torch
import typer

from piecegraph.cache.packaging import (
    FOLDER,
    crashed_worker,
    ended_silently,
    forget_failures,
    job_path,
    read_state,
    suspension,
    wait_packaging,
)
from piecegraph.cache.paths import default_cache_dir, resolve_cache_dir
from piecegraph.cache.store import Store

cache_app = typer.Typer(add_completion=False, no_args_is_help=True,
                        help="The compile cache: what it holds (info), waiting for its background packaging "
                             "(wait), emptying it (clear).")

_DIR = typer.Option(None, "--dir", help="the cache folder (default: $PIECEGRAPH_CACHE_DIR, else "
                    "$XDG_CACHE_HOME/piecegraph, else ~/.cache/piecegraph)")


def _root(folder: Optional[Path]) -> Path:
    return resolve_cache_dir(folder) if folder is not None else default_cache_dir()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


@cache_app.command()
def info(folder: Optional[Path] = _DIR, as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """The cache folder, its entries (model, size, age, complete or not) and the bytes of each part."""
    root = _root(folder)
    rows = Store(root).entries()
    for row in rows:
        job = row["packaging"] = read_state(root, row["key"])
        if job and ended_silently(root, row["key"], job):
            job["state"] = "ended without a word (see its log)"
    parts = {name: _folder_bytes(root / name) for name in ("entries", "inductor", "flashinfer")}
    crashed = crashed_worker(root, torch.__version__)
    if as_json:
        typer.echo(json.dumps({"dir": str(root), "entries": rows, "bytes": parts, "workers_suspended_by": crashed},
                              indent=1, default=str))
        return
    typer.echo(f"piecegraph cache: {root} ({'absent' if not root.exists() else _mib(sum(parts.values()))})")
    for name, size in parts.items():
        typer.echo(f"  {name + '/':12} {_mib(size)}")
    if crashed:
        typer.echo(f"  no background packaging with torch {torch.__version__}: {suspension(crashed)}")
    for row in rows:
        age = f"{(time.time() - row['created']) / 3600:.1f} h old" if row["created"] else "no manifest"
        state = "" if row["complete"] else " INCOMPLETE (rebuilt on next use)"
        files = row["info"].get("files", [])
        packages = sum(1 for f in files if f.endswith(".pt2"))
        kept = f"  {packages} AOTInductor packages" if packages else ""
        typer.echo(f"  {row['key']}  {row['model'] or '?'}  {_mib(row['bytes'])}  {age}{kept}{state}")
        job = row.get("packaging") or {}
        if job and job.get("state") != "done":  # queued, running, failed or dropped: say it, with why
            why = f": {job['why']}" if job.get("why") else ""
            done = f" ({job.get('units_done', 0)}/{job['units']} units)" if job.get("state") == "running" \
                and job.get("units") else ""
            typer.echo(f"    background packaging {job.get('state')}{done}{why} "
                       f"(log {job_path(root, row['key'], '.log')})")


@cache_app.command()
def wait(folder: Optional[Path] = _DIR,
         timeout: Optional[float] = typer.Option(None, "--timeout", help="give up after this many seconds")) -> None:
    """Wait until no background packaging worker runs (after a cold start, so the next start loads packages:
    an image build, a deploy script), then print each job's last state. Exit code 1 when a job failed, 2 on
    timeout."""
    from rich.console import Console

    root = _root(folder)

    def show(busy: dict[str, dict]) -> None:
        units = ", ".join(f"{key[:12]} {state.get('units_done', 0)}/{state.get('units', '?')} units"
                          for key, state in busy.items())
        status.update(f"background packaging under {root}: {units or 'finishing'}")

    try:
        with Console(stderr=True).status(f"background packaging under {root}") as status:
            states = wait_packaging(root, timeout, progress=show)
    except TimeoutError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
    for key, state in states.items():
        if ended_silently(root, key, state):
            state["state"] = "failed"
            state["why"] = "ended without a word"
        why = f": {state['why']}" if state.get("why") else ""
        seconds = f" in {state['seconds']:.0f} s" if isinstance(state.get("seconds"), (int, float)) else ""
        typer.echo(f"  {key}  {state.get('state', 'unknown')}{seconds}{why}")
    if any(state.get("state") == "failed" for state in states.values()):
        typer.echo(f"piecegraph cache: a packaging job failed; its log is under {root / FOLDER}", err=True)
        raise typer.Exit(1)
    if not states:
        typer.echo(f"piecegraph cache: no background packaging under {root}")


@cache_app.command()
def clear(folder: Optional[Path] = _DIR, yes: bool = typer.Option(False, "--yes", "-y", help="do not ask"),
          failed_packaging: bool = typer.Option(False, "--failed-packaging", help="only forget the background "
                                                "packaging jobs that failed, so the next start packages again "
                                                "(entries and compiled code kept)")) -> None:
    """Remove every entry and the Inductor and FlashInfer folders under the cache folder."""
    root = _root(folder)
    if not root.exists():
        typer.echo(f"piecegraph cache: {root} is absent; nothing to clear")
        return
    if failed_packaging:
        keys = forget_failures(root)
        typer.echo(f"piecegraph cache: forgot {len(keys)} failed packaging job(s)" + "".join(f"\n  {k}" for k in keys))
        return
    if not yes:
        typer.confirm(f"remove {root} and everything under it?", abort=True)
    freed = Store(root).clear()
    typer.echo(f"piecegraph cache: removed {root} ({_mib(freed)})")
