"""Which CPUs the server's processes run on (``piecegraph serve --engine-cpus``).

The engine process's one host thread sets the pace at high concurrency: on an H200 its steps are host-bound there.
Behind HTTP it shares the machine's cores with the front ends (parsing, detokenizing, SSE framing) and often with
the load generator, and the H200 runs measured its host phases ~1.2-1.5x slower than in an engine alone. Pinning
gives the engine process CPUs of its own: the engine process runs on them only, and the front-end processes (this
one and those it spawns, which inherit its mask) on the rest. Linux only (``os.sched_setaffinity``). Off by
default: on the H200 ``auto`` served within the host's run-to-run spread of no pinning.
"""

from __future__ import annotations

import os

AUTO_ENGINE_CPUS = 2  # the engine thread, and one for the CUDA driver's and pipes' helper threads
AUTO_MIN_CPUS = 8  # below this the front ends would be starved: "auto" pins nothing


def parse_cpus(text: str) -> frozenset[int]:
    """``"0-1,6"`` (taskset's list form) -> ``{0, 1, 6}``. Raises ``ValueError`` saying what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range (write e.g. 0-1,6)")
        lo, hi = int(first), int(last) if sep else int(first)
        if hi < lo:
            raise ValueError(f"{part!r} is an empty range")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def split_cpus(spec: str, available: frozenset[int]) -> tuple[frozenset[int], frozenset[int]] | None:
    """``(engine CPUs, front-end CPUs)`` for ``--engine-cpus spec`` among the ``available`` ones (this process's
    mask), or ``None``: no pinning (``"none"``, or ``"auto"`` on fewer than :data:`AUTO_MIN_CPUS` CPUs).
    ``"auto"`` gives the engine the :data:`AUTO_ENGINE_CPUS` highest; a list names them. Raises ``ValueError``
    when the list names a CPU this process may not use, or leaves none for the front ends."""
    if spec == "none":
        return None
    if spec == "auto":
        if len(available) < AUTO_MIN_CPUS:
            return None
        engine = frozenset(sorted(available)[-AUTO_ENGINE_CPUS:])
    else:
        engine = parse_cpus(spec)
        outside = sorted(engine - available)
        if outside:
            raise ValueError(f"CPU(s) {outside} are not among the {len(available)} this process may use "
                             f"({format_cpus(available)})")
    rest = available - engine
    if not rest:
        raise ValueError(f"{format_cpus(engine)} leaves no CPU for the HTTP front ends")
    return engine, rest


def format_cpus(cpus: frozenset[int]) -> str:
    """``{0, 1, 2, 6}`` -> ``"0-2,6"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in runs)


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def pin(cpus: frozenset[int] | None) -> None:
    """Run this process (its calling thread and the threads it starts later) on ``cpus`` only; ``None``: leave it.
    """
    if cpus:
        os.sched_setaffinity(0, cpus)
