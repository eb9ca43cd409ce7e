"""piecegraph doctor on CPU: the catalogue (one target per category), the CLI, JSON schema, --fix, the reference
model."""

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import piecegraph
from piecegraph.cli import app
from piecegraph.diagnose import SCHEMA, validate
from piecegraph.ops.freeze import unfreeze

TARGETS = Path(__file__).resolve().parent / "doctor_targets"
CATALOGUE = TARGETS / "catalogue.py"
sys.path.insert(0, str(TARGETS))
import catalogue  # noqa: E402  (adds jitlib's folder to sys.path too)
from jitlib import kernels  # noqa: E402

runner = CliRunner()
needs_cc = pytest.mark.skipif(kernels.compiler() is None, reason="no C compiler (cc) on this machine")


@pytest.fixture
def restore_jitlib():
    """--fix rebinds jitlib's functions in loaded modules: put back exactly what each name held before."""
    names = ("scaled_add", "rmsnorm", "halves", "scale_", "get_kernel_module", "compiler_version")
    watched = {id(getattr(kernels, n)) for n in names}
    watched |= {id(getattr(kernels, n).__wrapped__) for n in names if hasattr(getattr(kernels, n), "__wrapped__")}
    saved = [(module.__dict__, attr, value) for module in list(sys.modules.values())
             if isinstance(getattr(module, "__dict__", None), dict)
             for attr, value in list(module.__dict__.items()) if id(value) in watched]
    yield
    unfreeze()
    for namespace, attr, value in saved:
        namespace[attr] = value


def _run(name):
    value = getattr(catalogue, name)()
    if isinstance(value, dict):
        return piecegraph.doctor(value["model"], *value["inputs"], context=value.get("context"))
    model, inputs = value
    return piecegraph.doctor(model, *inputs)


@pytest.mark.parametrize("name", sorted(catalogue.EXPECTED))
def test_catalogue_target_is_attributed(name):
    if name == "jit" and kernels.compiler() is None:
        pytest.skip("no C compiler (cc) on this machine")
    category, package, entry, loader, warm, count = catalogue.EXPECTED[name]
    report = _run(name)
    assert not report.ok and report.graph_breaks >= 1
    first = report.findings[0]  # the largest group leads; each target has one root cause
    got = (first.category, first.package, first.entry, first.loader, first.loader_warm, first.count)
    assert got == (category, package, entry, loader, warm, count), first
    assert first.kind == "trace" and first.fix and first.primitive
    assert first.location.rsplit(":", 1)[1].isdigit()
    assert {f.group for f in report.findings} == {1}  # one root cause: one group, one fix
    assert validate(report.json()) == []


def test_catalogue_covers_every_category():
    from piecegraph.diagnose.attribute import CATEGORIES

    categories = {v[0] for v in catalogue.EXPECTED.values()}

    assert categories == set(CATEGORIES)
    assert len(catalogue.EXPECTED) >= 10


def test_library_fix_is_opaque_with_derived_fake_and_loader_is_named():
    report = _run("filesystem")
    first = report.findings[0]
    assert first.fix == 'fakelib.scale = piecegraph.opaque(fakelib.scale, fake="like:x")'
    assert "posix.stat" in first.primitive and first.location.endswith("loaders.py:13")
    assert any("catalogue.py" in s for s in first.stack)  # the full user stack, model frame included


def test_clean_target_exits_zero_and_writes_valid_json_and_html(tmp_path):
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    result = runner.invoke(app, ["doctor", f"{CATALOGUE}:clean", "--json", str(out), "--html", str(page)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert validate(data) == [] and data["ok"] is True and data["findings"] == []
    assert data["graph_breaks"] == 0 and data["pieces"] == 1 and data["torch"] == torch.__version__
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "<script" not in text and "http" not in text


def test_blocked_target_exits_one_with_schema_valid_json(tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["doctor", f"{CATALOGUE}:data_dependent", "--json", str(out)])
    assert result.exit_code == 1, result.output
    data = json.loads(out.read_text())
    assert validate(data) == []
    finding = data["findings"][0]
    assert finding["category"] == "data_dependent" and finding["package"] == "user"
    assert set(SCHEMA["properties"]["findings"]["items"]["required"]) <= set(finding)
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(data, SCHEMA)  # the hand-written validator agrees with the reference one


def test_validator_rejects_bad_documents():
    good = {"ok": True, "torch": "2.11", "findings": [], "pieces": 0, "graph_breaks": 0}
    assert validate(good) == []
    assert validate({**good, "ok": 1})
    assert validate({k: v for k, v in good.items() if k != "pieces"})
    bad_finding = {"kind": "trace", "category": "nope", "package": "x", "entry": None, "loader": None,
                   "loader_warm": None, "primitive": "p", "location": "f:1", "count": 1, "fix": ""}
    assert any("category" in e for e in validate({**good, "findings": [bad_finding]}))


@needs_cc
def test_fix_on_jitlib_clears_every_break(restore_jitlib):
    model, inputs = catalogue.jit()
    expected = model(*inputs)
    report = piecegraph.doctor(model, *inputs, fix=True)
    try:
        assert report.ok and report.graph_breaks == 0
        assert report.before["graph_breaks"] >= 1 and report.before["findings"] >= 1
        assert report.applied.codes == ['jitlib.scaled_add = piecegraph.opaque(jitlib.scaled_add, fake="like:x")']
        compiled = torch.compile(model, backend="eager", fullgraph=True)  # the fix holds for a real trace
        torch.testing.assert_close(compiled(*inputs), expected)
        assert report.json()["fixed"]["after"]["graph_breaks"] == 0
    finally:
        report.applied.undo()
        torch._dynamo.reset()
    assert getattr(kernels.scaled_add, "__piecegraph_opaque__", None) is None  # undo restored the original


@needs_cc
def test_cli_fix_shows_before_and_after(tmp_path, restore_jitlib):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["doctor", f"{CATALOGUE}:jit", "--fix", "--json", str(out)])
    assert result.exit_code == 0, result.output
    fixed = json.loads(out.read_text())["fixed"]
    assert fixed["before"]["graph_breaks"] >= 1 and fixed["after"]["graph_breaks"] == 0
    assert "--fix applied 1 fix(es)" in result.output


def test_reference_model_is_ok_within_a_minute():
    from piecegraph.attention import KVCache
    from piecegraph.models import TINY, Decoder, dummy_inputs

    start = time.perf_counter()
    model = Decoder.random(TINY, seed=0).eval()
    cache = KVCache.for_sequences(model.config, 2, 32, dtype=torch.float32, device="cpu")
    (ids, positions), meta = dummy_inputs(model, cache, 5)
    report = piecegraph.doctor(model, ids, positions, context=meta)
    assert report.ok, [f.json() for f in report.findings]
    assert report.pieces == TINY.num_layers + 1 and report.graph_breaks == 0
    assert time.perf_counter() - start < 60


def test_module_target_with_context_dict(tmp_path, monkeypatch):
    (tmp_path / "my_target.py").write_text(
        "import torch\n"
        "from piecegraph.attention import KVCache\n"
        "from piecegraph.models import TINY, Decoder, dummy_inputs\n"
        "def build():\n"
        "    m = Decoder.random(TINY, seed=0).eval()\n"
        "    cache = KVCache.for_sequences(m.config, 2, 16, dtype=torch.float32, device='cpu')\n"
        "    (ids, pos), meta = dummy_inputs(m, cache, 3)\n"
        "    return {'model': m, 'inputs': (ids, pos), 'context': meta}\n")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["doctor", "my_target:build", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "ok" in result.output


def test_bad_target_names_the_argument():
    result = runner.invoke(app, ["doctor", "no_such_module_xyz:build"])
    assert result.exit_code == 2 and "TARGET" in result.output
    result = runner.invoke(app, ["doctor", f"{CATALOGUE}:no_such_function"])
    assert result.exit_code == 2 and "no_such_function" in result.output
    result = runner.invoke(app, ["doctor", f"{CATALOGUE}:clean", "--device", "tpu"])
    assert result.exit_code == 2 and "--device" in result.output


def test_hard_failure_is_reported_not_raised():
    class Raises(torch.nn.Module):
        calls = 0

        def forward(self, x):
            Raises.calls += 1
            if Raises.calls > 1:  # eager prewarm passes; the traced call fails
                raise ValueError("boom in forward")
            return x + 1

    report = piecegraph.doctor(Raises(), torch.randn(3, 2))
    assert not report.ok and "boom in forward" in (report.error or "")
    assert any(f.hard for f in report.findings)


def test_model_that_fails_eagerly_is_one_clear_line_not_a_traceback(tmp_path, monkeypatch):
    (tmp_path / "eager_fails.py").write_text(
        "import torch\n"
        "class Refuses(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        raise RuntimeError('fp4_quantize requires SM100 or newer; got SM90')\n"
        "def build():\n"
        "    return Refuses(), (torch.randn(3, 2),)\n")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["doctor", "eager_fails:build"])
    assert result.exit_code == 2, result.output
    assert "fails when run eagerly" in result.output and "requires SM100" in result.output
    assert "eager_fails.py:4" in result.output.replace("\n", "") and "Traceback" not in result.output


def test_python_api_is_exported():
    assert "doctor" in piecegraph.__all__ and callable(piecegraph.doctor)
    assert os.path.basename(piecegraph.doctor.__code__.co_filename) == "core.py"
