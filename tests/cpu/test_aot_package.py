"""A warm start from AOTInductor packages (``Config(aot_package=True)``; trace/aot_package.py, trace/aot_load.py):
the cold start packages each compiled unit and runs the packages itself; a second process loads them without
importing Dynamo, Inductor or sympy and gives the cold start's bits; generation equals eager; a package that does
not load, or one whose check fails, leaves the start on Inductor's code, never on wrong code. Graphs emulated on
CPU (packaging compiles C++: ~6-10 s a unit here, so the cold entries are made once per module)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import piecegraph
from piecegraph.attention import KVCache
from piecegraph.cache.command import cache_app
from piecegraph.models import TINY, Decoder, dummy_inputs, generate
from piecegraph.trace.aot_job import check_unit
from piecegraph.trace.aot_load import UnitSpec
from piecegraph.trace.aot_package import PROGRAM_FILE

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]]
SIZES = {"piecewise": (4, 16), "full": (1, 2, 4)}
REPO = Path(__file__).resolve().parents[2]

# One start in a fresh process (the cache key names every registered split op, so an entry made in this test
# process, where other tests registered theirs, is not a fresh process's): the tiny decoder, every size captured,
# one step; prints its stats, the step's output, whether greedy generation equals eager's, and which of the
# compiler stack's modules the process imported. argv: cache folder, mode, packaging ("1": in the setup, "bg": in
# the background, "0": none), "broken" to make every package load fail, "changed" to change an attribute the trace
# baked in, "pieces" to compile a full graph by pieces.
START = r"""
import json, sys
import torch
import piecegraph
import piecegraph.graphed.build
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.models import TINY, Decoder, dummy_inputs, generate
torch.set_num_threads(1)
root, mode, aot = sys.argv[1], sys.argv[2], sys.argv[3]
if "broken" in sys.argv[4:]:
    def broken(*args, **kwargs):
        raise RuntimeError("Error in dlopen: a package of another machine")
    piecegraph.graphed.build.load_packaged = broken
model = Decoder.random(TINY, seed=0).eval()
if "changed" in sys.argv[4:]:  # set on the instance: what Dynamo would guard on, neither code nor config
    model.model.norm.eps = 0.5
cache = KVCache.for_sequences(TINY, 3, 48)
sizes = (1, 2, 4) if mode == "full" else (4, 16)
graphed = piecegraph.compile(model, mode=mode, capture_sizes=sizes, emulate_graphs=True, cache_dir=root,
                             aot_package=aot != "0", aot_background=aot == "bg",
                             full_compile="pieces" if "pieces" in sys.argv[4:] else "whole")
graphed.capture(lambda n: dummy_inputs(model, cache, n))
meta = AttentionMetadata.for_batch(cache, [(0, 0, 1 if mode == "full" else 7)])
with piecegraph.forward_context(meta):
    out = graphed(torch.arange(meta.num_tokens) % TINY.vocab_size, meta.positions)
prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]]
role = {"prefill_fn": graphed} if mode == "piecewise" else {"decode_fn": graphed}
equal = generate(model, prompts, 5, cache=cache, **role) == generate(model, prompts, 5)
try:  # the loaded binding checks arguments as a traced one does
    graphed(torch.zeros(2), torch.zeros(2, dtype=torch.long))
    refused = ""
except ValueError as err:
    refused = str(err)
startup = graphed.stats()["startup"]
print(json.dumps({"cache": startup["cache"], "trace": startup["trace"], "aot": startup.get("aot"),
                  "out": out.flatten().tolist(), "generate_equal": equal, "refused": refused,
                  "imported": [m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules]}))
"""


def _process_starts(*starts: tuple) -> list[tuple[dict, str]]:
    """Each ``(root, mode, aot, *flags)`` started in its own process, all at once (each runs one thread, and
    CI has two cores); their reports and logs, in order."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    with contextlib.ExitStack() as files:  # files, not pipes: a full pipe would stall a process not read yet
        logs = [(files.enter_context(tempfile.TemporaryFile("w+")), files.enter_context(tempfile.TemporaryFile("w+")))
                for _ in starts]
        procs = [subprocess.Popen([sys.executable, "-c", START, *map(str, start)], stdout=out, stderr=err, env=env)
                 for start, (out, err) in zip(starts, logs)]
        reports = []
        for proc, (out, err) in zip(procs, logs):
            proc.wait(timeout=600)
            out.seek(0), err.seek(0)
            stdout, stderr = out.read(), err.read()
            assert proc.returncode == 0, stderr[-3000:]
            reports.append((json.loads(stdout.strip().splitlines()[-1]), stderr))
    return reports


def _process_start(root: Path, mode: str, aot: str = "1", *flags: str) -> tuple[dict, str]:
    return _process_starts((root, mode, aot, *flags))[0]


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    """mode -> (cache folder, the cold start's report): each made once, by a cold start in its own process."""
    roots = {mode: tmp_path_factory.mktemp(f"aot-{mode}") for mode in SIZES}
    reports = _process_starts(*((roots[mode], mode, "1") for mode in SIZES))
    return {mode: (roots[mode], report) for mode, (report, _) in zip(SIZES, reports)}


@pytest.fixture(scope="module")
def later_starts(entries, tmp_path_factory):
    """A start from a copy of each entry, altered: "broken" (no package loads), "changed" (an attribute the trace
    baked in), "truncated" (a package cut in half); all at once. name -> (report, log)."""
    roots = {name: tmp_path_factory.mktemp(name) / "copy" for name in ("broken", "changed", "truncated")}
    for name, root in roots.items():
        shutil.copytree(entries["full" if name == "truncated" else "piecewise"][0], root)
    (package,) = (roots["truncated"] / "entries").glob("*/unit0.pt2")
    package.write_bytes(package.read_bytes()[: package.stat().st_size // 2])
    starts = [(roots["broken"], "piecewise", "1", "broken"), (roots["changed"], "piecewise", "1", "changed"),
              (roots["truncated"], "full", "0")]  # rebuilt by Inductor alone: no packaging there
    return dict(zip(roots, _process_starts(*starts)))


def _start(root: Path, mode: str, **config):
    model = Decoder.random(TINY, seed=0).eval()
    cache = KVCache.for_sequences(TINY, 3, 48)
    config = {"aot_background": False, **config}
    graphed = piecegraph.compile(model, mode=mode, capture_sizes=SIZES[mode], emulate_graphs=True, cache_dir=root,
                                 aot_package=True, **config)
    graphed.capture(lambda n: dummy_inputs(model, cache, n))
    return model, cache, graphed


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_second_process_loads_the_packages_without_the_compiler_and_gives_the_same_bits(entries, mode):
    root, cold = entries[mode]
    assert (cold["cache"], cold["trace"]) == ("cold", "traced")
    assert cold["aot"].startswith("packaged " + ("1 units" if mode == "full" else "3 units")), cold["aot"]
    warm, _ = _process_start(root, mode)
    assert (warm["cache"], warm["trace"], warm["aot"]) == ("warm", "packaged", None)
    assert warm["imported"] == []  # neither Dynamo, Inductor nor sympy
    assert warm["out"] == cold["out"]  # the very code the cold start ran: the same bits
    assert cold["generate_equal"] and warm["generate_equal"]  # greedy tokens equal eager's
    assert "input input_ids is torch.float32" in warm["refused"]
    shown = CliRunner().invoke(cache_app, ["info", "--dir", str(root)])
    assert f"{1 if mode == 'full' else 3} AOTInductor packages" in shown.output, shown.output


def test_packages_that_do_not_load_leave_the_start_on_compiled_code_with_a_warning(entries, later_starts):
    start, log = later_starts["broken"]
    assert "compiled packages could not be used (RuntimeError: Error in dlopen" in log
    assert start["trace"] == "loaded" and start["generate_equal"]  # the cached trace, compiled by Inductor
    assert start["out"] == entries["piecewise"][1]["out"]


def test_a_model_attribute_changed_since_the_trace_never_runs_the_packages(entries, later_starts):
    start, log = later_starts["changed"]
    assert "compiled packages could not be used (LookupError: the model's attributes" in log
    assert start["trace"] == "traced" and start["generate_equal"]  # traced anew: eager with the new eps
    assert start["out"] != entries["piecewise"][1]["out"]  # the baked-in eps would have given the old output


def test_a_truncated_package_is_never_loaded_the_entry_is_rebuilt(later_starts):
    start, _ = later_starts["truncated"]
    assert start["cache"].startswith("rebuilt (corrupt") and start["trace"] == "traced", start["cache"]
    assert start["generate_equal"]


def test_a_package_whose_check_fails_is_not_kept_and_the_start_runs_compiled_code(tmp_path, monkeypatch):
    def off(unit, sub, args, skip):
        raise ValueError("output 0 is off by 1.00e+00 (relative) from the unit run eagerly")

    monkeypatch.setattr("piecegraph.trace.aot_job.check_unit", off)
    model, cache, cold = _start(tmp_path, "piecewise")
    startup = cold.stats()["startup"]
    assert startup["aot"] == "not packaged: ValueError: output 0 is off by 1.00e+00 (relative) from the unit run " \
                             "eagerly"
    assert not (tmp_path / "entries" / startup["cache_key"] / PROGRAM_FILE).exists()
    assert generate(model, PROMPTS, 5, cache=cache, prefill_fn=cold) == generate(model, PROMPTS, 5)


def test_static_compiles_are_not_packaged_and_say_so(tmp_path):
    model, cache, cold = _start(tmp_path, "piecewise", compile_sizes=(16,))
    startup = cold.stats()["startup"]
    assert startup["aot"] == "not packaged: static compiles for sizes (16,) (compile_sizes)"
    entry = tmp_path / "entries" / startup["cache_key"]
    assert not (entry / PROGRAM_FILE).exists()
    assert generate(model, PROMPTS, 5, cache=cache, prefill_fn=cold) == generate(model, PROMPTS, 5)


class _Unit:
    """A package stand-in whose outputs are the reference's, shifted."""

    def __init__(self, outputs):
        self.loader = self
        self.outputs = outputs
        self.spec = UnitSpec("unit0.pt2", (0,), True, -1)

    def run(self, args):
        return self.outputs


@settings(max_examples=40, deadline=None)
@given(scale=st.floats(1e-7, 10.0), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_check_refuses_every_package_off_by_more_than_its_tolerance(scale, dtype):
    torch.manual_seed(0)
    x = torch.randn(9, 16, dtype=dtype)
    sub = torch.fx.symbolic_trace(lambda x: (x * 2, torch.empty_like(x)))
    want = sub(x)
    shifted = want[0] + scale * want[0].abs().max()
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    error = float(((shifted.double() - want[0].double()).abs().max()) / want[0].double().abs().max())
    outputs = [shifted.to(dtype), torch.full_like(x, 7.0)]  # output 1: an uninitialized buffer, never compared
    if error > tol:
        with pytest.raises(ValueError, match="output 0 is off by"):
            check_unit(_Unit(outputs), sub, [x], {1})
    else:
        check_unit(_Unit(outputs), sub, [x], {1})
    both = torch.fx.symbolic_trace(lambda x: (x * 2, x + 1))  # the same second output, compared: refused
    with pytest.raises(ValueError, match="output 1 is off by"):
        check_unit(_Unit([want[0], x + 1 + 10 * x.abs().max()]), both, [x], set())


def test_a_hugging_face_decoder_starts_from_its_packages_and_equals_hf(tmp_path):
    from test_hf import PROMPTS as HF_PROMPTS
    from test_hf import flat_logits, hf_logits, rel, tiny

    model = tiny("qwen2")
    expected = [hf_logits(model, p) for p in HF_PROMPTS]
    starts = []
    for _ in range(2):
        graphed = piecegraph.compile(model, mode="piecewise", capture_sizes=(32,), emulate_graphs=True,
                                     cache_dir=tmp_path, aot_package=True, aot_background=False)
        got = flat_logits(graphed, graphed.model, HF_PROMPTS)
        assert max(rel(a, b) for a, b in zip(got, expected)) < 1e-5
        startup = graphed.stats()["startup"]
        starts.append((startup["trace"], (startup.get("aot") or "")[:len("packaged 3 units")]))
    assert starts == [("traced", "packaged 3 units"), ("packaged", "")]


def test_the_ready_line_says_where_the_program_came_from():
    from piecegraph.graphs.progress import summary

    base = {"ready_s": 2.0, "capture_s": 1.2, "num_sizes": 36, "pool_bytes": 60 << 20}
    assert summary({**base, "cache": "warm", "trace": "packaged"}).endswith(
        "cache warm, from AOTInductor packages)")
    assert summary({**base, "cache": "cold", "trace": "traced", "aot": "packaged 3 units in 57.4 s"}).endswith(
        "cache cold, packaged 3 units in 57.4 s)")
    assert summary({**base, "cache": "warm", "trace": "loaded"}).endswith("cache warm)")
