"""Background packaging jobs under a cache folder: ``packaging/<key>.job`` (the work, written by the start),
``<key>.lock`` (held by the worker while it runs), ``<key>.json`` (its state: running, done, failed, dropped, with
why and seconds) and ``<key>.log`` (its output). The worker itself is :mod:`piecegraph.trace.aot_worker`."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .store import write_atomic

FOLDER = "packaging"
BUSY = ("queued", "running")  # the states a worker writes before its last word


def job_path(root: str | Path, key: str, suffix: str, make: bool = False) -> Path:
    """``root/packaging/<key><suffix>`` (``.job``, ``.lock``, ``.json``, ``.log``); ``make``: its folder made."""
    folder = Path(root) / FOLDER
    if make:
        folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{key}{suffix}"


def read_state(root: str | Path, key: str) -> dict[str, Any] | None:
    """The last state the key's worker wrote, or ``None`` (none ran, or it is unreadable)."""
    try:
        state = json.loads(job_path(root, key, ".json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def write_state(root: str | Path, key: str, **state: Any) -> None:
    """Replace the key's state (atomically), stamped with the time."""
    write_atomic(job_path(root, key, ".json", make=True),
                 json.dumps({**state, "key": key, "updated": time.time()}, sort_keys=True).encode())


@contextlib.contextmanager
def held(root: str | Path, key: str) -> Iterator[bool]:
    """Try the key's packaging lock without waiting: yields True (held for the block) or False (another process
    holds it: a worker is running)."""
    import filelock

    lock = filelock.FileLock(str(job_path(root, key, ".lock", make=True)), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def running(root: str | Path, key: str) -> bool:
    """Whether the key's worker is queued or running: its state says so and its process lives (a worker that
    died without a word does not count), or it holds the packaging lock."""
    state = read_state(root, key) or {}
    if state.get("state") in BUSY:
        ended, signal_name = _ended_child(state.get("pid"))
        if ended:  # this process started it and saw it end before its last word: say how, in its state
            kept = {k: v for k, v in state.items() if k not in ("key", "updated", "state", "why", "signal")}
            write_state(root, key, state="failed", why=f"the worker {ended} before its last word", **kept,
                        **({"signal": signal_name} if signal_name else {}))
        elif _alive(state.get("pid")):
            return True
    with held(root, key) as mine:
        return not mine


def _ended_child(pid: Any) -> tuple[str, str | None]:
    """How our own child ``pid`` ended ("ended by SIGSEGV", "exited with code 1") and the signal's name if one
    ended it, reaping it; ('', None) while it runs, when it exited with 0, or when it is not our child."""
    import signal

    if not isinstance(pid, int):
        return "", None
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return "", None
    if done != pid:
        return "", None
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
        return f"ended by {name}", name
    code = os.WEXITSTATUS(status)
    # 0: it said its word, or left the entry to another worker
    return (f"exited with code {code}" if code else ""), None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that number
        return True
    return True


def ended_silently(root: str | Path, key: str, state: dict[str, Any]) -> bool:
    """Whether the key's last ``state`` says a worker is queued or running while none is: it ended before its
    last word (killed, or crashed in native code)."""
    return state.get("state") in BUSY and not running(root, key)


NATIVE_CRASHES = ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGILL", "SIGFPE")  # not SIGKILL: the OOM killer, a user


# Bump when a change to the worker may change whether a job that failed fails again: failures (and crashes) of
# workers of another revision are not held against new ones. 2: the start's torch libraries imported first (torch's
# package loader crashed in fresh processes that had not imported FlashInfer, on H100 and H200).
WORKER_REVISION = 2
INLINE_INSTEAD = "Config(aot_background=False) packages in the setup instead"


def native_crash(state: dict[str, Any]) -> bool:
    """Whether ``state`` is of a worker that crashed in native code (ended by one of :data:`NATIVE_CRASHES`)."""
    return state.get("state") == "failed" and state.get("signal") in NATIVE_CRASHES


def crashed_worker(root: str | Path, torch_version: str) -> dict[str, Any] | None:
    """The last state of a worker under ``root`` (of this :data:`WORKER_REVISION`) that crashed in native code
    with this torch, or ``None``. A worker of another entry would likely crash the same way: on the H200 with
    torch 2.11, torch's package loader crashed every worker, whatever the entry."""
    folder = Path(root) / FOLDER
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        state = read_state(root, path.stem) or {}
        if native_crash(state) and state.get("torch") == torch_version and state.get("worker") == WORKER_REVISION:
            return state
    return None


def suspension(crashed: dict[str, Any]) -> str:
    """What a start and ``piecegraph cache info`` say of the crash (:func:`crashed_worker`'s state) that keeps
    workers from starting, and the two ways out."""
    return (f"a worker crashed in native code with torch {crashed.get('torch')} ({crashed.get('why')}; entry "
            f"{crashed.get('key')}); `piecegraph cache clear --failed-packaging` lets workers try again; "
            f"{INLINE_INSTEAD}")


def worker_refusal(root: str | Path, key: str, torch_version: str, trace_sha: str | None = None) -> str | None:
    """Why no worker would package entry ``key`` under ``root`` now, or ``None``: its last job failed for the
    trace ``trace_sha`` (``None``: for any trace) with this torch and :data:`WORKER_REVISION`, not for want of
    memory (a failure is the code's, so it would fail again; memory is the machine's at the time), or a worker of
    this cache crashed in native code with this torch (:func:`crashed_worker`)."""
    before = read_state(root, key) or {}
    if before.get("state") == "failed" and trace_sha in (None, before.get("trace_sha")) \
            and before.get("torch") == torch_version and before.get("worker") == WORKER_REVISION \
            and "OutOfMemoryError" not in str(before.get("why")):
        return (f"the background packaging of this entry failed ({before.get('why')}; log "
                f"{job_path(root, key, '.log')}); `piecegraph cache clear --failed-packaging` makes it try "
                f"again{'; ' + INLINE_INSTEAD if native_crash(before) else ''}")
    crashed = crashed_worker(root, torch_version)
    if crashed is not None:  # once per cache and torch, not once per entry: each worker compiles for a minute
        return f"background packaging of this cache is off: {suspension(crashed)}"
    return None


def forget_failures(root: str | Path) -> list[str]:
    """Forget every packaging job under ``root`` that failed (or whose worker died without a word), so the next
    start of its entry packages again; entries and compiled code are kept. The keys forgotten."""
    folder = Path(root) / FOLDER
    forgotten = []
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        state = read_state(root, path.stem) or {}
        if state.get("state") == "failed" or ended_silently(root, path.stem, state):
            path.unlink(missing_ok=True)
            forgotten.append(path.stem)
    return forgotten


def wait_packaging(root: str | Path, timeout: float | None = None,
                   progress: Callable[[dict[str, dict[str, Any]]], None] | None = None) -> dict[str, dict[str, Any]]:
    """Wait until no packaging worker is queued or runs under ``root`` (``TimeoutError`` after ``timeout``
    seconds); returns each key's last state ("done", "failed" or "dropped", with ``why`` and ``seconds``).
    ``progress``: called at each look with the busy keys' states (a running one counts ``units_done``)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    folder = Path(root) / FOLDER
    while True:
        keys = sorted(p.stem for p in folder.glob("*.json")) if folder.exists() else []
        busy = [key for key in keys if running(root, key)]
        if progress is not None:
            progress({key: read_state(root, key) or {} for key in busy})
        if not busy:
            return {key: read_state(root, key) or {} for key in keys}
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"piecegraph cache: packaging of {', '.join(busy)} still running after {timeout} s")
        time.sleep(0.2)
