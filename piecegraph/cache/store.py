"""The cache's entries on disk: a lock per key, a manifest written last, checksums, atomic renames.

No torch here: the store is plain files, so it is tested (and used by ``piecegraph cache``) on its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("piecegraph")

MANIFEST = "manifest.json"
FORMAT = 1  # bump when the layout changes: older entries then read as stale


class LockTimeout(TimeoutError):
    """Another process held the key's lock for longer than the wait allowed."""


@dataclass
class Lookup:
    """What a lookup found: ``files`` (name -> bytes) for a valid entry, else why not (``reason``)."""

    files: dict[str, bytes] | None
    reason: str  # "hit", "absent", or what was wrong: "stale: ...", "corrupt: ...", "incomplete: ..."


class Store:
    """Entries under ``root/entries/<key>``; see :mod:`piecegraph.cache` for the layout and guarantees."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def entry(self, key: str) -> Path:
        return self.root / "entries" / key

    # -- locking ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, key: str, timeout: float = 900.0) -> Iterator[None]:
        """Hold ``key``'s lock (one process, one thread at a time) for the block; :class:`LockTimeout` after
        ``timeout`` seconds of waiting. ``filelock`` (a torch dependency) when importable, else ``fcntl``."""
        path = self.root / "locks" / f"{key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import filelock
        except ImportError:  # pragma: no cover - torch depends on filelock
            with _fcntl_lock(path, timeout):
                yield
            return
        lock = filelock.FileLock(str(path), timeout=timeout)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise LockTimeout(f"piecegraph cache: {path} was held by another process for over {timeout:.0f} s"
                              ) from None
        try:
            yield
        finally:
            lock.release()

    # -- reading ----------------------------------------------------------------------------------------
    def load(self, key: str, material: dict[str, Any]) -> Lookup:
        """The entry's files when its manifest exists, names ``material`` exactly and every file matches its
        size and sha256; else ``files=None`` and the reason. Hold :meth:`locked` around it."""
        folder = self.entry(key)
        if not folder.exists():
            return Lookup(None, "absent")
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
        except FileNotFoundError:
            return Lookup(None, "incomplete: no manifest (a start that died before publishing?)")
        except (OSError, ValueError) as err:
            return Lookup(None, f"corrupt: unreadable manifest ({err})")
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            got = manifest.get("format") if isinstance(manifest, dict) else "?"
            return Lookup(None, f"stale: manifest format {got}, expected {FORMAT}")
        changed = _changed(manifest.get("material"), material)
        if changed:
            return Lookup(None, f"stale: {changed} changed")
        files: dict[str, bytes] = {}
        for name, meta in (manifest.get("files") or {}).items():
            try:
                data = (folder / name).read_bytes()
            except OSError as err:
                return Lookup(None, f"corrupt: {name} unreadable ({err})")
            if len(data) != meta.get("size"):
                return Lookup(None, f"corrupt: {name} is {len(data)} bytes, the manifest says {meta.get('size')} "
                                    "(truncated?)")
            if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
                return Lookup(None, f"corrupt: {name} does not match its checksum")
            files[name] = data
        return Lookup(files, "hit")

    # -- writing ----------------------------------------------------------------------------------------
    def save(self, key: str, material: dict[str, Any], files: dict[str, bytes], info: dict[str, Any] | None = None
             ) -> Path:
        """Publish an entry: the files, then the manifest (their sizes and checksums), each written to a
        temporary name, flushed and renamed, so a reader sees the old entry, none, or the whole new one. An
        existing entry's manifest goes first: a crash midway leaves an entry that reads as incomplete."""
        folder = self.entry(key)
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (folder / MANIFEST).unlink()
        manifest = {"format": FORMAT, "key": key, "created": time.time(), "material": material,
                    "files": _write_files(folder, files), "info": info or {}}
        _write_manifest(folder, manifest)
        return folder

    def add_files(self, key: str, files: dict[str, bytes], expect: dict[str, str]) -> str:
        """Add ``files`` to the published entry ``key`` (a background job's packages), keeping its material and
        other files: the new files first, then a manifest naming them, each by atomic rename. Only when the entry
        is intact and each file named in ``expect`` still has that sha256 (the entry the job was made from);
        returns '' when added, else why not. Hold :meth:`locked` around it."""
        folder = self.entry(key)
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            listed = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            return f"the entry is gone or unreadable ({type(err).__name__})"
        for name, sha in expect.items():
            if (listed.get(name) or {}).get("sha256") != sha:
                return f"the entry's {name} changed since the job was made"
        listed.update(_write_files(folder, files))
        manifest.setdefault("info", {})["files"] = sorted(listed)
        _write_manifest(folder, manifest)
        return ""

    # -- the CLI's view ---------------------------------------------------------------------------------
    def entries(self) -> list[dict[str, Any]]:
        """One row per entry: key, model, bytes, created, valid manifest or not."""
        rows = []
        for folder in sorted((self.root / "entries").glob("*")):
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            try:
                manifest = json.loads((folder / MANIFEST).read_text())
                row = {"key": folder.name, "model": manifest["material"].get("model"), "bytes": size,
                       "created": manifest.get("created"), "info": manifest.get("info", {}), "complete": True}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                row = {"key": folder.name, "model": None, "bytes": size, "created": None, "info": {},
                       "complete": False}
            rows.append(row)
        return rows

    def clear(self) -> int:
        """Remove everything under the root (entries, locks, Inductor's and FlashInfer's folders); the bytes
        freed. Renamed aside first, so a start running meanwhile sees an absent cache, not a half-deleted one."""
        if not self.root.exists():
            return 0
        freed = sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())
        trash = self.root.with_name(f".{self.root.name}.trash-{uuid.uuid4().hex[:8]}")
        os.replace(self.root, trash)
        shutil.rmtree(trash, ignore_errors=True)
        return freed


def _changed(stored: Any, wanted: dict[str, Any]) -> str:
    """The first top-level field of the material that differs ('' when equal), compared as canonical JSON."""
    if not isinstance(stored, dict):
        return "everything"
    for name in sorted(set(stored) | set(wanted)):
        a = json.dumps(stored.get(name), sort_keys=True, default=repr)
        b = json.dumps(wanted.get(name), sort_keys=True, default=repr)
        if a != b:
            return name
    return ""


def _write_files(folder: Path, files: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    """Write each file atomically; the manifest's entry of each (size and sha256)."""
    listed = {}
    for name, data in files.items():
        write_atomic(folder / name, data)
        listed[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return listed


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True, default=repr).encode())


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path`` by a temporary file of this process's own (flushed, synced) renamed into place: a
    reader sees the old content or the new, and two writers never share a temporary name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def _fcntl_lock(path: Path, timeout: float) -> Iterator[None]:
    import fcntl

    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeout(f"piecegraph cache: {path} was held by another process for over "
                                      f"{timeout:.0f} s") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
