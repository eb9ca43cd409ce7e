"""freeze(): a warm functools-cached loader becomes a lookup Dynamo traces without breaks."""

import functools
import sys
from pathlib import Path

import pytest
import torch

try:
    import jitlib
except ImportError:  # pytest's importlib mode does not put the test folder on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import jitlib
from jitlib import kernels

from piecegraph.ops import FreezeError, FrozenCacheMiss, freeze, freeze_package, frozen_functions, unfreeze

pytestmark = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler (cc) on this machine")


@pytest.fixture(autouse=True)
def _restore():
    yield
    unfreeze()


def uses_loader(x):
    lib = kernels.get_kernel_module("scaled_add")  # a loader: stat, subprocess, lock, cc, ctypes
    version = kernels.compiler_version()  # a zero-argument probe
    return x * 2 + (1.0 if lib is not None else 0.0) + len(version) % 3


def test_frozen_loader_traces_with_zero_graph_breaks():
    x = torch.randn(4, 4)
    kernels.get_kernel_module("scaled_add")
    kernels.compiler_version()
    original = kernels.get_kernel_module
    frozen = freeze(kernels.get_kernel_module)
    freeze(kernels.compiler_version)
    assert kernels.get_kernel_module is frozen and jitlib.get_kernel_module is frozen  # imported by name too
    assert frozen("scaled_add") is original("scaled_add")  # the very object the cache held
    explanation = torch._dynamo.explain(uses_loader)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch.testing.assert_close(torch.compile(uses_loader, fullgraph=True, backend="eager")(x), uses_loader(x))


def test_cold_argument_while_tracing_raises_frozen_cache_miss_naming_the_loader():
    kernels.get_kernel_module("scaled_add")
    freeze(kernels.get_kernel_module)

    def cold(x):
        return x + (kernels.get_kernel_module("never_built") is None)

    with pytest.raises(FrozenCacheMiss, match=r"jitlib\.kernels\.get_kernel_module\('never_built'\).*prewarm"):
        torch.compile(cold, fullgraph=True, backend="eager")(torch.ones(2))


def test_eager_miss_falls_through_unless_strict():
    calls = []

    @functools.lru_cache(maxsize=None)
    def probe(kind: str, flag: bool = False) -> int:
        calls.append(kind)
        return len(kind) + flag

    probe("a")
    lenient = freeze(probe)
    assert lenient("bb") == 2 and calls == ["a", "bb"]  # eager: the real loader runs, its result is kept
    assert lenient("bb") == 2 and calls == ["a", "bb"]
    unfreeze(lenient)
    strict = freeze(probe, strict=True)
    with pytest.raises(FrozenCacheMiss, match="probe\\('ccc'\\)"):
        strict("ccc")


def test_keys_are_matched_positionally_with_defaults_and_kwargs():
    @functools.lru_cache(maxsize=8, typed=True)
    def probe(device: torch.device, flag: bool = False, *, scale: int = 1) -> int:
        return (3 if flag else 2) * scale

    cpu = torch.device("cpu")
    probe(cpu), probe(cpu, flag=True), probe(cpu, scale=5)
    probe_f = freeze(probe, strict=True)
    assert probe_f(cpu) == 2 and probe_f(cpu, False) == 2 and probe_f(cpu, flag=False) == 2
    assert probe_f(cpu, True) == 3 and probe_f(cpu, scale=5) == 10

    def f(x):
        return x * probe_f(x.device) + probe_f(x.device, flag=True)

    assert torch._dynamo.explain(f)(torch.ones(2)).graph_break_count == 0


def test_unfreeze_restores_everywhere():
    kernels.get_kernel_module("scaled_add")
    original = kernels.get_kernel_module
    frozen = freeze(original)
    assert freeze(original) is frozen and freeze(frozen) is frozen  # idempotent
    assert "jitlib.kernels.get_kernel_module" in frozen_functions()
    assert unfreeze(frozen) == ["jitlib.kernels.get_kernel_module"]
    assert kernels.get_kernel_module is original and jitlib.get_kernel_module is original


def test_freeze_package_freezes_the_warm_loaders_of_a_package():
    kernels.get_kernel_module("scaled_add")
    kernels.compiler_version()
    names = freeze_package("jitlib")
    assert {"jitlib.kernels.get_kernel_module", "jitlib.kernels.compiler_version"} <= set(names)
    assert torch._dynamo.explain(uses_loader)(torch.ones(3)).graph_break_count == 0
    assert set(unfreeze("jitlib")) >= set(names)
    assert isinstance(kernels.get_kernel_module, functools._lru_cache_wrapper)


def test_clear_errors_for_things_that_cannot_be_frozen():
    @functools.cache
    def cold_loader(name: str) -> str:
        return name

    with pytest.raises(FreezeError, match="not warm"):
        freeze(cold_loader)
    with pytest.raises(FreezeError, match="not a functools"):
        freeze(lambda: 1)
    with pytest.raises(FreezeError, match="not imported"):
        freeze_package("surely_not_an_imported_package_xyz")


def test_miss_while_capturing_a_cuda_graph_raises(monkeypatch):
    calls = []

    @functools.lru_cache(maxsize=None)
    def probe(kind: str) -> str:
        calls.append(kind)
        return kind.upper()

    probe("a")
    frozen = freeze(probe)
    monkeypatch.setattr(sys.modules[FrozenCacheMiss.__module__], "_capturing", lambda: True)  # torch.cuda.graph
    with pytest.raises(FrozenCacheMiss, match=r"probe\('b'\).*CUDA graph capture.*prewarm"):
        frozen("b")
    assert frozen("a") == "A" and calls == ["a"]  # hits still answer; the real loader never ran
