#!/usr/bin/env bash
# The whole benchmark sweep on one CUDA GPU: Qwen2.5-0.5B shape, bf16, every mode, decode and prefill, plus a
# profile of piecewise at batch 1. Writes under OUTDIR: bench.log, bench.json, <date>_<gpu>_torch<ver>.json
# and .png (copy those two to benchmarks/results/), install.log; ends with a compact table.
# Usage: scripts/gpu_bench.sh OUTDIR
# Env overrides: MODES (auto = every mode), BATCHES, PREFILL, CONTEXT, REPEATS, PROFILE (MODE:BATCH or "none"),
# LIMIT_S (default 450: the sweep is stopped then, keeping every mode it finished, so the run fits 8 minutes).
# Meta's piecewise_cuda_graphs (mode meta-pcg) is used when importable, or installed from .whl/ when its wheel
# is there (GPU machines may be offline): pip download piecewise-cuda-graphs --no-deps -d .whl
set -uo pipefail
OUT=${1:?usage: scripts/gpu_bench.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

shopt -s nullglob
wheels=(.whl/piecewise_cuda_graphs-*.whl)
if [ ${#wheels[@]} -gt 0 ] && ! python3 -c "import piecewise_cuda_graphs" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pg-bench-site "${wheels[@]}" >"$OUT/install.log" 2>&1 \
    && export PYTHONPATH=/tmp/pg-bench-site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 || export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1

PROFILE=${PROFILE:-piecewise:1}
profile_args=()
[ "$PROFILE" != "none" ] && profile_args=(--profile "$PROFILE")
RAW="$OUT/bench.json"
# SIGINT, not TERM: Python unwinds, and bench.json already holds every finished mode (written after each).
timeout --signal=INT --kill-after=30 "${LIMIT_S:-450}" \
  python3 -m piecegraph.cli bench --device cuda --model qwen2.5-0.5b --modes "${MODES:-auto}" \
    --batches "${BATCHES:-1,10,256,1024}" --prefill "${PREFILL:-16,128,512,2048}" --context "${CONTEXT:-256}" \
    --repeats "${REPEATS:-20}" ${profile_args[@]+"${profile_args[@]}"} --json "$RAW" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
status=${PIPESTATUS[0]}
[ "$status" = 124 ] && echo "sweep stopped at LIMIT_S=${LIMIT_S:-450} s: bench.json holds the modes it finished"

if [ -f "$RAW" ]; then
  NAME=$(python3 -m piecegraph.bench.report "$RAW" --name)
  cp "$RAW" "$OUT/$NAME.json"
  echo
  echo "== $OUT/$NAME.json and .png (commit both under benchmarks/results/)"
  python3 -m piecegraph.bench.report "$RAW" --plot "$OUT/$NAME.png"
else
  echo "no results were written: see $OUT/bench.log"
  status=1
fi
exit "$status"
