"""The artifact cache end to end on CPU (Inductor compiles, graphs emulated): a warm start loads the entry and
hits Inductor's cache, equal to eager and to the cold start; a corrupt, truncated or stale entry is rebuilt and
still equals eager; with the cache off nothing is written; a second process starts warm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import piecegraph

pytestmark = pytest.mark.usefixtures("one_thread")


class Block(torch.nn.Module):
    """Token-wise work (two layers): one piece, compiled by Inductor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(x)))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """One cache folder for the module: its Inductor folder fills once (the slow C++ compile), then each test's
    own key (its capture sizes) exercises piecegraph's entries."""
    return tmp_path_factory.mktemp("pgcache")


def _start(root: Path, sizes: tuple[int, ...], x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model = Block().eval()
    graphed = piecegraph.compile(model, capture_sizes=sizes, emulate_graphs=True, cache_dir=root)
    out = graphed(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)  # the independent reference: eager
    return out, graphed.stats()["startup"]


def test_warm_start_loads_the_entry_and_equals_eager_and_the_cold_start(root):
    x = torch.randn(3, 16)
    cold, first = _start(root, (2, 4), x)
    assert first["cache"] == "cold" and first["cache_save_s"] > 0
    assert (root / "entries" / first["cache_key"] / "manifest.json").exists()
    # Inductor's folder pointed at the cache during setup only (Inductor may write its own default back later)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(root / "inductor")
    warm, second = _start(root, (2, 4), x)
    assert second["cache"] == "warm" and second["cache_key"] == first["cache_key"]
    assert second["fx_graph_cache"]["fxgraph_cache_hit"] >= 1 and second["fx_graph_cache"]["fxgraph_cache_miss"] == 0
    assert torch.equal(warm, cold)
    for name in ("compiler_import_s", "prewarm_s", "trace_s", "compile_s", "setup_s", "capture_s", "ready_s",
                 "import_s"):
        assert second[name] >= 0, name


def test_a_warm_start_loads_its_kernels_in_process_and_a_cold_start_keeps_inductors_threads(root, monkeypatch):
    """A warm entry's pieces are cache hits: Inductor must not start its pool of compile processes to load them
    (``compile_threads`` 1 during the warm block only); a cold start compiles with Inductor's own setting."""
    import torch._inductor.config as inductor_config

    from piecegraph.trace import backend

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    seen, compile_piece = [], backend._compile_piece

    def recording(*args, **kwargs):
        seen.append(inductor_config.compile_threads)
        return compile_piece(*args, **kwargs)

    monkeypatch.setattr(backend, "_compile_piece", recording)
    before = inductor_config.compile_threads
    with inductor_config.patch(compile_threads=3):
        x = torch.randn(5, 16)
        _, first = _start(root, (8,), x)
        cold, seen[:] = list(seen), []
        _, second = _start(root, (8,), x)
        assert inductor_config.compile_threads == 3  # restored after the block
    assert (first["cache"], second["cache"]) == ("cold", "warm")
    assert cold and set(cold) == {3} and seen and set(seen) == {1}, (cold, seen)
    assert inductor_config.compile_threads == before


def _corrupt(entry: Path) -> None:
    blob = entry / "mega.bin"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))


def _truncate(entry: Path) -> None:
    blob = entry / "mega.bin"
    blob.write_bytes(blob.read_bytes()[:100])


def _stale(entry: Path) -> None:  # as if written by another torch
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["material"]["versions"]["torch"] = "1.0.0"
    (entry / "manifest.json").write_text(json.dumps(manifest))


def _no_manifest(entry: Path) -> None:  # a start that died before publishing
    (entry / "manifest.json").unlink()


def _unloadable(entry: Path) -> None:  # intact on disk (checksums match) but not a blob torch can load
    from piecegraph.cache import Store

    material = json.loads((entry / "manifest.json").read_text())["material"]
    Store(entry.parent.parent).save(entry.name, material, {"mega.bin": b"not torch's format" * 10})


@pytest.mark.parametrize("damage, reason", [(_corrupt, "corrupt"), (_truncate, "truncated"), (_stale, "stale"),
                                            (_no_manifest, "incomplete"), (_unloadable, "unloadable")])
def test_a_damaged_entry_is_rebuilt_never_loaded_and_still_equals_eager(root, damage, reason):
    sizes = (2, 4, 8, 1 + len(reason))  # a key of this test's own
    x = torch.randn(5, 16)
    _, first = _start(root, sizes, x)
    entry = root / "entries" / first["cache_key"]
    if not (entry / "mega.bin").exists():
        pytest.skip("this torch keeps no mega-cache blob")
    damage(entry)
    _, rebuilt = _start(root, sizes, x)  # _start checks the outputs against eager
    assert rebuilt["cache"].startswith("rebuilt (") and reason in rebuilt["cache"], rebuilt["cache"]
    _, again = _start(root, sizes, x)
    assert again["cache"] == "warm"  # the rebuild published a valid entry


def test_with_the_cache_off_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("PIECEGRAPH_CACHE_DIR", raising=False)
    x = torch.randn(3, 16)
    model = Block().eval()
    default = piecegraph.compile(model, capture_sizes=(4,), emulate_graphs=True)  # None without the env: off
    default(x)
    assert default.stats()["startup"]["cache"] == "off"
    monkeypatch.setenv("PIECEGRAPH_CACHE_DIR", str(tmp_path / "env"))
    off = piecegraph.compile(model, capture_sizes=(4,), emulate_graphs=True, cache_dir=False)
    torch.testing.assert_close(off(x), model(x), rtol=1e-5, atol=1e-5)
    assert off.stats()["startup"]["cache"] == "off" and not (tmp_path / "env").exists()


SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[2])
    torch.set_num_threads(1)
    import piecegraph
    from test_cache import Block
    model = Block().eval()
    graphed = piecegraph.compile(model, capture_sizes=(2, 4, 16), emulate_graphs=True, cache_dir=sys.argv[1])
    x = torch.arange(48.0).reshape(3, 16) / 48
    out = graphed(x)
    assert torch.allclose(out, model(x), rtol=1e-5, atol=1e-5)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # graphs Dynamo traced in this process
    print(json.dumps({"cache": graphed.stats()["startup"]["cache"], "out": out.tolist(), "dynamo_frames": frames,
                      "trace": graphed.stats()["startup"]["trace"],
                      "modules": sorted(m for m in ("flashinfer", "transformers") if m in sys.modules)}))
""")


def test_a_second_process_starts_warm_with_the_same_outputs(root):
    # The module's folder: Inductor's part is warm already (no C++ build here); the sizes make a key of its own.
    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(root), str(Path(__file__).parent)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert (first["cache"], second["cache"]) == ("cold", "warm")
    assert first["out"] == second["out"]
    # The warm process loaded the traced program: Dynamo traced nothing there
    assert (first["trace"], second["trace"]) == ("traced", "loaded")
    assert first["dynamo_frames"] >= 1 and second["dynamo_frames"] == 0
    assert first["modules"] == []  # compiling a plain model imports neither FlashInfer nor transformers
