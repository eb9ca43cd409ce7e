"""The one result schema: write and load round trip, a clear error for a file outside it, the committed name, the
comparison of two files, ``piecegraph report``, and every committed ``benchmarks/results`` file loading."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from piecegraph.cli import app
from piecegraph.results import (
    REQUIRED_ENV,
    SchemaError,
    environment,
    gpu_short,
    load_result,
    result_name,
    write_result,
)
from piecegraph.results.report import compare, default_what, key_columns, measure_columns, report_lines
from piecegraph.results.schema import NAME, check

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
runner = CliRunner()


def _env(**more):
    return {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "flashinfer": "0.5.3", "attention": "flashinfer",
            "model": "qwen2.5-0.5b", "dtype": "bfloat16", "quant": "bf16", "world_size": 1, "date": "2026-12-05",
            "commit": "abc1234", **more}


def _serve_rows(scale: float) -> list[dict]:
    return [{"mode": mode, "concurrency": c, "requests": 4 * c, "output_tok_s": base * c * scale,
             "itl_p50_ms": 2.0 / scale, "steps_by_kind": {"full": 3}}
            for mode, base in (("auto", 600.0), ("piecewise", 400.0)) for c in (1, 10)]


def test_write_then_load_round_trips_rows_env_and_extra_keys(tmp_path):
    rows = [{"mode": "auto", "concurrency": 1, "output_tok_s": 612.5, "steps_by_kind": {"full": 10}}]
    path = write_result(tmp_path / "deep" / "r.json", "serve-bench", _env(context=256), rows,
                        setup={"auto": {"wall_s": 3.5}})
    result = load_result(path)
    assert (result.benchmark, result.rows, result.extra, result.path) == (
        "serve-bench", rows, {"setup": {"auto": {"wall_s": 3.5}}}, path)
    assert result.env == _env(context=256)
    assert list(json.loads(path.read_text())) == ["benchmark", "env", "rows", "setup"]
    assert not list(path.parent.glob(".*.tmp"))  # written whole, then renamed into place


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d.pop("benchmark"), "missing top-level key 'benchmark'"),
    (lambda d: d.pop("rows"), "missing top-level key 'rows'"),
    (lambda d: d["env"].pop("world_size"), "missing env key 'world_size'"),
    (lambda d: d["env"].update(world_size="1"), "env.world_size must be an int"),
    (lambda d: d["env"].update(gpu=None), "env.gpu must be a string"),
    (lambda d: d["env"].update(date="05/12/2026"), "env.date must be YYYY-MM-DD"),
    (lambda d: d.update(rows={"a": 1}), "'rows' must be a list"),
    (lambda d: d.update(rows=[[1, 2]]), "rows[0] must be an object"),
])
def test_a_file_outside_the_schema_is_refused_naming_the_file_and_the_key(tmp_path, mutate, needle):
    data = {"benchmark": "bench", "env": _env(), "rows": [{"mode": "eager", "ms": 1.0}]}
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaError) as err:
        load_result(path)
    assert str(path) in str(err.value) and needle in str(err.value)
    if "rows" in data:  # the writer checks too, and writes nothing
        with pytest.raises(SchemaError, match="nothing"):
            write_result(tmp_path / "nothing.json", data.get("benchmark", ""), data["env"], data["rows"])
        assert not (tmp_path / "nothing.json").exists()


def test_a_file_that_is_not_json_names_the_file(tmp_path):
    path = tmp_path / "half.json"
    path.write_text('{"benchmark": "bench", "env": ')
    with pytest.raises(SchemaError, match=f"{path}: not JSON"):
        load_result(path)


def test_an_old_layout_is_named_as_such():
    with pytest.raises(SchemaError, match="before the one result schema"):
        check({"env": {}, "modes": {}})


def test_environment_reads_the_process_and_takes_the_run_fields():
    env = environment(attention="torch", model="tiny", dtype="torch.float32", quant=None, gpu="cpu", context=8)
    assert set(REQUIRED_ENV) <= set(env) and env["context"] == 8
    assert (env["gpu"], env["dtype"], env["world_size"], env["attention"]) == ("cpu", "float32", 1, "torch")
    check({"benchmark": "x", "env": env, "rows": []})  # in the schema as it comes


@pytest.mark.parametrize("gpu,short", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("cpu", "cpu"),
                                       ("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA A100-SXM4-80GB", "a100")])
def test_gpu_short(gpu, short):
    assert gpu_short(gpu) == short


def test_result_name_and_the_default_what():
    assert result_name(_env(), "serve every mode") == "2026-12-05_h100_serve_every_mode.json"
    assert result_name(_env(gpu="cpu"), "Bench: torch") == "2026-12-05_cpu_bench_torch.json"
    with pytest.raises(ValueError, match="no name"):
        result_name(_env(), "..")
    bench = check({"benchmark": "bench", "env": _env(), "rows": []})
    assert default_what(bench) == "bench_modes_flashinfer"
    moe = check({"benchmark": "serve-bench", "env": _env(model="tiny-moe", quant="fp8", world_size=2), "rows": []})
    assert result_name(moe.env, default_what(moe)) == "2026-12-05_h100_serve_tiny-moe_flashinfer_fp8_tp2.json"


def test_key_and_measure_columns():
    rows = [{"mode": "eager", "phase": "decode", "batch": 1, "ms": 2.0, "seqs": 1, "note": "x", "skipped": None,
             "piecewise.trace": "traced", "sizes": [1, 2]}]
    keys = key_columns(rows)
    assert keys == ["mode", "phase", "batch"]  # free text, dotted parts and lists are never keys
    assert measure_columns(rows, keys) == ["ms", "seqs"]


def test_two_files_are_compared_row_by_row_with_the_right_ratios():
    a = check({"benchmark": "serve-bench", "env": _env(), "rows": _serve_rows(1.0)})
    b_rows = [r for r in _serve_rows(1.25) if r["mode"] == "auto"] + [
        {"mode": "eager", "concurrency": 1, "output_tok_s": 30.0, "itl_p50_ms": 25.0}]
    b = check({"benchmark": "serve-bench", "env": _env(gpu="NVIDIA H200"), "rows": b_rows})
    cmp = compare(a, b)
    assert cmp.keys == ["mode", "concurrency"]
    assert cmp.columns == ["output_tok_s", "itl_p50_ms"]  # the serve-bench default (its TTFT column is absent)
    assert cmp.ratios("output_tok_s") == {("auto", 1): pytest.approx(1.25), ("auto", 10): pytest.approx(1.25)}
    assert cmp.ratios("itl_p50_ms") == {("auto", 1): pytest.approx(0.8), ("auto", 10): pytest.approx(0.8)}
    assert cmp.only_a == [("piecewise", 1), ("piecewise", 10)] and cmp.only_b == [("eager", 1)]
    every = compare(a, b, columns=["requests"], key=["mode", "concurrency"])
    assert every.ratios("requests") == {("auto", 1): 1.0, ("auto", 10): 1.0}
    with pytest.raises(ValueError, match="no column 'nope'"):
        compare(a, b, columns=["nope"])
    bench = check({"benchmark": "bench", "env": _env(), "rows": [{"mode": "auto", "phase": "decode", "batch": 1,
                                                                  "ms": 1.5}]})
    with pytest.raises(ValueError, match=r"no row of A \(serve-bench\) matches a row of B \(bench\)"):
        compare(a, bench)
    lines = report_lines([a, b])
    assert any("only in A: piecewise, 1" in line for line in lines if isinstance(line, str))


def _squeezed(text: str) -> str:
    """A usage error's text without its box and line breaks (rich wraps it to the terminal)."""
    return "".join(c for c in text if not c.isspace() and c not in "│╭╮╰╯─")


def test_report_command_prints_rows_compares_and_names(tmp_path):
    a = write_result(tmp_path / "a.json", "serve-bench", _env(), _serve_rows(1.0))
    b = write_result(tmp_path / "b.json", "serve-bench", _env(), _serve_rows(2.0))
    one = runner.invoke(app, ["report", str(a)], terminal_width=200)
    assert one.exit_code == 0, one.output
    assert "output_tok_s" in one.output and "6,000" in one.output and "steps_by_kind" in one.output  # not shown
    two = runner.invoke(app, ["report", str(a), str(b), "--columns", "output_tok_s"], terminal_width=200)
    assert two.exit_code == 0, two.output
    assert "2.000" in two.output and "rows matched on mode, concurrency" in two.output
    named = runner.invoke(app, ["report", str(a), "--name", "--what", "serve every mode"])
    assert named.output.strip() == "2026-12-05_h100_serve_every_mode.json"
    assert runner.invoke(app, ["report", str(a), "--name"]).output.strip() == "2026-12-05_h100_serve_flashinfer.json"
    kept = write_result(tmp_path / "2026-12-05_h100_serve_auto_vs_piecewise.json", "serve-bench", _env(), [])
    assert runner.invoke(app, ["report", str(kept), "--name"]).output.strip() == kept.name  # already its name
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"benchmark": "bench", "env": {}, "rows": []}))
    refused = runner.invoke(app, ["report", str(bad)])
    assert refused.exit_code == 2 and "missingenvkey'gpu'" in _squeezed(refused.output)


def test_report_plots_a_serve_bench_file(tmp_path):
    path = write_result(tmp_path / "s.json", "serve-bench", _env(), _serve_rows(1.0),
                        setup={"auto": {"wall_s": 1.0}, "piecewise": {"wall_s": 1.0}})
    png = tmp_path / "s.png"
    out = runner.invoke(app, ["report", str(path), "--plot", str(png)])
    assert out.exit_code == 0, out.output
    assert png.read_bytes().startswith(b"\x89PNG")
    other = write_result(tmp_path / "o.json", "startup", _env(), [{"start": "cold", "ready_s": 24.0}])
    refused = runner.invoke(app, ["report", str(other), "--plot", str(png)])
    assert refused.exit_code == 2 and "nothingtoplot" in _squeezed(refused.output)


COMMITTED = sorted(RESULTS.glob("*.json"))


def test_results_folder_holds_only_named_json_files():
    names = sorted(p.name for p in RESULTS.iterdir())
    assert COMMITTED and 0 < len(names) <= 60
    assert [n for n in names if not n.endswith(".json")] == []  # tables live in the JSON; docs show no images


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_every_committed_result_loads_and_is_named_by_the_pattern(path):
    result = load_result(path)  # raises naming the file and the key when it is not in the schema
    match = NAME.fullmatch(path.name)
    assert match, f"{path.name} is not <YYYY-MM-DD>_<gpu>_<what>.json"
    assert match["date"] == result.env["date"] and match["gpu"] == gpu_short(result.env["gpu"])
    assert result.rows, f"{path.name} has no rows"
