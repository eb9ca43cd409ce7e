"""Packaging after the start (``Config(aot_background=True)``, the default): the start that compiled with Inductor
hands its units' descriptions (:class:`~piecegraph.trace.aot_job.UnitJob`) to a process of its own,
``python -m piecegraph.trace.aot_worker JOBFILE``, and is ready as soon as without packages. The worker exports,
packages and checks each unit (:func:`~piecegraph.trace.aot_job.package_unit`), then adds the packages to the
cache entry, under the entry's lock and only when the entry still holds the trace the units came from; a later
start loads them. It runs on its own (a new session): it finishes even when the start's process has ended.

The worker imports the modules that define the custom ops the units call (found by
:func:`~piecegraph.trace.aot_job.op_modules`); ops defined in a script run as ``__main__`` are not importable, and
such a program is not packaged (said in the report). Before them it imports the torch libraries the start had
imported (:func:`~piecegraph.trace.aot_load.torch_libraries`, FlashInfer among them): torch's package loader
crashed in fresh processes without FlashInfer on the H100 and H200. Its state and output are under the cache
folder (:mod:`piecegraph.cache.packaging`); a job that failed is not tried again for the same trace, torch and
worker revision.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..cache.packaging import (
    WORKER_REVISION,
    held,
    job_path,
    running,
    worker_refusal,
    write_state,
)
from ..cache.session import TRACE, inductor_dir
from ..cache.store import Store
from .aot_job import UnitJob, child_environment, op_modules, package_unit
from .aot_load import import_libraries
from .aot_package import PROGRAM_FILE, PackagedPlan

log = logging.getLogger("piecegraph")


@dataclass
class PackagingJob:
    """One start's background packaging: the cache entry (``root``, ``key``) and the sha256 of the trace the
    units came from, the program's record (pickled), and the units."""

    root: str
    key: str
    trace_sha: str
    record: bytes
    units: list[UnitJob]


def start_worker(root: Path, key: str, trace: bytes, plan: PackagedPlan) -> tuple[str, bool]:
    """Start the worker for ``plan`` (the units of the program traced as ``trace``, the entry's trace). Returns
    the start-up report's ``aot`` line (started, already running, or not and why) and whether a worker is
    packaging the entry now."""
    if running(root, key):
        return "packaging in the background (by another start's worker)", True
    sha = hashlib.sha256(trace).hexdigest()
    refusal = worker_refusal(root, key, torch.__version__, sha)
    if refusal is not None:
        return f"not packaged: {refusal}", False
    modules = op_modules(job.graph for job in plan.jobs)
    job = PackagingJob(str(root), key, sha, pickle.dumps(plan.record), plan.jobs)
    path = job_path(root, key, ".job", make=True)
    # The start's thread count: Inductor writes CPU code for as many threads as the process that compiles has, and
    # the worker runs its own checks on one (main below), which would make its packages single-threaded.
    header = {"root": str(root), "key": key, "modules": modules, "codegen_threads": torch.get_num_threads(),
              "libraries": plan.record.libraries}
    path.write_bytes(pickle.dumps((header, pickle.dumps(job))))
    env = child_environment()
    # Half the cores' compile processes at most (the user's setting wins): the start keeps the rest
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    # The log of this job only, as the state is its only (no other worker runs: checked above)
    with open(job_path(root, key, ".log", make=True), "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "piecegraph.trace.aot_worker", str(path)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    write_state(root, key, state="queued", pid=proc.pid, units=len(plan.jobs), trace_sha=sha,
                torch=torch.__version__, worker=WORKER_REVISION)
    return f"packaging {len(plan.jobs)} units in the background (pid {proc.pid})", True


def run_job(path: Path) -> str:
    """Package the job at ``path`` and add the packages to its cache entry; returns the final state, also
    written to the entry's packaging state (with why, the seconds it took, the units packaged and, when it used a
    GPU, the most device memory its allocator held)."""
    header, payload = pickle.loads(path.read_bytes())
    root, key = Path(header["root"]), header["key"]
    with held(root, key) as mine:
        if not mine:
            return "skipped (another worker holds the entry)"
        common: dict[str, Any] = {"pid": os.getpid(), "torch": torch.__version__, "worker": WORKER_REVISION}
        write_state(root, key, state="running", **common)
        start = time.perf_counter()

        def progress(done: int) -> None:  # kept in the last state too: how far a failed job got
            common["units_done"] = done
            write_state(root, key, state="running", **common)

        def end(state: str, why: str) -> str:
            write_state(root, key, state=state, why=why, seconds=time.perf_counter() - start, **common,
                        **_device_peak())
            return state

        try:
            import_libraries(header.get("libraries", ()))  # as the start had them: the loader crashed without
            for module in header["modules"]:
                importlib.import_module(module)  # the ops the units call, before their code is unpickled
            job: PackagingJob = pickle.loads(payload)
            common.update(units=len(job.units), trace_sha=job.trace_sha)
            with _codegen_threads(header.get("codegen_threads", 0)):
                why = _package_and_add(job, root, progress)
        except Exception as err:  # noqa: BLE001  (export and AOTInductor raise many types: all end the job)
            traceback.print_exc()
            first = str(err).strip().splitlines()[0][:300] if str(err) else ""
            return end("failed", f"{type(err).__name__}: {first}")
        finally:
            path.unlink(missing_ok=True)
        return end("done" if not why else "dropped", why)


def _codegen_threads(threads: int) -> contextlib.AbstractContextManager:
    """Inductor's CPU code written for ``threads`` threads (the start's), whatever this process's own count."""
    if threads <= 1:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch({"cpp.threads": threads})


def _device_peak() -> dict[str, float]:
    """The most GPU memory the worker's allocator held (its CUDA context aside), in MiB: what it took from the
    device beside the server it packages for. Nothing when it used no GPU."""
    if not torch.cuda.is_initialized():
        return {}
    return {"device_peak_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1)}


def main(argv: list[str]) -> int:
    """The worker's command line: one job file. It runs at a lower CPU priority (nice 10, its compile processes
    too), with half the cores' compile processes at most and one thread for its CPU runs: the start it packages
    for is capturing or serving meanwhile, and a serving step is host-bound."""
    import faulthandler

    faulthandler.enable(all_threads=True)  # a crash in native code (export, AOTInductor, CUDA) leaves its stack
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with contextlib.suppress(OSError, AttributeError):  # no os.nice (Windows), or not allowed: full priority
        os.nice(10)
    torch.set_num_threads(1)  # the checks' eager runs on CPU: OpenMP threads would spin against the start's (the
    # packages' own code is still written for the start's threads: _codegen_threads)
    print(f"piecegraph: background packaging {argv[0]}: {run_job(Path(argv[0]))}", flush=True)
    return 0


def _package_and_add(job: PackagingJob, root: Path, progress: Callable[[int], None]) -> str:
    index = next((u.spec.device_index for u in job.units if u.spec.device_index >= 0), None)
    if index is not None:
        torch.cuda.set_device(index)
    # Grad mode off, as a setup packages inside a module's call (its examples and checks need no autograd)
    with tempfile.TemporaryDirectory(dir=root, prefix="scratch-") as scratch, inductor_dir(root), torch.no_grad():
        files: dict[str, Any] = {}
        for unit in job.units:
            began = time.perf_counter()
            package_unit(unit, Path(scratch))
            files[unit.spec.file] = (Path(scratch) / unit.spec.file).read_bytes()
            print(f"piecegraph: packaged {unit.spec.file} in {time.perf_counter() - began:.1f} s", flush=True)
            progress(len(files))
        files[PROGRAM_FILE] = job.record
        store = Store(root)
        with store.locked(job.key):
            return store.add_files(job.key, files, {TRACE: job.trace_sha})


if __name__ == "__main__":  # run as the canonical module, so the pickled job's classes are this module's
    from piecegraph.trace.aot_worker import main as _main

    sys.exit(_main(sys.argv[1:]))
