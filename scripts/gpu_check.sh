#!/usr/bin/env bash
# Run on a CUDA machine: the GPU-marked tests, the opaque-op overhead, the doctor on a FlashInfer model, then the
# benchmark sweep (scripts/gpu_bench.sh). Logs and JSON go under OUTDIR.
# Usage: scripts/gpu_check.sh OUTDIR   (PARTS="tests overhead doctor bench" by default: pick a subset to split
# the work over several calls). Wheels under .whl/ (FlashInfer, apache-tvm-ffi, piecewise-cuda-graphs) are
# installed first, for machines without network access.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIECEGRAPH_OUT="$OUT"
PARTS=${PARTS:-"tests overhead doctor bench"}
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pg-site "${wheels[@]}" >/tmp/pg-install.log 2>&1 \
    && export PYTHONPATH=/tmp/pg-site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >>/tmp/pg-install.log 2>&1 || export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
status=0
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has tests; then
  python3 -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider 2>&1 | grep -v "^DEBUG" | tee "$OUT/gpu_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has overhead; then
  python3 scripts/opaque_overhead.py 2>&1 | tee "$OUT/opaque_overhead.json"
fi
if has doctor && [ -f scripts/doctor_flashinfer.py ]; then
  python3 -m piecegraph.cli doctor scripts/doctor_flashinfer.py:target --device cuda --json "$OUT/doctor_before.json" 2>&1 | tee "$OUT/doctor.log"
  python3 -m piecegraph.cli doctor scripts/doctor_flashinfer.py:target --device cuda --fix --json "$OUT/doctor_after.json" 2>&1 | tee -a "$OUT/doctor.log"
fi
if has bench; then
  bash scripts/gpu_bench.sh "$OUT" || status=1
fi
exit $status
