"""Tensor parallel on two GPUs (NCCL): TP=2 against TP=1 for the 0.5B shape in bf16, the all-reduce captured in
piecewise and full graphs (inside the pieces) and as a split op. Skips without two GPUs (``nvidia-h200-x2``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("tp_gpu_worker.py")
ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp_gpu")
    env = dict(os.environ, NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE", "0"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), str(WORKER.parent),
                                                        os.environ.get("PYTHONPATH")])))
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("variant", ["inside", "split"])
def test_tp2_equals_tp1_in_bf16_with_graphs(ranks, variant, record_result):
    record_result("tp_gpu.json", variant, ranks[0][variant])
    for entry in (r[variant] for r in ranks):
        assert entry["rel"] < 2e-2, entry["rel"]
        assert all(t["bf16_steps_apart"] <= 4 for t in entry["ties"]), entry["ties"]
        assert entry["kv_heads_per_rank"] == 1
        assert entry["prefill"]["fallbacks"] == 0 and entry["decode"]["replays"] >= 30, entry
    assert ranks[0][variant]["tokens"] == ranks[1][variant]["tokens"]
