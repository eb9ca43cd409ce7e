"""The artifact cache's store and key, without compiling: a manifest written last, checksums, stale material,
a lock shared by processes, where the folder is, and the ``piecegraph cache`` command."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import pytest
import torch
from typer.testing import CliRunner

import piecegraph
from piecegraph.cache import Store, cache_key, key_material, resolve_cache_dir
from piecegraph.cache.command import cache_app
from piecegraph.cache.paths import default_cache_dir

MATERIAL = {"model": "m.Model", "versions": {"torch": "2.13"}, "sizes": [1, 2]}


def test_saved_entry_reads_back_and_each_damage_is_named(tmp_path):
    store = Store(tmp_path)
    store.save("k", MATERIAL, {"mega.bin": b"abc" * 100})
    found = store.load("k", MATERIAL)
    assert found.reason == "hit" and found.files == {"mega.bin": b"abc" * 100}

    blob = store.entry("k") / "mega.bin"
    blob.write_bytes(b"abd" + b"abc" * 99)  # same size, one byte flipped
    assert store.load("k", MATERIAL).reason == "corrupt: mega.bin does not match its checksum"
    blob.write_bytes(b"abc" * 50)
    assert "truncated" in store.load("k", MATERIAL).reason
    assert store.load("k", {**MATERIAL, "versions": {"torch": "2.14"}}).reason == "stale: versions changed"
    (store.entry("k") / "manifest.json").write_text("{not json")
    assert store.load("k", MATERIAL).reason.startswith("corrupt: unreadable manifest")
    (store.entry("k") / "manifest.json").unlink()
    assert store.load("k", MATERIAL).reason.startswith("incomplete")
    assert Store(tmp_path / "nothing").load("k", MATERIAL).reason == "absent"
    store.save("k", MATERIAL, {"mega.bin": b"fresh"})  # a rebuild replaces the damaged entry
    assert store.load("k", MATERIAL).files == {"mega.bin": b"fresh"}


def test_an_entry_being_rewritten_reads_as_incomplete_until_its_manifest_lands(tmp_path, monkeypatch):
    store = Store(tmp_path)
    store.save("k", MATERIAL, {"mega.bin": b"old"})
    seen = []
    import piecegraph.cache.store as store_module

    real = store_module.write_atomic

    def spy(path, data):
        if path.name == "mega.bin":
            seen.append(store.load("k", MATERIAL).reason)  # a reader between the files and the manifest
        real(path, data)

    monkeypatch.setattr(store_module, "write_atomic", spy)
    store.save("k", MATERIAL, {"mega.bin": b"new"})
    assert seen and seen[0].startswith("incomplete")
    assert store.load("k", MATERIAL).files == {"mega.bin": b"new"}


def _start(root: str, key: str, out: "mp.Queue") -> None:
    """One process's start: under the key's lock, use a valid entry or build (slowly) and publish one."""
    store = Store(root)
    with store.locked(key):
        found = store.load(key, MATERIAL)
        if found.files is None:
            time.sleep(0.3)  # a compile: the others must wait, not build too
            store.save(key, MATERIAL, {"mega.bin": b"built by one process" * 1000})
            out.put("built")
        else:
            out.put(found.files["mega.bin"][:20].decode())


def test_processes_starting_at_once_build_once_and_the_others_load_it(tmp_path):
    ctx = mp.get_context("fork")  # the children only touch files: no torch work after the fork
    out = ctx.Queue()
    procs = [ctx.Process(target=_start, args=(str(tmp_path), "k", out)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    results = sorted(out.get(timeout=5) for _ in procs)
    assert results == ["built"] + ["built by one process"] * 3
    assert Store(tmp_path).load("k", MATERIAL).reason == "hit"


def test_lock_wait_times_out_with_a_clear_error(tmp_path):
    from piecegraph.cache.store import LockTimeout

    store = Store(tmp_path)
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()

    def hold():
        with store.locked("k"):
            ready.set()
            release.wait(30)

    holder = ctx.Process(target=hold)
    holder.start()
    assert ready.wait(30)
    with pytest.raises(LockTimeout, match="held by another process"):
        with store.locked("k", timeout=0.2):
            pass
    release.set()
    holder.join(30)
    with store.locked("k", timeout=5):  # free again
        pass


class Net(torch.nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_key_follows_what_decides_the_code_and_not_the_token_count():
    model = Net()
    config = piecegraph.Config(capture_sizes=(2, 4))
    key = cache_key(key_material(model, {"x": torch.randn(3, 8)}, config))
    assert key == cache_key(key_material(Net(), {"x": torch.randn(5, 8)}, config))  # other weights, other count
    others = [
        key_material(Net(16), {"x": torch.randn(3, 16)}, config),  # parameter shapes, argument shapes
        key_material(model, {"x": torch.randn(3, 8, dtype=torch.float64)}, config),
        key_material(model, {"x": torch.randn(3, 8)}, config.replace(capture_sizes=(2, 8))),
        key_material(model, {"x": torch.randn(3, 8)}, config.replace(mode="full")),
        key_material(model, {"x": torch.randn(3, 8)}, config.replace(compile_sizes=(4,))),
    ]
    assert len({key, *(cache_key(m) for m in others)}) == 6
    assert key == cache_key(key_material(model, {"x": torch.randn(3, 8)}, config.replace(progress=False, verify=True)))
    material = key_material(model, {"x": torch.randn(3, 8)}, config)
    assert material["versions"]["torch"] == torch.__version__ and material["device"].startswith("cpu")


def test_key_changes_when_the_model_code_changes():
    class A(torch.nn.Module):
        def forward(self, x):
            return x + 1

    class B(torch.nn.Module):  # same name in the key, other code
        def forward(self, x):
            return x + 2

    B.__qualname__ = A.__qualname__
    config = piecegraph.Config()
    x = {"x": torch.randn(2, 2)}
    assert key_material(A(), x, config)["code"] != key_material(B(), x, config)["code"]


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.delenv("PIECEGRAPH_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir(None) is None  # opt-in: no env, no cache
    assert resolve_cache_dir(False) is None
    assert resolve_cache_dir(True) == default_cache_dir() == tmp_path / "xdg" / "piecegraph"
    assert resolve_cache_dir(str(tmp_path / "here")) == tmp_path / "here"
    monkeypatch.setenv("PIECEGRAPH_CACHE_DIR", str(tmp_path / "env"))
    assert resolve_cache_dir(None) == resolve_cache_dir(True) == tmp_path / "env"
    assert resolve_cache_dir(False) is None
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("PIECEGRAPH_CACHE_DIR")
    assert default_cache_dir() == default_cache_dir().home() / ".cache" / "piecegraph"


def test_cache_command_shows_entries_and_clears(tmp_path):
    Store(tmp_path).save("k1", MATERIAL, {"mega.bin": b"x" * 2048})
    (tmp_path / "entries" / "k2").mkdir()  # a start that died before its manifest
    runner = CliRunner()
    shown = runner.invoke(cache_app, ["info", "--dir", str(tmp_path), "--json"])
    assert shown.exit_code == 0, shown.output
    rows = {r["key"]: r for r in json.loads(shown.output)["entries"]}
    assert rows["k1"]["model"] == "m.Model" and rows["k1"]["complete"] and not rows["k2"]["complete"]
    text = runner.invoke(cache_app, ["info", "--dir", str(tmp_path)])
    assert "k1" in text.output and "INCOMPLETE" in text.output
    cleared = runner.invoke(cache_app, ["clear", "--dir", str(tmp_path), "--yes"])
    assert cleared.exit_code == 0 and "removed" in cleared.output
    assert not tmp_path.exists()
