#!/usr/bin/env bash
# The benchmark sweep on one CUDA GPU, once per attention backend: the 0.5B shape in bf16, every mode, decode and
# prefill, the attention op's host cost, and a profile of piecewise at batch 1. gpu_check.sh's "bench" part.
# Usage: scripts/gpu_bench.sh OUTDIR. Writes, per backend B: <date>_<gpu>_bench_B.json and .png, bench-B.log.
# Variables: ATTENTIONS (default "flashinfer torch"), MODES (default auto: every mode), BATCHES, PREFILL, CONTEXT,
# REPEATS, PROFILE (MODE:BATCH or none), LIMIT_S (default 450: the whole script's seconds, shared evenly by the
# sweeps still to run; a sweep stopped at its share keeps every mode it finished). Meta's piecewise_cuda_graphs
# (mode meta-pcg) is installed from .whl/ when its wheel is there. docs/gpu-check.md has more.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_bench.sh OUTDIR}
LIMIT_S=${LIMIT_S:-450}
deadline=$(( $(date +%s) + LIMIT_S ))  # from the start: installing counts against the budget too
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d -t pg-bench.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

shopt -s nullglob
wheels=(.whl/piecewise_cuda_graphs-*.whl)
if [ ${#wheels[@]} -gt 0 ] && ! python3 -c "import piecewise_cuda_graphs" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$WORK/site" "${wheels[@]}" >>"$OUT/install.log" 2>&1 \
    && export PYTHONPATH=$WORK/site:${PYTHONPATH:-}
fi
python3 -c "import piecegraph" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . \
  >>"$OUT/install.log" 2>&1 || export PYTHONPATH=$PWD:${PYTHONPATH:-}
[ -f "$OUT/gpu.txt" ] || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
# <date>_<gpu>: how the result files' names start (the result schema's result_name)
PREFIX=$(python3 -c "from piecegraph.results.schema import environment, result_name
print(result_name(environment(attention=None, model=None, dtype=None, quant=None), 'x')[:-len('_x.json')])") || exit 1

PROFILE=${PROFILE:-piecewise:1}
profile_args=()
[ "$PROFILE" != "none" ] && profile_args=(--profile "$PROFILE")
read -r -a backends <<<"${ATTENTIONS:-${ATTENTION:-flashinfer torch}}"
GRACE=15   # SIGKILL this long after SIGINT, inside the run's share
REPORT=10  # the closing table after a sweep, inside the run's share
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
  RAW="$OUT/${PREFIX}_bench_$attention.json"
  rm -f "$RAW"
  # SIGINT, not TERM: Python unwinds, and the JSON already holds every finished mode (written after each).
  timeout --signal=INT --kill-after=$GRACE "$limit" \
    python3 -m piecegraph.cli bench --device cuda --model qwen2.5-0.5b --attention "$attention" \
      --modes "${MODES:-auto}" --batches "${BATCHES:-1,10,256,1024}" --prefill "${PREFILL:-16,128,512,2048}" \
      --context "${CONTEXT:-256}" --repeats "${REPEATS:-20}" ${profile_args[@]+"${profile_args[@]}"} \
      --json "$RAW" --plot "${RAW%.json}.png" 2>&1 | tee "$OUT/bench-$attention.log"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "sweep stopped at its ${limit} s share: $RAW holds the modes it finished"
  if [ -f "$RAW" ]; then
    echo
    echo "== $RAW and .png"
    python3 -m piecegraph.bench.report "$RAW" || true  # the compact table
  else
    echo "no results were written for --attention $attention: see $OUT/bench-$attention.log"
    [ "$rc" = 0 ] && rc=1
  fi
  [ "$status" = 0 ] && status=$rc
done
exit "$status"
