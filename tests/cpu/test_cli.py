"""The command line on CPU: the demo's token check and a bench smoke run with valid JSON."""

import json

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
