#!/usr/bin/env bash
# The GPU check: installs the wheels under .whl/, then runs the parts PARTS names and writes their logs and result
# files (<date>_<gpu>_<what>.json) under OUTDIR. docs/gpu-check.md describes each part and its variables.
# Usage: [PARTS="..."] scripts/gpu_check.sh OUTDIR          (PARTS default: "tests overhead bench serve")
# PARTS: tests (the GPU tests) | overhead (opaque-op call overhead) | bench (the sweep, scripts/gpu_bench.sh) |
#   serve (serving benchmark) | hf-bench (a transformers Qwen2 through piecegraph.hf) | fp8-block, fp8-moe (FP8
#   blocks on FlashInfer) | moe (FP8 MoE preset) | startup (start-up test) | startup-engine, startup-hf (first,
#   cold and warm starts) | profile (an engine step's host time) | http (piecegraph serve) | tp (two GPUs) |
#   flashinfer-new (tests and overhead again on each .whl/flashinfer*.tar.xz) | mla (MLA/DSA tests, DSA vs dense MLA
#   by context) | mla-serve (the GLM-5 shape served) | prefix (a shared-prefix workload with and without the prefix
#   cache) | hbm (the 1B shape's decode step at batch 1 and 10 against the HBM floor: cuBLAS only, then the measured
#   small-batch kernels, each with a kernel timeline; then scripts/decode_attention_probe.py)
# Also: TESTS, BATCHES, PREFILL, JIT_SAVE=1 (keep FlashInfer's built kernels), BUNDLE=NAME.tgz (one archive of OUTDIR).
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PARTS=${PARTS:-"tests overhead bench serve"}
KNOWN=" tests overhead bench serve hf-bench fp8-block fp8-moe moe startup startup-engine startup-hf profile http tp "
KNOWN+="flashinfer-new mla mla-serve prefix hbm "
unknown=$(for part in $PARTS; do [[ "$KNOWN" == *" $part "* ]] || echo -n "$part "; done)
if [ -n "$unknown" ]; then
  echo "gpu_check.sh: unknown part(s): $unknown(known:$KNOWN)" >&2
  exit 2
fi
has() { [[ " $PARTS " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 PIECEGRAPH_OUT="$OUT"  # the GPU tests record what they measured there
WORK=$(mktemp -d -t pg-check.XXXXXX)  # scratch: model folders, unpacked FlashInfer builds
trap 'rm -rf "$WORK"' EXIT
status=0

# Wheels first (GPU machines may have no network): FlashInfer, apache-tvm-ffi, piecewise-cuda-graphs, fastapi, ...
shopt -s nullglob
wheels=(.whl/*.whl)
# Installed into a folder that outlives the check: FlashInfer's JIT cache records its sources' paths, so a later
# check on the same machine that installed them elsewhere could not build a new kernel.
SITE=${PIECEGRAPH_CHECK_SITE:-$HOME/.cache/piecegraph-check/site}
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "${wheels[@]}" \
    >"$OUT/install.log" 2>&1 \
    && export PYTHONPATH=$SITE:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 \
  || export PYTHONPATH=$PWD:${PYTHONPATH:-}
# FlashInfer kernels an earlier call saved (JIT_SAVE=1 there, then its flashinfer_jit.tgz copied to .whl/) go where
# FlashInfer loads prebuilt kernels, and skip their builds (tens of seconds each); the JIT build seconds a start
# reports are then not a first build's.
if [ -f .whl/flashinfer_jit.tgz ]; then
  aot=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)" 2>/dev/null) \
    && mkdir -p "$aot" && tar -xzf .whl/flashinfer_jit.tgz -C "$aot" \
    && echo "prebuilt FlashInfer kernels: $(ls "$aot" | wc -l)"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
{ lscpu; nproc; } >"$OUT/cpu.txt" 2>&1 || true  # hosts differ in speed, and the serving parts' processes share them
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
# <date>_<gpu>: how every result file's name starts (the result schema's result_name)
PREFIX=$(python3 -c "from piecegraph.results.schema import environment, result_name
print(result_name(environment(attention=None, model=None, dtype=None, quant=None), 'x')[:-len('_x.json')])") || exit 1
name() { echo "$OUT/${PREFIX}_$1.json"; }
ok() { [ "${1:-1}" = 0 ] || status=1; }  # $1: an exit status; any failure fails the check

if has startup || has startup-engine || has startup-hf; then
  # An installed torch has its bytecode compiled by pip; a GPU machine's Python may keep none (and may set
  # PYTHONDONTWRITEBYTECODE), so every start would compile the stack from source. Compile what a start imports
  # into a prefix first, as pip does at install.
  export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$WORK/pycache}
  dirs=$(python3 -c "
import importlib.util as u
for name in ('torch functorch torchgen sympy mpmath networkx triton numpy jinja2 markupsafe filelock fsspec '
             'typing_extensions transformers tokenizers huggingface_hub safetensors flashinfer tvm_ffi typer rich '
             'click piecegraph').split():
    spec = u.find_spec(name)
    if spec and spec.submodule_search_locations: print(*spec.submodule_search_locations)
    elif spec and spec.origin: print(spec.origin)")
  python3 -m compileall -q -j 0 $dirs >/dev/null 2>&1
  echo "bytecode under $PYTHONPYCACHEPREFIX: $(find "$PYTHONPYCACHEPREFIX" -name '*.pyc' 2>/dev/null | wc -l) files"
fi

# flashinfer-new: each .whl/flashinfer*.tar.xz is a newer FlashInfer wheel, unpacked and packed again with xz (its
# wheel is too big to carry); docs/gpu-check.md says how to make one.
newer_site() {  # $1: the tarball -> its own site folder and JIT workspace, first on the path
  local tag=$(basename "$1" .tar.xz)
  mkdir -p "$WORK/$tag" && { [ -d "$WORK/$tag/flashinfer" ] || tar -xJf "$1" -C "$WORK/$tag"; } || return 1
  export PYTHONPATH=$WORK/$tag:${PYTHONPATH:-} FLASHINFER_WORKSPACE_BASE=$WORK/ws-$tag
}
newer_tests() {  # runs beside the main tests: JIT builds are CPU work, and nothing here is timed
  local tag=$(basename "$1" .tar.xz)
  newer_site "$1" || return 1
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" >"$OUT/$tag.log" 2>&1
  python3 -m pytest tests/gpu/test_flashinfer_gpu.py -m gpu -q -rs -p no:cacheprovider 2>&1 | grep -v "^DEBUG" \
    >>"$OUT/$tag.log"
  return "${PIPESTATUS[0]}"
}
newer=() tarballs=()
has flashinfer-new && tarballs=(.whl/flashinfer*.tar.xz)
if has tests; then
  for tarball in "${tarballs[@]}"; do
    ( newer_tests "$tarball" ) &
    newer+=($!)
  done
  python3 -m pytest ${TESTS:-tests/gpu} -m gpu -q -rs -p no:cacheprovider 2>&1 | grep -v "^DEBUG" \
    | tee "$OUT/gpu_tests.log"
  ok "${PIPESTATUS[0]}"
  for pid in "${newer[@]}"; do
    wait "$pid" || status=1
  done
fi
# Everything below is timed: one part at a time, alone on the GPU.
if has overhead; then
  python3 scripts/opaque_overhead.py "$OUT" --profile 2>&1 | tee "$OUT/opaque_overhead.log"
  ok "${PIPESTATUS[0]}"
  for tarball in "${tarballs[@]}"; do
    tag=$(basename "$tarball" .tar.xz)
    ( newer_site "$tarball" && python3 scripts/opaque_overhead.py "$OUT" --profile --tag "$tag" ) \
      2>&1 | tee -a "$OUT/opaque_overhead.log"
    ok "${PIPESTATUS[0]}"
  done
fi
if has bench; then
  bash scripts/gpu_bench.sh "$OUT"
  ok $?
fi
if has serve; then  # continuous batching, every engine mode, four concurrencies
  python3 -m piecegraph.cli serve-bench --model qwen2.5-0.5b --device cuda --attention flashinfer \
    --modes "${SERVE_MODES:-eager,breakable,piecewise,auto,auto-nomixed,auto-sync}" --concurrency "${SERVE_CONC:-1,10,256,1024}" \
    --requests "${SERVE_REQUESTS:-4,30,512,1024}" \
    --input-len 512 --output-len 128 --range-ratio 0.25 --max-batched-tokens "${SERVE_BUDGET:-2048}" --warmup 2 \
    --repeats "${SERVE_REPEATS:-1}" ${SERVE_ARGS:-} \
    --json "$(name serve_bench)" --plot "$OUT/${PREFIX}_serve_bench.png" 2>&1 | tee "$OUT/serve_bench.log"
  ok "${PIPESTATUS[0]}"
fi
if has hf-bench; then  # the transformers model through piecegraph.hf beside the reference decoder, same weights
  python3 scripts/hf_random_qwen2.py "$WORK/qwen2-hf" >"$OUT/hf_bench.log" 2>&1
  for which in ${HF_WHICH:-hf ref}; do
    flag=$([ "$which" = hf ] && echo --hf || true)
    python3 -m piecegraph.cli bench --model "$WORK/qwen2-hf" $flag --device cuda --attention flashinfer \
      --modes "${HF_MODES:-eager,full,piecewise}" --batches "${BATCHES:-1,10,256}" --prefill "${PREFILL:-128,2048}" \
      --json "$(name "hf_bench_$which")" >>"$OUT/hf_bench.log" 2>&1
    ok $?
  done
  tail -60 "$OUT/hf_bench.log"
fi
if has fp8-block; then  # a block nothing prepared for piecegraph: eager, breakable, auto, auto + static compiles
  python3 scripts/fp8_bench.py "$OUT" dense --modes "${FP8_MODES:-eager,breakable,auto,auto-static}" 2>&1 \
    | tee "$OUT/fp8_block_bench.log"
  ok "${PIPESTATUS[0]}"
fi
if has fp8-moe; then  # an FP8 MoE block on FlashInfer's sm90 grouped GEMM (a method wrapped by automatic opaque)
  python3 scripts/fp8_bench.py "$OUT" moe --modes "${FP8_MODES:-eager,breakable,auto,auto-static}" 2>&1 \
    | tee "$OUT/fp8_moe_bench.log"
  ok "${PIPESTATUS[0]}"
fi
if has moe; then  # the MoE preset benched per mode in bf16 and FP8 side by side (+ accuracy), then served in both
  MOE_MODEL=${MOE_MODEL:-qwen1.5-moe-a2.7b}
  # One process per group of modes (space-separated groups, commas within): a mode that loses the CUDA context
  # cannot take the others with it. Each builds the model once per quant and writes both quants' rows.
  for group in ${MOE_MODES:-eager,breakable,piecewise full-compiled auto}; do
    python3 -m piecegraph.cli bench --model "$MOE_MODEL" --quant "${MOE_BENCH_QUANTS:-bf16,fp8}" --device cuda \
      --attention flashinfer --modes "$group" --batches "${BATCHES:-1,10,256,1024}" \
      --prefill "${PREFILL:-16,512,2048}" ${MOE_BENCH_ARGS:-} \
      --json "$(name "moe_bf16_fp8_bench_${group//,/-}")" 2>&1 | tee -a "$OUT/moe_bench.log"
    ok "${PIPESTATUS[0]}"
  done
  for quant in ${MOE_QUANTS:-fp8 bf16}; do
    python3 -m piecegraph.cli serve-bench --model "$MOE_MODEL" --quant "$quant" --device cuda --attention flashinfer \
      --modes "${MOE_SERVE_MODES:-auto}" --concurrency "${SERVE_CONC:-256,1024}" \
      --requests "${SERVE_REQUESTS:-512,1024}" \
      --input-len 512 --output-len 128 --range-ratio 0.25 --max-batched-tokens 2048 --warmup 2 ${MOE_SERVE_ARGS:-} \
      --json "$(name "moe_${quant}_serve")" 2>&1 | tee -a "$OUT/moe_serve.log"
    ok "${PIPESTATUS[0]}"
  done
fi
if has mla; then  # MLA + DSA: the GPU tests, DSA against dense MLA by context
  python3 -m pytest tests/gpu/test_mla_gpu.py tests/cpu/test_mla_models.py tests/cpu/test_mla_quant.py -m gpu -q -rs \
    -p no:cacheprovider 2>&1 | tee "$OUT/mla_tests.log"
  ok "${PIPESTATUS[0]}"
  for context in ${MLA_CONTEXTS:-4096 16384}; do
    for model in glm5-shape glm5-shape-dense; do
      python3 -m piecegraph.cli bench --model "$model" --device cuda --attention flashinfer \
        --modes "${MLA_MODES:-full-compiled,auto}" \
        --batches "${BATCHES:-1,10}" --prefill "" --context "$context" --repeats 10 \
        --json "$(name "mla_bench_${model}_ctx${context}")" 2>&1 | tee -a "$OUT/mla_bench.log"
      ok "${PIPESTATUS[0]}"
    done
  done
fi
if has mla-serve; then  # the GLM-5 shape served, every mode, four concurrencies
  python3 -m piecegraph.cli serve-bench --model glm5-shape --device cuda --attention flashinfer \
    --concurrency "${SERVE_CONC:-1,10,256,1024}" \
    --input-len 512 --output-len 128 ${MLA_SERVE_ARGS:---interleave} --json "$(name glm5_shape_serve)" 2>&1 \
    | tee "$OUT/mla_serve.log"
  ok "${PIPESTATUS[0]}"
fi
if has prefix; then  # prefix caching: a shared-prefix workload with and without the cache (auto, auto-noprefix)
  python3 -m piecegraph.cli serve-bench --model qwen2.5-0.5b --device cuda --attention flashinfer \
    --workload shared-prefix --num-prefixes "${PREFIX_COUNT:-4}" --concurrency "${SERVE_CONC:-1,10,256,1024}" \
    --json "$(name prefix_serve)" 2>&1 | tee "$OUT/prefix_serve.log"
  ok "${PIPESTATUS[0]}"
fi
if has hbm; then  # batch-1 decode against the memory bound: the same bench with cuBLAS only, then the measured choice
  for small in ${HBM_KERNELS:-cublas auto}; do
    PIECEGRAPH_SMALL_LINEAR=$small python3 -m piecegraph.cli bench --model "${HBM_MODEL:-llama-3.2-1b}" --device cuda \
      --attention flashinfer --modes "${HBM_MODES:-full-static,baked-graph,auto}" --batches "${BATCHES:-1,10}" \
      --prefill "" --repeats 20 --profile "${HBM_PROFILE:-full-static:1,baked-graph:1}" \
      --json "$(name "bench_batch1_${HBM_MODEL:-llama-3.2-1b}_$small")" 2>&1 | tee -a "$OUT/hbm_bench.log"
    ok "${PIPESTATUS[0]}"
  done
  # the 1B shape's decode attention kernels and KV writes alone, in CUDA graphs
  python3 scripts/decode_attention_probe.py "$OUT" 2>&1 | tee -a "$OUT/hbm_bench.log"
  ok "${PIPESTATUS[0]}"
fi
if has startup; then  # the start-up test: first, cold and warm starts in fresh processes, graph memory estimate
  python3 -m pytest tests/gpu/test_startup_gpu.py -q -rA -p no:cacheprovider 2>&1 | tee "$OUT/startup_gpu.log"
  ok "${PIPESTATUS[0]}"
fi
built=${STARTUP_NO_FIRST:-}  # set once a series built FlashInfer's kernels: later series skip their first start
for kind in engine hf; do
  has "startup-$kind" || continue
  python3 scripts/startup.py series "$kind" "$OUT" ${built:+--no-first} 2>&1 | tee "$OUT/startup_$kind.log"
  ok "${PIPESTATUS[0]}"
  built=1
done
if has profile; then  # where an engine step's host time goes: cProfile, and the CUDA runtime calls that block
  python3 scripts/profile_step.py "$OUT" --what "${PROFILE_WHAT:-timeline,host,cuda-api}" --mode "${PROFILE_MODE:-auto}" 2>&1 \
    | tee "$OUT/profile_step.log" | grep -v "^ *$" | head -240
  ok "${PIPESTATUS[0]}"
fi
if has http; then  # the 0.5B shape behind `piecegraph serve`: throughput over HTTP beside in process, and its tokens
  HTTP_MODEL=${HTTP_MODEL:-qwen2.5-0.5b} HTTP_CONC=${HTTP_CONC:-1,10,256,1024}
  HTTP_REQ=${HTTP_REQ:-${SERVE_REQUESTS:-4,30,512,1024}} HTTP_SEQS=${HTTP_CONC##*,}
  HTTP_REFERENCE=${HTTP_REFERENCE:-$OUT/http_tokens_reference.json}
  common=(--input-len 512 --output-len 128 --range-ratio 0.25 --concurrency "$HTTP_CONC" --requests "$HTTP_REQ"
          --warmup 2 --device cuda --repeats "${SERVE_REPEATS:-1}")
  if ! python3 -c "import fastapi, uvicorn" 2>"$OUT/http_missing.log"; then
    echo "http: fastapi/uvicorn are not importable (carry their wheels in .whl/)" | tee -a "$OUT/http_missing.log"
    status=1
  else
    if [ ! -f "$(name http_inprocess)" ] && [ -z "${HTTP_TOKENS_ONLY:-}${HTTP_NO_INPROCESS:-}" ]; then
      python3 -m piecegraph.cli serve-bench --model "$HTTP_MODEL" --attention flashinfer --modes auto \
        --max-batched-tokens 2048 "${common[@]}" --json "$(name http_inprocess)" 2>&1 | tee "$OUT/http_inprocess.log"
      ok "${PIPESTATUS[0]}"
    fi
    for engine in ${HTTP_ENGINES:-process thread}; do
      port=$((8400 + RANDOM % 500))
      setsid python3 -m piecegraph.cli serve "$HTTP_MODEL" --device cuda --attention flashinfer --mode auto \
        --max-num-seqs "$HTTP_SEQS" --max-batched-tokens 2048 --max-seq-len 832 --port "$port" \
        --engine-$engine --api-servers "${HTTP_API_SERVERS:-0}" ${HTTP_SERVE_ARGS:-} \
        --log-level warning >"$OUT/http_server_$engine.log" 2>&1 &
      spid=$!
      # a timeout must not leave the server (its own process group: engine and front ends too) on the GPU
      trap 'kill -KILL -- -$spid 2>/dev/null; exit 124' TERM
      for _ in $(seq 900); do  # the server traces, compiles and captures every size before it answers
        python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
          "http://127.0.0.1:$port/health" 2>/dev/null && break
        kill -0 $spid 2>/dev/null || break
        sleep 1
      done
      # the server's greedy tokens against an in-process engine's (built once per OUTDIR: HTTP_REFERENCE), one
      # request alone each, on the fresh server and again after the load
      check_tokens() {
        [ -n "${HTTP_NO_TOKENS:-}" ] && return 0
        python3 scripts/http_tokens.py check "http://127.0.0.1:$port" "$HTTP_MODEL" "$OUT" --tag "${engine}_$1" \
          --max-num-seqs "$HTTP_SEQS" --reference "$HTTP_REFERENCE" 2>&1 | tail -3 | tee -a "$OUT/http_$engine.log"
        ok "${PIPESTATUS[0]}"
      }
      check_tokens fresh
      if [ -z "${HTTP_TOKENS_ONLY:-}" ]; then
        python3 -m piecegraph.cli serve-bench --url "http://127.0.0.1:$port" "${common[@]}" \
          --json "$(name "http_$engine")" 2>&1 | tee -a "$OUT/http_$engine.log"
        ok "${PIPESTATUS[0]}"
        check_tokens after_load
      fi
      kill -INT $spid; wait $spid
      trap - TERM
    done
  fi
fi
if has tp; then  # several GPUs: scripts/tp_check.sh (the TP tests, bench and serve-bench at world size 1 and TP)
  TP=${TP:-2} bash scripts/tp_check.sh "$OUT"
  ok $?
fi
if [ -n "${JIT_SAVE:-}" ]; then  # the kernels FlashInfer built here, for a later call's .whl/flashinfer_jit.tgz
  ops=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_JIT_DIR)" 2>/dev/null)
  [ -d "$ops" ] && (cd "$ops" && find . -mindepth 2 -maxdepth 2 -name "*.so" -print0 \
    | tar -czf "$OUT/flashinfer_jit.tgz" --null -T -)
fi
if [ -n "${BUNDLE:-}" ]; then  # one archive instead of many files (for transports that bring back only a few)
  tar -czf "$WORK/results.tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$WORK/results.tgz" "$OUT/$BUNDLE"
fi
exit $status
