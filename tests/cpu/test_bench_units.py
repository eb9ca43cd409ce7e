"""The bench's parts that need no sweep: a row's JSON, the rich table's loop columns, the result's file stem, the
report module the GPU scripts call, the profiler's step timeline, the HBM floor's weight bytes (FP8 buffers, only
the experts routing reaches) and the decode batches whose KV cache fits."""

import pytest
import torch
from bench_helpers import PNG_SIGNATURE

from piecegraph.attention.backends.torch_sdpa import TorchBackend
from piecegraph.bench.harness import Row
from piecegraph.bench.report import result_stem, rich_table


def test_row_json_names_the_size_by_phase():
    assert Row("eager", "decode", 4, ms=1.0).to_json()["batch"] == 4
    prefill = Row("full", "prefill", 64, skipped="why").to_json()
    assert prefill["tokens"] == 64 and prefill["skipped"] == "why" and "batch" not in prefill
    assert "skipped" not in Row("eager", "decode", 1).to_json()


def test_rich_table_shows_loop_columns_only_when_a_row_has_loop_ms():
    decode = Row("none", "decode", 2, ms=2.0, tok_s=1e3, hbm_frac=0.4, loop_ms=1.6, loop_hbm_frac=0.5)
    prefill = Row("none", "prefill", 16, ms=3.0, tok_s=5e3, hbm_frac=0.2)

    def headers(rows):
        return [c.header for c in rich_table(rows, "t").columns]

    with_loop = headers([decode, prefill])
    assert with_loop[with_loop.index("HBM floor") + 1:][:2] == ["loop ms", "loop HBM"]
    assert not {"loop ms", "loop HBM"} & set(headers([prefill]))
    cells = {c.header: list(c.cells) for c in rich_table([decode, prefill], "t").columns}
    assert cells["loop ms"] == ["1.600", "-"] and cells["loop HBM"] == ["50.0%", "-"]


def test_result_stem_names_the_date_gpu_and_attention_backend():
    env = {"date": "2026-01-02", "gpu": "NVIDIA H200", "torch": "2.13.0+cu130", "flashinfer": None,
           "attention": TorchBackend.name, "model": "qwen2.5-0.5b", "dtype": "bfloat16", "quant": "bf16",
           "world_size": 1, "commit": None}
    data = {"benchmark": "bench", "env": env, "rows": []}
    assert result_stem(data) == f"2026-01-02_h200_bench_modes_{TorchBackend.name}"  # scripts add .json and .png
    fp8 = {**data, "env": {**env, "model": "tiny-moe", "quant": "fp8", "world_size": 2}}
    assert result_stem(fp8) == f"2026-01-02_h200_bench_modes_tiny-moe_{TorchBackend.name}_fp8_tp2"


def test_report_module_keeps_name_and_plot_for_scripts(tmp_path, capsys):
    """``python -m piecegraph.bench.report FILE --name | --plot``: what the GPU scripts call on a saved sweep."""
    from piecegraph.bench.report import main, payload
    from piecegraph.results.schema import environment, write_result

    env = environment(attention="torch", model="tiny", dtype="float32", quant="bf16", gpu="cpu", context=4)
    rows = [Row(m, "decode", b, ms=ms, tok_s=b / ms * 1e3) for m, ms in (("eager", 2.0), ("none", 1.0))
            for b in (1, 2)]
    path = tmp_path / "raw.json"
    write_result(path, **payload(env, rows, {"eager": {"setup_s": 0.1, "pool_mib": None}}))
    main([str(path), "--name"])
    assert capsys.readouterr().out.strip() == f"{env['date']}_cpu_bench_modes_tiny_torch"
    main([str(path), "--plot", str(tmp_path / "p.png")])
    assert "ms per step, median" in capsys.readouterr().out
    assert (tmp_path / "p.png").read_bytes().startswith(PNG_SIGNATURE)


def test_weight_bytes_read_counts_fp8_weight_buffers_and_only_the_experts_routing_reaches():
    """The bench's floor (and moe_step_profile's) counts what a forward must read: an FP8 model's weights are
    buffers (once left out: its floor was the norms and the bf16 router alone), and a mixture of experts reads
    only the experts top-k routing can reach. Reference: bytes counted by hand from the config."""
    from piecegraph.models import TINY_MOE, MoEDecoder, quantize_fp8

    c = TINY_MOE
    expert = 3 * c.hidden_size * c.expert_width  # gate, up and down of one expert: numbers of weights
    for quant, item, scales in (("float32", 4, 0), ("fp8", 1, 2 * 4)):  # FP8: a float32 scale per expert matrix
        model = MoEDecoder.random(c, seed=0).eval()
        if quant == "fp8":
            model = quantize_fp8(model, kernel="torch")
        facts = model.facts()
        everything = facts.weight_bytes_read(c.num_experts)  # enough rows to reach every expert
        one_row = facts.weight_bytes_read(1)  # top_k experts a layer
        row = c.hidden_size * model.model.embed_tokens.weight.element_size()
        unread = c.num_layers * (c.num_experts - c.top_k) * (expert * item + scales)
        assert everything - one_row == unread + (c.num_experts - 1) * row, quant
        assert everything > c.num_layers * c.num_experts * expert * item, quant  # all experts, the rest on top


def test_decode_batches_whose_kv_cache_cannot_fit_are_skipped_with_the_reason(monkeypatch):
    """On a GPU the decode cache is one allocation for the largest batch: batches whose cache would not fit 70% of
    the free memory are left out largest first, each with its reason (a row per mode), instead of every row
    failing on an out-of-memory error; none fitting is refused naming --batches."""
    from types import SimpleNamespace

    from piecegraph.bench.sweep import fitting_batches

    per_token = 1000
    facts = SimpleNamespace(device=torch.device("cuda", 0), config=object(), kv_bytes_per_token=lambda: per_token)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 264 * per_token, 10**12))
    lines = []
    kept, dropped = fitting_batches(facts, [1, 10, 256, 1024], 256, lines.append)  # 70 sequences of 264 fit
    assert kept == [1, 10] and [b for b, _ in dropped] == [1024, 256]
    assert "does not fit" in dropped[0][1] and "--context" in dropped[0][1] and len(lines) == 2
    with pytest.raises(ValueError, match="--batches"):
        fitting_batches(facts, [256], 256, lines.append)
    cpu = SimpleNamespace(device=torch.device("cpu"), config=object(), kv_bytes_per_token=lambda: per_token)
    assert fitting_batches(cpu, [4096], 10**6, lines.append) == ([4096], [])


def test_step_timeline_orders_the_last_steps_kernels_and_sums_their_gaps_by_kind():
    """A profile of two steps of three kernels each: the timeline is the second step's, in start order, each
    kernel's gap after the previous one; GEMM, attention and other time add up per kind."""
    from types import SimpleNamespace

    from piecegraph.bench.profile import is_gemm_kernel, step_timeline

    def kernel(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    step = [("nvjet_sm90_tst_64x8", 0.0, 10.0), ("BatchPrefillWithPagedKVCacheKernel", 12.0, 15.0),
            ("triton_poi_fused_add_0", 16.5, 17.0)]
    kernels = [kernel(n, s + 100 * i, e + 100 * i) for i in (1, 0) for n, s, e in step]  # out of order on purpose
    timeline = step_timeline(kernels, 3)
    assert [row[0] for row in timeline["rows"]] == [n for n, _, _ in step]
    assert [row[2] for row in timeline["rows"]] == [0.0, 2.0, 1.5]
    assert timeline["kernels"] == 3 and timeline["span_us"] == 17.0 and timeline["gaps_us"] == 3.5
    assert timeline["us_by_kind"] == {"gemm": 10.0, "attention": 3.0, "other": 0.5}
    assert is_gemm_kernel("void cutlass::Kernel2<x>") and not is_gemm_kernel("triton_red_fused_mean_1")
    assert step_timeline(kernels, 0) == {}
