#!/usr/bin/env bash
# Run on a CUDA machine: the GPU-marked tests, then the decode benchmark. Logs and JSON go under OUTDIR.
# Usage: scripts/gpu_check.sh OUTDIR  (PARTS="tests bench" by default; BATCHES, MODES override the bench)
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIECEGRAPH_OUT="$OUT"
PARTS=${PARTS:-"tests bench"}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pg-site .whl/*.whl && export PYTHONPATH=/tmp/pg-site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
status=0
if [[ " $PARTS " == *" tests "* ]]; then
  python3 -m pytest tests/gpu -m gpu -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [[ " $PARTS " == *" bench "* ]]; then
  python3 -m piecegraph.cli bench --model qwen2.5-0.5b --batches "${BATCHES:-1,10,256,1024}" \
    --modes "${MODES:-eager,full,full-compiled,piecewise,reduce-overhead}" --json "$OUT/bench_decode.json" 2>&1 | tee "$OUT/bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
