"""A warm start from AOTInductor packages (``Config(aot_package=True)``; trace/aot_package.py, trace/aot_load.py):
the cold start packages each compiled unit and runs the packages itself; a second process loads them without
importing Dynamo, Inductor or sympy and gives the cold start's bits; generation equals eager; a package that does
not load, or one whose check fails, leaves the start on Inductor's code, never on wrong code. Graphs emulated on
CPU (packaging compiles C++: ~6-10 s a unit here, so the cold entries are made once per module)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import piecegraph
import piecegraph.build as build
from piecegraph.attention import KVCache
from piecegraph.models import TINY, Decoder, dummy_inputs, generate
from piecegraph.trace.aot_load import UnitSpec
from piecegraph.trace.aot_package import PROGRAM_FILE, check_unit

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12]]
SIZES = {"piecewise": (4, 16), "full": (1, 2, 4)}
REPO = Path(__file__).resolve().parents[2]

# One start in a fresh process: the tiny decoder, every size captured, one prefill of 7 tokens; prints its stats,
# the output's bytes and which of the compiler stack's modules the process imported.
START = r"""
import json, sys
import torch
import piecegraph
from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.models import TINY, Decoder, dummy_inputs
torch.set_num_threads(1)
root, mode = sys.argv[1], sys.argv[2]
model = Decoder.random(TINY, seed=0).eval()
cache = KVCache.for_sequences(TINY, 3, 48)
sizes = (1, 2, 4) if mode == "full" else (4, 16)
graphed = piecegraph.compile(model, mode=mode, capture_sizes=sizes, emulate_graphs=True, cache_dir=root,
                             aot_package=True)
graphed.capture(lambda n: dummy_inputs(model, cache, n))
meta = AttentionMetadata.for_batch(cache, [(0, 0, 1 if mode == "full" else 7)])
with piecegraph.forward_context(meta):
    out = graphed(torch.arange(meta.num_tokens) % TINY.vocab_size, meta.positions)
startup = graphed.stats()["startup"]
print(json.dumps({"cache": startup["cache"], "trace": startup["trace"], "aot": startup.get("aot"),
                  "out": out.flatten().tolist(),
                  "imported": [m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules]}))
"""


def _process_start(root: Path, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-c", START, str(root), mode], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    """mode -> (cache folder, the cold start's report): each made once, by a cold start in its own process."""
    out = {}
    for mode in SIZES:
        root = tmp_path_factory.mktemp(f"aot-{mode}")
        out[mode] = root, _process_start(root, mode)
    return out


def _start(root: Path, mode: str, **config):
    model = Decoder.random(TINY, seed=0).eval()
    cache = KVCache.for_sequences(TINY, 3, 48)
    graphed = piecegraph.compile(model, mode=mode, capture_sizes=SIZES[mode], emulate_graphs=True, cache_dir=root,
                                 aot_package=True, **config)
    graphed.capture(lambda n: dummy_inputs(model, cache, n))
    return model, cache, graphed


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_second_process_loads_the_packages_without_the_compiler_and_gives_the_same_bits(entries, mode):
    root, cold = entries[mode]
    assert (cold["cache"], cold["trace"]) == ("cold", "traced")
    assert cold["aot"].startswith("packaged " + ("1 units" if mode == "full" else "3 units")), cold["aot"]
    warm = _process_start(root, mode)
    assert (warm["cache"], warm["trace"], warm["aot"]) == ("warm", "packaged", None)
    assert warm["imported"] == []  # neither Dynamo, Inductor nor sympy
    assert warm["out"] == cold["out"]  # the very code the cold start ran: the same bits


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_start_from_packages_generates_what_eager_generates(entries, mode):
    root, _ = entries[mode]
    model, cache, warm = _start(root, mode)
    assert warm.stats()["startup"]["trace"] == "packaged"
    want = generate(model, PROMPTS, 5)
    role = {"prefill_fn": warm} if mode == "piecewise" else {"decode_fn": warm}
    assert generate(model, PROMPTS, 5, cache=cache, **role) == want
    with pytest.raises(ValueError, match="input input_ids is torch.float32"):  # the loaded binding still checks
        warm(torch.zeros(2), torch.zeros(2, dtype=torch.long))


def test_packages_that_do_not_load_leave_the_start_on_compiled_code_with_a_warning(entries, tmp_path, monkeypatch,
                                                                                   caplog):
    root = tmp_path / "copy"
    shutil.copytree(entries["piecewise"][0], root)

    def broken(*args, **kwargs):
        raise RuntimeError("Error in dlopen: a package of another machine")

    monkeypatch.setattr(build, "load_packaged", broken)
    with caplog.at_level(logging.WARNING, logger="piecegraph"):
        model, cache, warm = _start(root, "piecewise")
    assert "compiled packages could not be used (RuntimeError: Error in dlopen" in caplog.text
    assert warm.stats()["startup"]["trace"] == "loaded"  # the cached trace, compiled by Inductor
    assert generate(model, PROMPTS, 5, cache=cache, prefill_fn=warm) == generate(model, PROMPTS, 5)


def test_a_package_whose_check_fails_is_not_kept_and_the_start_runs_compiled_code(tmp_path, monkeypatch):
    def off(unit, sub, args, skip):
        raise ValueError("output 0 is off by 1.00e+00 (relative) from the unit run eagerly")

    monkeypatch.setattr("piecegraph.trace.aot_package.check_unit", off)
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
