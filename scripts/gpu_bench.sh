#!/usr/bin/env bash
# The whole benchmark sweep on one CUDA GPU, once per attention backend: Qwen2.5-0.5B shape, bf16, every mode,
# decode and prefill, the attention op's CPU cost, and a profile of piecewise at batch 1. Writes under OUTDIR,
# per backend B of ATTENTIONS: bench-B.log, bench-B.json, <date>_<gpu>_torch<ver>_<resolved backend>.json and
# .png (copy those two to benchmarks/results/); plus install.log and gpu.txt. Each run ends with a compact table.
# Usage: scripts/gpu_bench.sh OUTDIR
# Env overrides: ATTENTIONS (default "flashinfer torch": one sweep each), ATTENTION (auto | torch | flashinfer:
# a single sweep with that --attention; ignored when ATTENTIONS is set), MODES (auto = every mode), BATCHES,
# PREFILL, CONTEXT, REPEATS, PROFILE (MODE:BATCH or "none"), LIMIT_S (default 450: the budget of the whole
# script, split evenly between the sweeps still to run, so a sweep that ends early, e.g. FlashInfer missing,
# leaves its time to the next; a sweep that reaches its share is stopped keeping every mode it finished).
# Meta's piecewise_cuda_graphs (mode meta-pcg) is used when importable, or installed from .whl/ when its wheel
# is there (GPU machines may be offline): pip download piecewise-cuda-graphs --no-deps -d .whl
set -uo pipefail
OUT=${1:?usage: scripts/gpu_bench.sh OUTDIR}
LIMIT_S=${LIMIT_S:-450}
deadline=$(( $(date +%s) + LIMIT_S ))  # from the start: installing counts against the budget too
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
read -r -a backends <<<"${ATTENTIONS:-${ATTENTION:-flashinfer torch}}"
GRACE=15   # SIGKILL this long after SIGINT, inside the run's share
REPORT=10  # the report and plot after a sweep, inside the run's share
status=0

for i in "${!backends[@]}"; do
  attention=${backends[$i]}
  share=$(( (deadline - $(date +%s)) / (${#backends[@]} - i) ))
  limit=$(( share - GRACE - REPORT ))
  echo "== --attention $attention: ${limit} s of LIMIT_S=$LIMIT_S"
  if [ "$limit" -lt 30 ]; then
    echo "skipped: too little of LIMIT_S left"
    status=1
    continue
  fi
  RAW="$OUT/bench-$attention.json"
  rm -f "$RAW"
  # SIGINT, not TERM: Python unwinds, and the JSON already holds every finished mode (written after each).
  timeout --signal=INT --kill-after=$GRACE "$limit" \
    python3 -m piecegraph.cli bench --device cuda --model qwen2.5-0.5b --attention "$attention" \
      --modes "${MODES:-auto}" --batches "${BATCHES:-1,10,256,1024}" --prefill "${PREFILL:-16,128,512,2048}" \
      --context "${CONTEXT:-256}" --repeats "${REPEATS:-20}" ${profile_args[@]+"${profile_args[@]}"} \
      --json "$RAW" --plot "$OUT/bench-$attention.png" 2>&1 | tee "$OUT/bench-$attention.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "sweep stopped at its ${limit} s share: $RAW holds the modes it finished"
  if [ -f "$RAW" ]; then
    NAME=$(python3 -m piecegraph.bench.report "$RAW" --name)
    cp "$RAW" "$OUT/$NAME.json"
    echo
    echo "== $OUT/$NAME.json and .png (commit both under benchmarks/results/)"
    python3 -m piecegraph.bench.report "$RAW" --plot "$OUT/$NAME.png"
  else
    echo "no results were written for --attention $attention: see $OUT/bench-$attention.log"
    [ "$rc" = 0 ] && rc=1
  fi
  [ "$status" = 0 ] && status=$rc
done
exit "$status"
