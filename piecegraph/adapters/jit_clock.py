"""How long a setup waited on FlashInfer's JIT builds, told apart from the stage they happened in.

FlashInfer (0.5.x) builds a kernel module the first time its loader runs on a machine: ``JitSpec.build_and_load``
writes a ninja file and runs ``ninja`` through ``flashinfer.jit.core.run_ninja`` (17-51 s per module on the H200
host, a no-op of a few ms once the library exists). :func:`jit_builds` times each ``run_ninja`` call inside its
block and says which ones produced a library (its ``.so`` appeared or changed), so start-up reports can give
"JIT build" seconds of their own.

Why ``run_ninja`` and not the loader: a loader is what Dynamo may trace through (and what the doctor names when it
stops there); ``run_ninja`` runs after the file lock and the stat calls, where a traced loader has long stopped,
so timing it never puts piecegraph's frame between Dynamo and FlashInfer's. Nothing is imported: when FlashInfer
is not loaded yet, the block times nothing (a model that uses it has imported it before its setup).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

__all__ = ["JitBuild", "jit_builds"]

_CORE = "flashinfer.jit.core"
_MARK = "__piecegraph_jit_clock__"


@dataclass(frozen=True)
class JitBuild:
    """One ``ninja`` run: the module's name, its seconds, and whether it built the library (else: up to date)."""

    name: str
    seconds: float
    built: bool


def _library_state(ninja_file: Any) -> tuple[str, tuple[int, int] | None]:
    """``(module name, (mtime_ns, size) of its .so or None)``: FlashInfer keeps ``<jit dir>/<name>/build.ninja``
    beside ``<name>.so``."""
    folder = Path(ninja_file).parent
    try:
        stat = (folder / f"{folder.name}.so").stat()
        return folder.name, (stat.st_mtime_ns, stat.st_size)
    except OSError:
        return folder.name, None


@contextlib.contextmanager
def jit_builds() -> Iterator[list[JitBuild]]:
    """Time FlashInfer's ``ninja`` runs inside the block; yields the list they are appended to.

    Nested blocks record into the outermost one (the inner list stays empty), so a setup inside a capture is
    counted once. The original function is put back on exit, errors included. Builds on other threads while the
    block is open are counted too (FlashInfer's module attribute is process-wide)."""
    core = sys.modules.get(_CORE)
    original = getattr(core, "run_ninja", None)
    found: list[JitBuild] = []
    if original is None or getattr(original, _MARK, False):
        yield found
        return

    @functools.wraps(original)
    def timed(workdir: Any, ninja_file: Any, *args: Any, **kwargs: Any) -> Any:
        name, before = _library_state(ninja_file)
        start = time.perf_counter()
        try:
            return original(workdir, ninja_file, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            after = _library_state(ninja_file)[1]
            found.append(JitBuild(name, seconds, after is not None and after != before))

    setattr(timed, _MARK, True)
    core.run_ninja = timed
    try:
        yield found
    finally:
        if core.run_ninja is timed:  # someone else's patch on top of ours stays theirs to undo
            core.run_ninja = original


def summarize(builds: list[JitBuild]) -> dict[str, Any]:
    """``{"jit_build_s", "jit_built": [names], "jit_checks": n}``: seconds of the runs that built a library, which
    ones, and how many runs found theirs up to date (their seconds are in ``jit_check_s``)."""
    built = [b for b in builds if b.built]
    return {"jit_build_s": sum(b.seconds for b in built), "jit_built": [b.name for b in built],
            "jit_checks": len(builds) - len(built), "jit_check_s": sum(b.seconds for b in builds if not b.built)}
