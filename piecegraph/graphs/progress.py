"""A progress bar through :meth:`GraphedModule.capture` (``Config.progress``), and the start-up summary line."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

Update = Callable[[int, int], None]  # (size about to be captured, sizes done so far)


def wants_bar(setting: bool | None, num_sizes: int) -> bool:
    """``True``: always; ``False``: never; ``None``: when stderr is a terminal. One size shows no bar either
    way (the serving engine captures size by size with a bar of its own)."""
    if num_sizes < 2 or setting is False:
        return False
    return setting is True or sys.stderr.isatty()


@contextlib.contextmanager
def capture_bar(setting: bool | None, sizes: list[int], title: str = "piecegraph capture") -> Iterator[Update]:
    """Yields ``update(size, done)``, called before each size; a rich bar on stderr when :func:`wants_bar`, else
    a no-op. ``setting=True`` without rich installed is refused (``None`` quietly shows nothing)."""
    if not wants_bar(setting, len(sizes)):
        yield lambda size, done: None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        if setting is True:
            raise ImportError("Config(progress=True) shows its bar with rich: pip install rich") from None
        yield lambda size, done: None
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} sizes"),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=False)
    with bar:
        task = bar.add_task(title, total=len(sizes))

        def update(size: int, done: int) -> None:
            first = " (trace, compile)" if done == 0 else ""
            bar.update(task, completed=done, description=f"{title}: size {size}{first}")

        yield update
        bar.update(task, completed=len(sizes), description=f"{title}: done")


def summary(startup: dict[str, Any]) -> str:
    """One line: where the start's seconds went, and the pool."""
    parts = [f"{name} {startup[key]:.1f} s" for key, name in (
        ("prewarm_s", "prewarm"), ("trace_s", "trace"), ("compile_s", "compile"), ("capture_s", "capture"))
        if startup.get(key)]
    if startup.get("jit_build_s"):  # inside the stages above (mostly prewarm), said apart: a fresh machine's cost
        built = len(startup["jit_built"])
        parts.append(f"of which FlashInfer JIT build {startup['jit_build_s']:.1f} s "
                     f"({built} module{'s' * (built != 1)})")
    cache = startup.get("cache", "off")
    if startup.get("trace") == "packaged":
        cache += ", from AOTInductor packages"
    elif startup.get("aot"):  # a cold start's packaging, or why there was none
        cache += f", {startup['aot']}"
    pool = f"pool {startup.get('pool_bytes', 0) / 2**20:.1f} MiB"
    before = [f"{word} {startup[key] / 2**20:.1f} MiB" for key, word in (
        ("pool_estimate_bytes", "estimated"), ("pool_measured_bytes", "measured before capture")) if startup.get(key)]
    if before:
        pool += f" ({', '.join(before)})"
    return (f"piecegraph: ready in {startup.get('ready_s', 0.0):.1f} s ({', '.join(parts) or 'nothing to do'}; "
            f"{startup.get('num_sizes', 0)} sizes, {pool}, cache {cache})")
