"""The command line on CPU: the demo's token check and a bench smoke run with valid JSON."""

import json

import pytest
from typer.testing import CliRunner

from piecegraph.cli import app

runner = CliRunner()


def test_demo_on_cpu_checks_tokens_against_eager():
    result = runner.invoke(app, ["demo", "--device", "cpu", "--steps", "4"])
    assert result.exit_code == 0, result.output
    assert "graphed tokens equal eager tokens" in result.output
    assert "ms / step" in result.output


def test_bench_smoke_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    result = runner.invoke(
        app, ["bench", "--device", "cpu", "--batches", "1,3", "--context", "8", "--repeats", "2", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["env"]["gpu"] == "cpu" and data["env"]["torch"]
    rows = data["rows"]
    decode = [r for r in rows if r["phase"] == "decode"]
    assert {(r["mode"], r["batch"]) for r in decode} == {(m, b) for m in ("eager", "none") for b in (1, 3)}
    for row in rows:
        assert row["ms"] > 0 and row["tok_s"] > 0
        assert row["rel_err"] < 1e-5  # compiled pieces against eager, float32


def test_bad_arguments_name_the_option():
    result = runner.invoke(app, ["bench", "--device", "cpu", "--batches", "1,x"])
    assert result.exit_code != 0 and "--batches" in result.output
    result = runner.invoke(app, ["demo", "--device", "cpu", "--model", "/no/such/dir"])
    assert result.exit_code != 0 and "--model" in result.output


@pytest.mark.parametrize("source,func,needle", [
    ("def make():\n    raise RuntimeError('boom')\n", "make", "raised RuntimeError: boom"),
    ("def make(x):\n    return x\n", "make", "needs arguments (x)"),
    ("def make(:\n", "make", "SyntaxError"),
])
def test_doctor_target_errors_are_one_usage_error(tmp_path, source, func, needle):
    target = tmp_path / "target.py"
    target.write_text(source)
    result = CliRunner().invoke(app, ["doctor", f"{target}:{func}", "--device", "cpu"])
    assert result.exit_code == 2 and "TARGET" in result.output and needle in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_outputs_that_cannot_be_written_are_refused_before_any_work(tmp_path):
    missing = tmp_path / "no" / "such" / "report.json"
    for args in (["doctor", "x.py:f", "--json", str(missing)], ["bench", "--device", "cpu", "--plot", str(missing)]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and ("--json" in result.output or "--plot" in result.output), result.output


def test_bench_model_folder_without_a_checkpoint_names_the_flag(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--device", "cpu", "--model", str(tmp_path)])
    assert result.exit_code == 2 and "--model" in result.output and "config.json" in result.output
