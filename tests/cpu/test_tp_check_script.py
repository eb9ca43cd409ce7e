"""scripts/tp_check.sh, the one call that runs tensor parallelism's GPU work, run end to end on this CPU (gloo):
world sizes 1 and 2 of the tiny model, their result files and the scaling report between them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tp_check_runs_both_world_sizes_and_reports_their_scaling(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "TP": "2", "INSTALL": "0", "TP_MODELS": "tiny", "MODES": "eager",
           "SERVE_MODES": "eager,auto", "BATCHES": "1,4", "PREFILL": "16", "CONTEXT": "8", "CONCURRENCY": "1,4",
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(ROOT / "scripts/tp_check.sh"), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for what, key in (("bench", ("mode", "batch", "tokens")), ("serve", ("mode", "concurrency"))):
        results = {}
        for world in (1, 2):
            [path] = tmp_path.glob(f"*_tp{world}_tiny_{what}.json")
            result = json.loads(path.read_text())
            assert result["env"]["world_size"] == world and result["env"]["model"] == "tiny"
            results[world] = {tuple(row.get(k) for k in key) for row in result["rows"]}
        assert results[1] == results[2] and results[1], f"{what}: the two world sizes ran other rows"
    scaling = (tmp_path / "tp_scaling.log").read_text()
    # one report per kind of run, each naming both files, with the ratio column
    assert scaling.count("tp1_tiny_bench.json") == 1 and scaling.count("tp2_tiny_bench.json") == 1
    assert scaling.count("tp1_tiny_serve.json") == 1 and "output_tok_s B/A" in scaling
