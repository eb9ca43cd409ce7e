"""``piecegraph bench`` through its command line on CPU: valid JSON with the documented keys, a real PNG and the
compact text, the ``--attention`` backend recorded, modes that cannot run here skipped with a reason, options that
cannot run refused naming the flag, ``--quant fp8`` judged against its float weights, a comma list of quants with
its accuracy row checked against each sequence run alone, and a ``--profile`` list."""

import json

import pytest
import torch
from bench_helpers import PNG_SIGNATURE, runner

from piecegraph.attention import AttentionMetadata, KVCache
from piecegraph.attention.backends.torch_sdpa import TorchBackend
from piecegraph.bench import command as bench_command
from piecegraph.bench.cases import prefill_lengths
from piecegraph.bench.harness import Row
from piecegraph.bench.report import compact
from piecegraph.cli import app
from piecegraph.cli_common import load_model
from piecegraph.context import forward_context
from piecegraph.models import TINY
from piecegraph.results import load_result

ENV_KEYS = {"gpu", "torch", "flashinfer", "model", "dtype", "quant", "world_size", "date", "commit", "bandwidth_gbs",
            "context", "repeats", "attention", "attention_option", "inductor_graph_partition"}
ROW_KEYS = {"mode", "phase", "ms", "tok_s", "hbm_frac", "setup_s", "pool_mib", "rel_err"}


def _backend_name(requested: str) -> str:
    """What the models package resolves ``requested`` to on CPU: the reference for the bench's env."""
    return KVCache(TINY, 2, backend=requested).backend.name


def test_smoke_run_writes_json_png_and_profile(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--batches", "1,2", "--prefill", "16,40", "--context",
                                 "8", "--repeats", "2", "--json", str(out), "--plot", str(png), "--profile", "none:1"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert load_result(out).benchmark == data["benchmark"] == "bench"  # the one result schema
    env = data["env"]
    assert ENV_KEYS <= set(env) and env["gpu"] == "cpu" and env["bandwidth_gbs"] > 0 and env["world_size"] == 1
    assert env["attention_option"] == "auto" and env["attention"] == _backend_name("auto")
    assert {(r["mode"], r["phase"], r.get("batch", r.get("tokens"))) for r in data["rows"]} == {
        (m, p, s) for m in ("eager", "none") for p, sizes in (("decode", (1, 2)), ("prefill", (16, 40))) for s in sizes}
    for row in data["rows"]:
        assert ROW_KEYS <= set(row) and "skipped" not in row
        assert ("batch" in row) == (row["phase"] == "decode") and ("tokens" in row) == (row["phase"] == "prefill")
        assert row["ms"] > 0 and row["tok_s"] > 0 and 0 < row["hbm_frac"] and row["rel_err"] < 1e-5
        if row["phase"] == "decode":  # the loop's pace beside the synchronized step, over the same HBM floor
            assert row["loop_ms"] > 0
            assert row["loop_hbm_frac"] == pytest.approx(row["hbm_frac"] * row["ms"] / row["loop_ms"])
        else:
            assert "loop_ms" not in row and "loop_hbm_frac" not in row
        assert Row.from_json(row).to_json() == row
    prefill_seqs = {r["tokens"]: r["seqs"] for r in data["rows"] if r["phase"] == "prefill"}
    assert prefill_seqs == {t: len(prefill_lengths(t)) for t in (16, 40)}
    assert data["setup"]["none"]["pieces"] == TINY.num_layers + 1  # split at each attention op
    startup = data["setup"]["none"]["startup"]  # the setup split into its stages
    assert startup["trace_s"] > 0 and startup["compile_s"] >= 0 and startup["prewarm_s"] >= 0
    assert startup["diagnose_s"] == 0  # the reference decoder traces at once: nothing to diagnose
    profile = data["profile"]
    assert profile["split_calls_per_step"] == TINY.num_layers and profile["aten_ops_per_split"] > 5
    assert profile["attention_backend"] == env["attention"]
    op_us = data["attention_op_us"]
    assert "failed" not in op_us and op_us["decode_1"] > 0 and op_us["prefill_512"] > 0
    bytes_ = png.read_bytes()
    assert bytes_.startswith(PNG_SIGNATURE) and len(bytes_) > 10_000  # two drawn panels, not an empty canvas
    text = compact(data)
    assert "prefill" in text and "skip" not in text and f"{env['attention']} attention" in text
    assert "attention op CPU us per call" in text
    assert [line.split()[:2] for line in text.splitlines() if line.startswith("loop ")] == [["loop", "1"],
                                                                                          ["loop", "2"]]


def test_attention_flag_picks_the_backend_and_the_json_records_it(tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--attention", "torch", "--modes", "eager", "--batches",
                                 "1", "--prefill", "", "--context", "4", "--repeats", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    env = json.loads(out.read_text())["env"]
    assert env["attention_option"] == "torch" and env["attention"] == _backend_name("torch") == TorchBackend.name
    assert f"{TorchBackend.name} attention" in result.output  # the table title names the backend


def test_moe_preset_in_fp8_is_benched_and_the_json_records_the_quantization(tmp_path, monkeypatch):
    loaded = []
    monkeypatch.setattr(bench_command, "load_model", lambda *a, **k: loaded.append(load_model(*a, **k)) or loaded[-1])
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--model", "tiny-moe", "--quant", "fp8", "--modes",
                                 "eager", "--batches", "2", "--prefill", "12", "--context", "4", "--repeats", "1",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["env"]["quant"] == "fp8" and "tiny-moe float32 fp8" in result.output
    kinds = {type(m).__name__ for m in loaded[0].modules()}
    assert {"MoEDecoder", "FP8Experts", "FP8Linear"} <= kinds and "Experts" not in kinds
    # ... and judged against the same weights unquantized: a second load, float (the same seeded weights)
    assert len(loaded) == 2 and "FP8Experts" not in {type(m).__name__ for m in loaded[1].modules()}
    fp8_expert = next(m for m in loaded[0].modules() if type(m).__name__ == "FP8Experts")
    float_expert = next(m for m in loaded[1].modules() if type(m).__name__ == "Experts")
    assert fp8_expert.num_experts == float_expert.gate_up_proj.shape[0]
    rows = json.loads(out.read_text())["rows"]
    assert all(r["rel_err"] == 0 and 0 < r["rel_err_float"] < 1 for r in rows)  # eager FP8 vs its float weights


@pytest.mark.parametrize("value", ["flashinfer", "nope"])
def test_an_attention_backend_that_cannot_run_here_names_the_flag(value, tmp_path):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--attention", value, "--json", str(out)])
    assert result.exit_code != 0 and "--attention" in result.output, result.output
    assert not out.exists()  # refused before any work


def test_modes_that_cannot_run_here_are_skipped_with_a_reason(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--modes", "eager,piecewise,meta-pcg,graph-partition",
                                 "--batches", "1", "--prefill", "8", "--context", "4", "--repeats", "1",
                                 "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    skipped = {r["mode"]: r["skipped"] for r in rows if "skipped" in r}
    assert set(skipped) == {"piecewise", "meta-pcg", "graph-partition"}
    assert "GPU" in skipped["piecewise"] and "GPU" in skipped["graph-partition"]
    assert all(r["ms"] is None for r in rows if "skipped" in r)
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_bad_sizes_and_profile_spec_name_their_option():
    for args, option in ((["--prefill", "16,x"], "--prefill"), (["--batches", "0"], "--batches"),
                         (["--profile", "piecewise"], "--profile"), (["--profile", "nope:1"], "--profile"),
                         (["--profile", "none:1,piecewise"], "--profile"),
                         (["--modes", "nope"], "--modes")):
        result = runner.invoke(app, ["bench", "--device", "cpu", *args])
        assert result.exit_code != 0 and option in result.output, result.output


def _logits_one_sequence_at_a_time(model, ids, lengths):
    """Each sequence alone on its own cache (no packing): the reference for the bench's teacher-forced logits."""
    out, start = [], 0
    for n in lengths:
        cache = KVCache.for_sequences(model.config, 1, n, page_size=4)
        meta = AttentionMetadata.for_batch(cache, [(0, 0, n)])
        with torch.no_grad(), forward_context(meta):
            out.append(model.logits(model(ids[start:start + n], meta.positions)).float())
        start += n
    return torch.cat(out)


def test_a_comma_list_of_quants_benches_each_model_once_into_one_result_with_accuracy(tmp_path, monkeypatch):
    """``--quant bf16,fp8``: one model per quant (no float twin), every row labelled with its quant, setup facts
    per mode and quant, and one accuracy row: the FP8 model's teacher-forced logits against the bf16 model's,
    checked against each sequence run alone."""
    from piecegraph.bench import accuracy as bench_accuracy
    from piecegraph.bench.plot import plot_result

    loaded = []
    monkeypatch.setattr(bench_command, "load_model",
                        lambda *a, **k: loaded.append((k.get("quant", "bf16"), load_model(*a, **k))) or loaded[-1][1])
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--model", "tiny-moe", "--quant", "fp8,bf16", "--modes",
                                 "eager", "--batches", "2", "--prefill", "12", "--context", "4", "--repeats", "1",
                                 "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert [q for q, _ in loaded] == ["bf16", "fp8"]  # bf16 first: its logits are the reference
    data = json.loads(out.read_text())
    assert data["env"]["quant"] == "bf16,fp8" and set(data["setup"]) == {"eager bf16", "eager fp8"}
    timed = [r for r in data["rows"] if r["phase"] != "accuracy"]
    assert sorted((r["quant"], r["phase"], r.get("batch", r.get("tokens"))) for r in timed) == sorted(
        (q, p, s) for q in ("bf16", "fp8") for p, s in (("decode", 2), ("prefill", 12)))
    assert all("rel_err_float" not in r and r["rel_err"] == 0 for r in timed)
    [acc] = [r for r in data["rows"] if r["phase"] == "accuracy"]
    assert acc["key"] == "accuracy" and acc["quant"] == "fp8" and acc["against"] == "bf16"
    # the reference: the same seeded tokens, each sequence alone, the two models the bench built
    lengths = [bench_accuracy.TOKENS // bench_accuracy.SEQS] * bench_accuracy.SEQS
    ids = torch.randint(0, loaded[0][1].config.vocab_size, (bench_accuracy.TOKENS,),
                        generator=torch.Generator().manual_seed(0))
    ref, fp8 = (_logits_one_sequence_at_a_time(model, ids, lengths) for _, model in loaded)
    assert acc["tokens"] == bench_accuracy.TOKENS >= 256
    assert acc["logits_rel_err"] == pytest.approx(((fp8 - ref).norm() / ref.norm()).item(), rel=1e-4)
    assert acc["top1_agreement"] == pytest.approx((fp8.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                                                  abs=2 / bench_accuracy.TOKENS)  # a near tie may flip
    assert 0 < acc["logits_rel_err"] < 1 and 0.5 < acc["top1_agreement"] < 1
    assert "accuracy fp8 vs bf16" in result.output and "eager fp8" in result.output
    plot_result(load_result(out), tmp_path / "r.png")  # the accuracy row is not a timed point
    bad = runner.invoke(app, ["bench", "--device", "cpu", "--quant", "bf16,int4"])
    assert bad.exit_code != 0 and "--quant" in bad.output and "int4" in bad.output


def test_a_profile_list_profiles_each_step(tmp_path):
    """``--profile A,B``: the first profile stays the result's ``profile``; ``profiles`` holds both, in order."""
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["bench", "--device", "cpu", "--modes", "none", "--batches", "1", "--prefill", "",
                                 "--context", "8", "--repeats", "1", "--json", str(out), "--profile", "none:1,eager:2"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [(p["mode"], p["batch"]) for p in data["profiles"]] == [("none", 1), ("eager", 2)]
    assert data["profile"] == data["profiles"][0]
    assert all(p["split_calls_per_step"] == TINY.num_layers for p in data["profiles"])  # each step profiled whole
