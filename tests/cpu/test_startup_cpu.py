"""The start-up script (scripts/startup.py) as a dry run on CPU, in fresh processes: a warm start of its
``modules`` kind loads both modules' traced programs (no Dynamo) and hits every torch cache it compiles through
(Inductor's FX graph cache and AOTAutograd's: a first warm start used to miss the latter, whose key hashed the order
of the piece module's attributes, which differs between a piece built under Dynamo and one built from the restored
graph), and computes the same bits as the cold start; its start-up report accounts for the setup's seconds. Its
``engine`` kind (the engine a server runs) likewise, against eager greedy decoding."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _start(cache_dir: Path, kind: str = "modules", **variables: str) -> dict:
    env = dict(os.environ, PIECEGRAPH_START_DEVICE="cpu", PIECEGRAPH_START_MODEL="tiny", OMP_NUM_THREADS="1",
               PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **variables)
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "startup.py"), kind, str(cache_dir)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_warm_start_loads_its_programs_and_hits_every_torch_cache(tmp_path):
    cold, warm = _start(tmp_path), _start(tmp_path)
    assert [s["trace"] for s in cold["startup"].values()] == ["traced", "traced"]
    assert [s["trace"] for s in warm["startup"].values()] == ["loaded", "loaded"]
    caches = warm["torch_caches"]
    assert caches.get("autograd_cache_hit", 0) > 0 and not caches.get("autograd_cache_miss"), caches
    assert caches.get("fxgraph_cache_hit", 0) > 0 and not caches.get("fxgraph_cache_miss"), caches
    assert warm["out_head"] == cold["out_head"]
    # The report accounts for the setup: its stages (the compiler stack's import, paid once per process by the
    # first module, the cache's load, prewarm, trace, compile) sum to the setup within half a second and a tenth.
    for start in (cold, warm):
        first = start["startup"]["prefill"]
        assert first["compiler_import_s"] > 0 and start["startup"]["decode"]["compiler_import_s"] < 0.05
        parts = sum(first[k] for k in ("compiler_import_s", "cache_load_s", "prewarm_s", "trace_s", "compile_s"))
        assert parts <= first["setup_s"] <= parts + 0.5 + 0.1 * first["setup_s"], first


def test_an_engine_starts_cold_on_one_shared_trace_then_warm_from_its_entries_with_eager_tokens(tmp_path):
    import torch

    from piecegraph.models import TINY, Decoder, generate

    # By pieces, as the GPU's defaults compile it cold ("auto" does so only where packages are made: not on CPU)
    cold, warm = (_start(tmp_path, "engine", PIECEGRAPH_START_FULL_COMPILE="pieces") for _ in range(2))
    assert {k: m["startup"]["trace"] for k, m in cold["modules"].items()} == {"piecewise": "traced", "full": "shared"}
    assert {k: m["startup"]["trace"] for k, m in warm["modules"].items()} == {"piecewise": "loaded", "full": "loaded"}
    assert all(m["startup"]["cache"] == "warm" for m in warm["modules"].values())
    # The full module compiles by pieces and takes the piecewise module's (trace/handover.py), cold and warm
    assert cold["modules"]["full"]["startup"]["pieces"] == warm["modules"]["full"]["startup"]["pieces"] == "shared"
    # torch's own timers (trace/compile_clock.py): the cold piecewise module ran Inductor's compile, inside its
    # setup; the full module that took its pieces, and every warm module, compiled nothing
    regions = {(start, k): m["startup"]["compile_regions"] for start, run in (("cold", cold), ("warm", warm))
               for k, m in run["modules"].items()}
    piecewise = cold["modules"]["piecewise"]["startup"]
    assert 0 < regions["cold", "piecewise"]["compile_fx_inner"] <= piecewise["setup_s"], regions
    assert all("compile_fx_inner" not in r for key, r in regions.items() if key != ("cold", "piecewise")), regions
    model = Decoder.random(TINY, dtype=torch.float32)
    prompts = [[(7 * i + j) % TINY.vocab_size for j in range(5 + 3 * i)] for i in range(4)]
    want = generate(model, prompts, len(cold["tokens"][0]))
    assert cold["tokens"] == want and warm["tokens"] == want
    assert warm["ready_s"] < cold["ready_s"]
