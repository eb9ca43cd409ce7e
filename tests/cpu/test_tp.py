"""Tensor parallel on CPU: two gloo processes (started here, torchrun-style env) against TP=1, float32.

The ranks run ``tests/cpu/tp_worker.py``. For the reference decoder (TINY: 4 q / 2 kv heads, tied; and a 1-kv-head,
untied, odd-vocabulary variant) and tiny Hugging Face Llama and Qwen2 models (``HFDecoder``): the prefill logits of
a packed batch of 3 prompts (15 tokens, padded to 16) and 8 greedy tokens, plain sharded, in ``mode="none"``,
emulated piecewise graphs and emulated full decode graphs, with the all-reduce inside the pieces and as a split op.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from piecegraph.parallel import ALL_REDUCE, ALL_REDUCE_INPLACE, get_group, register_group
from piecegraph.parallel.tp import _bounds

WORKER = Path(__file__).with_name("tp_worker.py")
ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
CONFIGS = ("tiny", "mqa_untied")
VARIANTS = ("eager", "none_inside", "none_split", "piecewise_inside", "piecewise_split", "full_decode_inside",
            "full_decode_split")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of the 2 ranks wrote (one JSON dict per rank)."""
    out = tmp_path_factory.mktemp("tp")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out / f"rank{r}.json")],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{logs[r][-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


HF_VARIANTS = ("eager", "none_inside", "none_split", "piecewise_inside", "piecewise_split", "full_decode_split")
try:
    import transformers  # noqa: F401
    HAS_TRANSFORMERS = True
except ImportError:
    HAS_TRANSFORMERS = False
CASES = [(c, v) for c in CONFIGS for v in VARIANTS] + [
    pytest.param(f"hf_{arch}", v, marks=pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers"))
    for arch in ("llama", "qwen2") for v in HF_VARIANTS]


@pytest.mark.parametrize(("config", "variant"), CASES)
def test_tp2_equals_tp1(ranks, config, variant):
    """Reference decoder configs, and tiny Hugging Face Llama (o_proj bias, untied) and Qwen2 (1 kv head, tied)."""
    for r, results in enumerate(ranks):
        entry = results[f"{config}/{variant}"]
        assert entry["rel"] < 1e-5, (r, entry)
        assert entry["tokens_equal"], (r, entry["tokens"], entry["ref_tokens"])
        assert entry["kv_heads_per_rank"] == entry["cache_kv_heads"] == 1  # the paged cache is per rank
        if variant == "eager":
            continue
        prefill = entry["prefill"]
        split = variant.endswith("_split")
        # attention per layer, plus (as split ops) o_proj's and down_proj's all-reduce per layer and the embedding's
        assert prefill["split_ops"] == (7 if split else 2) and prefill["fallbacks"] == 0, entry
        if variant.startswith("piecewise"):
            assert prefill["sizes"] == [4, 16] and prefill["replays"] >= 7, entry  # padded prefill and decode
        if variant.startswith("full_decode"):
            assert entry["decode"]["sizes"] == [4] and entry["decode"]["replays"] >= 6, entry
    assert ranks[0][f"{config}/{variant}"]["tokens"] == ranks[1][f"{config}/{variant}"]["tokens"]


def test_the_serving_engine_on_tp2_gives_the_tp1_tokens(ranks):
    """Continuous batching with chunked prefill and preemption (7 pages of 4 tokens for 3 requests) on both
    ranks in lockstep: each request's tokens equal TP=1 greedy decoding, on both ranks."""
    for r, results in enumerate(ranks):
        entry = results["tiny/engine_auto"]
        assert entry["tokens_equal"], (r, entry["tokens"], entry["ref_tokens"])
        assert entry["by_kind"].get("full", 0) > 0 and entry["by_kind"].get("piecewise", 0) > 0, entry
        assert entry["preemptions"] > 0, entry


def test_apply_tp_refuses_heads_that_do_not_divide(ranks):
    for results in ranks:
        assert "num_heads (3) must divide by the world size 2" in results["refuses_odd_heads"]


def test_vocab_bounds_cover_the_vocabulary_evenly():
    for n, world in ((256, 2), (257, 2), (10, 4), (3, 3)):
        bounds = [_bounds(n, r, world) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


def test_all_reduce_ops_have_fakes():
    with FakeTensorMode():
        x = torch.empty(5, 8)
        y = torch.ops.piecegraph_tp.all_reduce(x, "any")
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.ops.piecegraph_tp.all_reduce_(x, "any") is None
    assert ALL_REDUCE == "piecegraph_tp::all_reduce" and ALL_REDUCE_INPLACE == "piecegraph_tp::all_reduce_"


def test_group_registry_errors_say_what_to_do():
    with pytest.raises(KeyError, match="register_group"):
        get_group("never-registered")
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            register_group("tp")


def _cli(tmp_path, *args) -> tuple[str, dict]:
    """``python -m piecegraph.cli ARGS --tp 2 --json F`` (it starts torchrun itself); its output and the JSON."""
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "piecegraph.cli", *args, "--tp", "2", "--device", "cpu",
                           "--model", "tiny", "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, json.loads(out.read_text())


def test_bench_tp2_runs_as_two_ranks_and_rank0_reports(tmp_path):
    stdout, data = _cli(tmp_path, "bench", "--modes", "eager,none", "--batches", "1,4", "--prefill", "12",
                        "--repeats", "2")
    assert data["env"]["world_size"] == 2 and data["env"]["tp_backend"] == "gloo"
    rows = {(r["mode"], r["phase"], r.get("batch") or r.get("tokens")): r for r in data["rows"]}
    assert set(rows) == {(m, p, n) for m in ("eager", "none") for p, n in (("decode", 1), ("decode", 4),
                                                                           ("prefill", 12))}
    assert all(r["rel_err"] < 1e-5 for r in rows.values()), rows  # compiled TP against eager TP
    assert stdout.count("wrote ") == 1  # rank 0 alone reports


def test_serve_bench_tp2_runs_as_two_ranks_and_rank0_reports(tmp_path):
    stdout, data = _cli(tmp_path, "serve-bench", "--modes", "auto", "--concurrency", "2", "--requests", "3",
                        "--warmup", "0", "--no-reference")
    assert data["env"]["world_size"] == 2 and data["env"]["tp_backend"] == "gloo"
    (setup,) = data["setup"].values()
    assert setup.get("error") is None, setup
    assert [(r["mode"], r["requests"]) for r in data["rows"]] == [("auto", 3)]
    assert stdout.count("wrote ") == 1


def test_tp_refuses_a_torchrun_world_of_another_size(monkeypatch):
    from piecegraph.parallel.launch import needs_relaunch

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="--tp 2 but torchrun started 4 processes"):
        needs_relaunch(2)
    monkeypatch.delenv("WORLD_SIZE")
    assert needs_relaunch(2) and not needs_relaunch(1)


def test_bench_tp_refuses_modes_it_does_not_run_before_starting_ranks():
    from typer.testing import CliRunner

    from piecegraph.cli import app

    result = CliRunner().invoke(app, ["bench", "--tp", "2", "--device", "cpu", "--modes", "eager,torch.compile"])
    assert result.exit_code == 2 and "--tp 2 runs the modes" in result.output and "torch.compile" in result.output
