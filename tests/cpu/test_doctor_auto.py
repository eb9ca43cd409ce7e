"""The doctor names the function the model called (never a decorator's wrapper) and, for a library the FlashInfer
adapter does not cover, the piecegraph.opaque(...) line with the fake inferred by probing: --fix applies it and
traces again (0 breaks), and the printed lines pasted into a fresh process trace with 0 breaks."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jitlib_auto
import pytest
import torch
from test_auto_opaque import ENTRIES, Block

import piecegraph
from piecegraph.diagnose.attribute import Finding
from piecegraph.diagnose.autowrap import Wrapping
from piecegraph.diagnose.entry import Entry
from piecegraph.diagnose.fixes import FLASHINFER_FIX, choose_fixes
from piecegraph.ops.auto_opaque import AutoOp
from piecegraph.ops.opaque import is_opaque

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _unroute():
    yield
    piecegraph.unfreeze()
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def report():
    """One doctor report (no --fix: it wraps and routes nothing), shared by the tests that read it."""
    torch.manual_seed(0)
    return piecegraph.doctor(Block().eval(), torch.randn(5, 8))


def test_entries_are_the_functions_called_and_fixes_are_inferred_opaque_lines(report):
    assert not report.ok and report.graph_breaks >= 2
    entries = {f.entry for f in report.findings}
    assert entries <= {f"jitlib_auto.{n}" for n in ENTRIES}, entries  # never jitlib_auto.utils.wrapper
    lines = [line for f in report.findings for line in f.fix.splitlines()]
    assert {line.split(" = ")[0] for line in lines} == {f"jitlib_auto.{n}" for n in ENTRIES}
    assert all("piecegraph.opaque(" in line and "fake=..." not in line for line in lines)
    assert not any("freeze" in line for line in lines)  # a frozen loader would leave the kernel's break
    bmm = next(f for f in report.findings if f.entry == "jitlib_auto.bmm")
    assert bmm.primitive == "Invalid call to __build_class__" and bmm.count == 2
    assert not is_opaque(jitlib_auto.bmm)  # reporting wraps nothing


def test_fix_applies_the_lines_and_traces_with_zero_breaks():
    model, x = Block().eval(), torch.randn(5, 8)
    with torch.no_grad():
        expected = model(x)
    report = piecegraph.doctor(model, x, fix=True)
    try:
        assert report.ok and report.graph_breaks == 0 and report.before["graph_breaks"] >= 2
        assert len(report.applied.codes) == len(ENTRIES)
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), expected)
    finally:
        report.applied.undo()
    assert not is_opaque(jitlib_auto.bmm) and not is_opaque(jitlib_auto.rms_norm)


def test_printed_lines_pasted_into_a_fresh_process_trace_with_zero_breaks(tmp_path, report):
    lines = list(dict.fromkeys(line for f in report.findings for line in f.fix.splitlines()))
    script = tmp_path / "pasted.py"
    script.write_text(textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import torch
        import jitlib_auto
        import piecegraph
        """) + "\n".join(lines) + textwrap.dedent("""
        from test_auto_opaque import Block  # the model's module imports after the lines, as a user's would
        torch.manual_seed(0)
        report = piecegraph.doctor(Block().eval(), torch.randn(5, 8))
        print("BREAKS", report.graph_breaks, report.ok)
        """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BREAKS 0 True" in done.stdout, done.stdout + done.stderr[-3000:]


def _finding(package: str, entry: str, fn) -> Finding:
    return Finding("trace", "filesystem", package, entry, None, None, "posix.stat", "x.py:1",
                   entry_ref=Entry(fn, entry))


def test_the_adapter_is_the_fix_only_for_functions_it_covers():
    def rmsnorm(x):
        return x

    def bmm_fp8(a, b):
        return a

    covered, other = _finding("flashinfer", "flashinfer.rmsnorm", rmsnorm), \
        _finding("flashinfer", "flashinfer.bmm_fp8", bmm_fp8)
    line = 'flashinfer.bmm_fp8 = piecegraph.opaque(flashinfer.bmm_fp8, fake={"shape": ...})'
    plan = Wrapping(ops={"flashinfer.bmm_fp8": AutoOp("flashinfer.bmm_fp8", bmm_fp8, line, "{}", ())})
    fixes = choose_fixes([covered, other], plan)
    assert fixes[id(covered)].code == FLASHINFER_FIX and fixes[id(covered)].adapter
    assert fixes[id(other)].code == line and not fixes[id(other)].adapter
    refused = _finding("flashinfer", "flashinfer.bmm_fp8", bmm_fp8)
    fix = choose_fixes([refused], Wrapping(refused={"flashinfer.bmm_fp8": "it returns str"}))[id(refused)]
    assert fix.code == "flashinfer.bmm_fp8 = piecegraph.opaque(flashinfer.bmm_fp8, fake=...)  # not inferred: it " \
                       "returns str" and fix.action is None  # never "install the adapter", which would loop
