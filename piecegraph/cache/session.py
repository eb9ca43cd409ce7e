"""One start's use of the cache: look the key up under its lock, load a valid entry's artifacts into torch's
caches before compiling, compile with Inductor's cache dir under the cache folder, publish on a cold start."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .key import cache_key, key_material
from .paths import resolve_cache_dir
from .store import LockTimeout, Store

log = logging.getLogger("piecegraph")

MEGA = "mega.bin"
TRACE = "trace.pkl"  # the traced program (build.TraceSnapshot, pickled): a warm start skips Dynamo with it


@dataclass
class CacheEntry:
    """What the setup inside :func:`compile_cache` reads and adds: ``trace``, the loaded entry's traced program
    (bytes, or ``None``); ``files``, all the loaded entry's files (name -> bytes; ``folder`` holds them);
    ``new_trace``, set by a setup that traced, and ``new_files`` (its AOTInductor packages), published with the
    entry; ``background``, packaging left for a worker to add once the entry (``root``, ``key``) is published.
    A setup that compiles calls :meth:`compiling` first: only then are torch's compiler caches pointed at the
    entry and the mega-cache loaded (importing Dynamo and Inductor), so a start that loads packages imports
    neither."""

    enabled: bool = False
    trace: bytes | None = None
    new_trace: bytes | None = None
    files: dict[str, bytes] = field(default_factory=dict)
    folder: Path | None = None
    new_files: dict[str, bytes] = field(default_factory=dict)
    scratch: Path | None = None  # a folder for this start's own files, removed when the block ends
    compile_hook: Callable[[], None] | None = None
    root: Path | None = None
    key: str | None = None
    material: dict[str, Any] | None = None
    background: Any = None  # trace/aot_package.py's PackagedPlan of units still to package, after the block

    def compiling(self) -> None:
        """Say that this start compiles (once is enough): torch's caches are prepared for it."""
        hook, self.compile_hook = self.compile_hook, None
        if hook is not None:
            hook()


@contextlib.contextmanager
def compile_cache(model: torch.nn.Module, values: dict[str, Any], config: Any, report: dict[str, Any]
                  ) -> Iterator[CacheEntry]:
    """Around a GraphedModule's setup (trace and compile): nothing when the config has no cache; else look its
    entry up (under the key's lock, the whole block), warm torch's caches from it once the setup says it compiles
    (:meth:`CacheEntry.compiling`), and publish an entry after a cold setup that succeeded, or one that added
    files. Fills ``report``: ``cache`` ("off", "warm", "cold", or "rebuilt (<why>)"), ``cache_key``,
    ``cache_load_s``, ``cache_save_s`` and, when it compiled, Inductor's FX graph cache hits and misses during
    the block. Yields the :class:`CacheEntry` of the block (``enabled`` false without a cache)."""
    root = resolve_cache_dir(config.cache_dir)
    entry = CacheEntry()
    if root is None or config.mode == "breakable" or config.compiler != "inductor":  # nothing Inductor compiles
        report["cache"] = "off"
        yield entry
        return
    material = key_material(model, values, config)
    key = cache_key(material)
    store = Store(root)
    report.update(cache_key=key, cache_dir=str(root))
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(store.locked(key))
        except LockTimeout as err:  # a stuck peer must not stop the start: it runs without the cache
            log.warning("%s; starting without the cache", err)
            report["cache"] = "off (lock timeout)"
            yield entry
            return
        stack.enter_context(flashinfer_workspace(root))
        found = _lookup(store, key, material, report)
        entry.enabled, entry.files, entry.folder = True, found or {}, store.entry(key)
        entry.root, entry.key, entry.material = root, key, material
        entry.trace = entry.files.get(TRACE)
        entry.scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=root, prefix="scratch-")))
        counted: list[dict[str, int]] = []

        def compiling() -> None:
            counted.append(_fx_counters())
            stack.enter_context(inductor_dir(root))
            if found is not None and not _load_mega(found, report):
                entry.files, entry.trace = {}, None  # torch refused its blob: the entry is rebuilt, trace too
            if found is not None:
                stack.enter_context(_in_process_loads())

        entry.compile_hook = compiling
        yield entry
        if counted:
            report["fx_graph_cache"] = {k: v - counted[0].get(k, 0) for k, v in _fx_counters().items()}
        # Publish a cold start; refresh a warm one that compiled, traced a program the entry lacked, or packaged.
        if found is None or not entry.files or report.get("fx_graph_cache", {}).get("fxgraph_cache_miss") or (
                entry.new_trace is not None and entry.trace is None) or entry.new_files:
            _save(store, key, material, report, entry.new_trace or entry.trace, entry.new_files, bool(counted))


def _lookup(store: Store, key: str, material: dict[str, Any], report: dict[str, Any]) -> dict[str, bytes] | None:
    """The entry's files when valid (the store's checks: manifest, material, checksums), else ``None``; no torch
    compiler is imported for it."""
    start = time.perf_counter()
    found = store.load(key, material)
    report["cache"] = "warm" if found.files is not None else (
        "cold" if found.reason == "absent" else f"rebuilt ({found.reason})")
    report["cache_load_s"] = time.perf_counter() - start
    if found.files is None and found.reason != "absent":
        log.warning("piecegraph cache: entry %s not used, %s; compiling anew and replacing it", key, found.reason)
    return found.files


def _load_mega(files: dict[str, bytes], report: dict[str, Any]) -> bool:
    """Load the entry's mega-cache blob into torch's caches; False (the report says why) when torch refuses it."""
    if MEGA not in files or not _can_mega():
        return True
    start = time.perf_counter()
    try:  # torch checks the blob too, and says None (with a logged warning) when it cannot use it
        why = None if torch.compiler.load_cache_artifacts(files[MEGA]) is not None else "torch refused it"
    except Exception as err:  # noqa: BLE001 - intact but unusable (torch's format moved): rebuild, never fail
        why = f"{type(err).__name__}: {err}"
    report["cache_load_s"] = report.get("cache_load_s", 0.0) + time.perf_counter() - start
    if why is None:
        return True
    report["cache"] = f"rebuilt (unloadable: {why})"
    log.warning("piecegraph cache: entry %s not used, unloadable: %s; compiling anew and replacing it",
                report.get("cache_key"), why)
    return False


def _save(store: Store, key: str, material: dict[str, Any], report: dict[str, Any], trace: bytes | None,
          extra: dict[str, bytes], compiled: bool) -> None:
    start = time.perf_counter()
    files: dict[str, bytes] = {}
    if compiled and _can_mega():
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            files[MEGA] = saved[0]
    if trace is not None:
        files[TRACE] = trace
    files.update(extra)
    store.save(key, material, files, info={"torch": torch.__version__, "mega": MEGA in files,
                                           "trace": trace is not None, "files": sorted(files)})
    report["cache_save_s"] = time.perf_counter() - start


def _in_process_loads() -> contextlib.AbstractContextManager:
    """A warm entry's pieces are cache hits: Inductor loads their kernels, it compiles none. With more than one
    compile thread it would still start its pool of compile processes at the first kernel (each imports torch:
    seconds of every core, beside the start it should speed up; the H200's warm start took 13.8 s with one
    thread against 18.1-22.4 s without), so the block loads them in this process. A miss then compiles
    in this process too. ``TORCHINDUCTOR_COMPILE_THREADS``, when the user set it, is left as it is."""
    if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"):
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(compile_threads=1)


def _can_mega() -> bool:
    """torch >= 2.7 has the mega-cache (one blob of every compile artifact of the process)."""
    return hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")


@contextlib.contextmanager
def inductor_dir(root: Path) -> Iterator[None]:
    """``TORCHINDUCTOR_CACHE_DIR`` set to ``root/inductor`` for the block (restored after, through torch's own
    ``temporary_cache_dir``, which also resets the path caches Inductor keeps), unless the user set it: then
    Inductor's caches stay where they said. Inductor writes its default folder into the variable itself on first
    use; that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir, temporary_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        yield
        return
    folder = root / "inductor"
    folder.mkdir(parents=True, exist_ok=True)
    with temporary_cache_dir(str(folder)):
        yield


@contextlib.contextmanager
def flashinfer_workspace(root: Path) -> Iterator[None]:
    """``FLASHINFER_WORKSPACE_BASE`` set to ``root/flashinfer`` for the block (its JIT kernels then build and
    are found there) when FlashInfer is not imported yet (it reads the variable once, at import: a model that
    imports FlashInfer at its top keeps FlashInfer's own ``~/.cache/flashinfer``) and the user did not set it."""
    if "flashinfer" in sys.modules or os.environ.get("FLASHINFER_WORKSPACE_BASE"):
        yield
        return
    folder = root / "flashinfer"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["FLASHINFER_WORKSPACE_BASE"] = str(folder)
    try:
        yield
    finally:
        os.environ.pop("FLASHINFER_WORKSPACE_BASE", None)


def _fx_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {k: int(inductor.get(k, 0)) for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}
