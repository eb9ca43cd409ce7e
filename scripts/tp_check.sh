#!/usr/bin/env bash
# Tensor parallel on one multi-GPU host, in one call: the TP GPU tests (NCCL), then `bench` and `serve-bench` of each
# model at world size 1 and TP, so the scaling comes from one run on one machine, and one profiled decode step per
# world size (the all-reduce's share of it). Result files: <date>_<gpu>_tp<W>_<model>_{bench,serve}.json under OUTDIR.
# Usage: [TP=2] [TP_MODELS="qwen2.5-0.5b qwen1.5-moe-a2.7b"] scripts/tp_check.sh OUTDIR
# TP=1 on a single GPU checks the script itself (world size 1 only, the TP tests skip); DEVICE=cpu runs the same flow
# on this machine's CPU with gloo (TP_MODELS=tiny: what the CPU tests run). Also: ATTENTION (default flashinfer on
# GPUs, torch on CPU), INSTALL=0 (no installs), MODES (bench, default every mode), SERVE_MODES (default serve-bench's
# modes), CONCURRENCY (default 1,10,256,1024), BATCHES, PREFILL, CONTEXT (the bench's cached tokens per sequence,
# default 64: at 256, batch 1024 of the MoE preset needs ~52 GB of KV cache beside its 28 GB of bf16 weights, more
# than one 80 GB card holds at world size 1).
set -uo pipefail
OUT=${1:?usage: scripts/tp_check.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIECEGRAPH_OUT="$OUT" NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off
TP=${TP:-2}
DEVICE=${DEVICE:-cuda}
# FlashInfer on GPUs, as every other GPU part: named, so a machine without it fails here instead of benching torch's
ATTENTION=${ATTENTION:-$([ "$DEVICE" = cuda ] && echo flashinfer || echo torch)}
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())") || exit 1
if [ "$DEVICE" = cuda ] && [ "$gpus" -lt "$TP" ]; then
  echo "tp_check.sh: TP=$TP needs $TP GPUs, this machine has $gpus" >&2
  exit 2
fi
if [ "${INSTALL:-1}" = 1 ]; then  # INSTALL=0: use what is installed (the CPU test of this script)
  shopt -s nullglob
  wheels=(.whl/*.whl)
  SITE=${PIECEGRAPH_CHECK_SITE:-$HOME/.cache/piecegraph-check/site}
  if [ ${#wheels[@]} -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "${wheels[@]}" \
      >"$OUT/install.log" 2>&1 && export PYTHONPATH=$SITE:${PYTHONPATH:-}
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 \
    || export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
PREFIX=$(python3 -c "from piecegraph.results.schema import environment, result_name
print(result_name(environment(attention=None, model=None, dtype=None, quant=None), 'x')[:-len('_x.json')])") || exit 1
status=0
ok() { [ "${1:-1}" = 0 ] || status=1; }

if [ "$DEVICE" = cuda ]; then
  python3 -m pytest tests/gpu/test_tp_gpu.py -m gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/tp_tests.log"
  ok "${PIPESTATUS[0]}"
fi
sizes=1
[ "$TP" -gt 1 ] && sizes="1 $TP"
for model in ${TP_MODELS:-qwen2.5-0.5b qwen1.5-moe-a2.7b}; do
  for tp in $sizes; do
    echo "== $model, world size $tp" | tee -a "$OUT/tp_bench.log" "$OUT/tp_serve.log"
    python3 -m piecegraph.cli bench --model "$model" --tp "$tp" --device "$DEVICE" --attention "$ATTENTION" \
      --modes "${MODES:-all}" --batches "${BATCHES:-1,10,256,1024}" --prefill "${PREFILL:-128,2048}" \
      --context "${CONTEXT:-64}" --profile full:1 \
      --json "$OUT/${PREFIX}_tp${tp}_${model}_bench.json" >>"$OUT/tp_bench.log" 2>&1
    ok $?
    python3 -m piecegraph.cli serve-bench --model "$model" --tp "$tp" --device "$DEVICE" --attention "$ATTENTION" \
      ${SERVE_MODES:+--modes "$SERVE_MODES"} \
      --concurrency "${CONCURRENCY:-1,10,256,1024}" \
      --json "$OUT/${PREFIX}_tp${tp}_${model}_serve.json" >>"$OUT/tp_serve.log" 2>&1
    ok $?
  done
done
# world size 1 against TP, per model, from the files just written
for model in ${TP_MODELS:-qwen2.5-0.5b qwen1.5-moe-a2.7b}; do
  for what in bench serve; do
    one="$OUT/${PREFIX}_tp1_${model}_${what}.json"
    many="$OUT/${PREFIX}_tp${TP}_${model}_${what}.json"
    [ "$TP" -gt 1 ] && [ -f "$one" ] && [ -f "$many" ] && python3 -m piecegraph.cli report "$one" "$many"
  done
done 2>&1 | tee "$OUT/tp_scaling.log"
exit $status
