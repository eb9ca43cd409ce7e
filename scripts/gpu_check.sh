#!/usr/bin/env bash
# Run on a CUDA machine: the GPU-marked tests, the opaque-op overhead, the doctor on a FlashInfer model, then the
# benchmark sweep (scripts/gpu_bench.sh). Logs and JSON go under OUTDIR.
# Usage: scripts/gpu_check.sh OUTDIR   (PARTS="tests overhead attention-cost doctor bench serve" by default:
# pick a subset to split the work over several calls). "serve" runs the serving benchmark (serve-bench) at
# concurrency 1, 10, 256, 1024 for every engine mode and the synchronous auto loop (auto-sync); SERVE_MODES,
# SERVE_CONC and SERVE_REQUESTS override its modes, concurrencies and request counts. "hf-bench"
# times a random 0.5B-shaped transformers Qwen2 through piecegraph.hf beside the reference decoder (same weights;
# HF_WHICH="hf" for the transformers model only, HF_MODES for other modes, e.g. piecewise,piecewise-static).
# "hf-latency" (issue 22) times greedy decoding at batch 1 end to end through piecegraph.hf (FlashInfer and torch
# attention) beside transformers' static cache + compile (scripts/hf_greedy_latency.py), then one decode step at
# batch 1 and 10: piecegraph.hf full against piecewise, the reference decoder's full-compiled (and with static
# compiles per size, full-static; compiled by pieces, full-pieces) against baked-graph (HF_REF_MODES picks).
# "static-bench" times piecewise with and without static compiles per size (compile_sizes="auto") beside
# baked-graph on the 0.5B shape. "fp8-block" times the FP8 block on FlashInfer (scripts/fp8_block_bench.py) in
# eager, breakable, auto and auto with static compiles (FP8_MODES picks some); "fp8-moe" the same for the FP8 MoE block on FlashInfer's
# sm90 grouped GEMM (scripts/fp8_moe_block.py). "startup" (issue 24) starts the 0.5B shape in fresh processes
# (first JIT, cold, warm) and checks the graph memory estimate; "swap-bench" serves an engine whose full module
# was compiled by pieces, before and after the whole graph's package is swapped in (scripts/swap_bench.py); "startup-engine" times an engine's starts (scripts/engine_start.py: first JIT,
# cold, warm, and cold with the engine's defaults before stop 49: whole, own trace); "startup-hf" does the same for piecegraph.hf (scripts/hf_start.py: a
# transformers Qwen2 of the 0.5B shape, Session(capture=True): first JIT, cold, warm); "startup-aot" times starts from AOTInductor packages
# (cold, warm twice) against a warm start from Inductor's cache, one JSON per start (after compiling the imported packages' bytecode, as pip does; PRECOMPILE=1 does it for other parts); "loader-probe" packages one decode unit in a setup and by the
# background worker, and prefill pieces by the worker, loads each in fresh processes, takes the first crash's backtrace,
# rebuilds the workers' jobs several ways and diffs the generated code (scripts/package_load_probe.py: the worker's
# SIGSEGV on the H200; PROBE_BUDGET_S caps it, default 420 s; run it on its own call, with BUNDLE); "loader-imports"
# packages one small function and loads it after importing torch alone, tvm_ffi, flashinfer.jit or FlashInfer
# (the loader crashed without FlashInfer, stop 48), and says which libstdc++ each process maps;
# "aoti-probe" packages a block with AOTInductor and loads it
# in a fresh process without Dynamo or Inductor (scripts/aoti_warm_probe.py); "startup-profile" profiles a warm and a cold start
# (scripts/start_once.py under cProfile) and times a warm start with TORCHINDUCTOR_COMPILE_THREADS=1. "serve-profile" profiles an engine's steps on the 0.5B
# shape (scripts/profile_serve_step.py; PROFILE_MODE picks the engine mode, default auto); "api-profile" lists the CUDA
# runtime calls that block an overlapped and a synchronous engine's host loop (scripts/cuda_api_profile.py).
# "fused-moe-build" (issue 23) times FlashInfer's sm90 cutlass_fused_moe build for PROBE_S seconds and estimates the
# rest (scripts/fused_moe_build_probe.py; run it last: its nvcc jobs take every core). "moe" (issue 23) benches
# the FP8 MoE preset (MOE_MODEL, MOE_MODES) and serves it in FP8 and bf16 (MOE_QUANTS, MOE_SERVE_MODES, SERVE_CONC;
# MOE_SERVE_ARGS: more serve-bench options, e.g. --num-pages 30000: one KV cache size for every mode);
# "moe-profile" sums an MoE decode step's kernels by kind, FP8 against bf16 (scripts/moe_step_profile.py;
# PROFILE_BATCHES picks the batches); "pool-snapshot" lists what one capture size (POOL_SIZE) of a preset
# (MOE_MODEL, POOL_QUANT) puts in the graph pool beside the estimate (scripts/pool_snapshot.py). "http" (issue 25) serves the 0.5B shape with
# `piecegraph serve` and runs serve-bench --url against it beside the in-process engine; the server's greedy tokens
# are checked against an in-process engine on the fresh server and after the load (HTTP_TOKENS_ONLY=1: only the
# fresh check; HTTP_NO_TOKENS=1: no token checks, throughput only; HTTP_SERVE_ARGS: more serve options, e.g. --cache;
# HTTP_REFERENCE: the engine tokens' file; HTTP_NO_INPROCESS=1: no in-process reference run). "tp" (two GPUs) runs tests/gpu/test_tp_gpu.py and the bench at --tp 1 and 2 for the 0.5B and 7B shapes.
# Wheels under .whl/ (FlashInfer, apache-tvm-ffi, piecewise-cuda-graphs) are installed first, for machines
# without network access.
# PARTS may add "flashinfer-new": each .whl/flashinfer*.tar.xz (a newer FlashInfer wheel unpacked and packed
# again with xz, because its wheel is too big to carry) then also gets the parts asked for among tests (only
# the FlashInfer GPU tests, run beside the main tests), overhead and doctor, with that FlashInfer first on
# the path. To make one: pip download --no-deps flashinfer-python==X -d /tmp/fi && mkdir /tmp/fiu &&
# unzip -q /tmp/fi/*.whl -d /tmp/fiu && tar -C /tmp/fiu -cJf .whl/flashinfer_python-X.tar.xz .
# REPEATS: runs per concurrency in "serve" and "http" (the median run is reported; a GPU host's runs vary 10-20%).
# TESTS names the GPU test files to run (default: all of tests/gpu). BUNDLE=NAME.tgz packs everything under
# OUTDIR into that one archive at the end (the device tool brings back at most 8 files).
# JIT_SAVE=1 packs the FlashInfer kernels built in this call into OUTDIR/flashinfer_jit.tgz; a later call with that
# file in .whl/ loads them prebuilt (no JIT build).
set -uo pipefail
OUT=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PIECEGRAPH_OUT="$OUT"
# The device's torch ships no bytecode caches and keeps none: a warm start's process compiled ~1,400 modules from
# source (5 s of its profile). A user's pip install has them. A writable prefix alone did not help: the machine
# sets PYTHONDONTWRITEBYTECODE, so nothing was ever written there (stop 42's warm start still compiled 1,427
# modules, 4.4 s). The parts that time a start therefore compile the packages into the prefix first (below),
# as pip does at install; imports then read the prefix.
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pg-pycache}
PARTS=${PARTS:-"tests overhead attention-cost doctor bench serve"}
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pg-site "${wheels[@]}" >/tmp/pg-install.log 2>&1 \
    && export PYTHONPATH=/tmp/pg-site:${PYTHONPATH:-}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >>/tmp/pg-install.log 2>&1 || export PYTHONPATH=$PWD:${PYTHONPATH:-}
# FlashInfer kernels built by an earlier call (.whl/flashinfer_jit.tgz, from JIT_SAVE=1 there) go where FlashInfer
# loads prebuilt kernels (its AOT folder) and skip their 17-51 s builds each; the JIT build seconds a start reports
# are then not a first build's.
if [ -f .whl/flashinfer_jit.tgz ]; then
  aot=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_AOT_DIR)" 2>/dev/null) \
    && mkdir -p "$aot" && tar -xzf .whl/flashinfer_jit.tgz -C "$aot" && echo "prebuilt FlashInfer kernels: $(ls "$aot" | wc -l)"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
# the host too: machines lent differ in host speed by ~1.6x (stop 36), and the HTTP part's processes share its cores
{ lscpu; nproc; } >"$OUT/cpu.txt" 2>&1 || true
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
status=0
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has startup || has startup-aot || has startup-engine || has startup-hf || has startup-profile || [ -n "${PRECOMPILE:-}" ]; then  # bytecode, as an installed torch has
  # the packages a start imports, found without importing them (the site folders hold many more)
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
newer_site() {  # $1: a .tar.xz of an unpacked FlashInfer wheel -> its own site folder and JIT workspace
  local name=$(basename "$1" .tar.xz)
  mkdir -p "/tmp/pg-$name" && [ -d "/tmp/pg-$name/flashinfer" ] || tar -xJf "$1" -C "/tmp/pg-$name" || return 1
  export PYTHONPATH=/tmp/pg-$name:${PYTHONPATH:-} FLASHINFER_WORKSPACE_BASE=/tmp/pg-ws-$name
}
newer_tests() {  # runs beside the main tests: JIT builds are CPU work, and nothing here is timed
  local name=$(basename "$1" .tar.xz)
  newer_site "$1" || return 1
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" >"$OUT/$name.log" 2>&1
  python3 -m pytest tests/gpu/test_flashinfer_gpu.py -m gpu -q -rs -p no:cacheprovider 2>&1 | grep -v "^DEBUG" \
    >>"$OUT/$name.log"
  return "${PIPESTATUS[0]}"
}
timed_parts() {  # alone on the GPU: the overhead is timed, the doctor's run times are reported
  local suffix=$1  # "" for the FlashInfer of .whl/, "_<name>" for a newer one
  if has overhead; then
    python3 scripts/opaque_overhead.py --profile 2>&1 | tee "$OUT/opaque_overhead$suffix.json"
  fi
  if has attention-cost; then
    python3 scripts/attention_cost.py --out "$OUT/attention_cost$suffix.json" 2>&1 | tail -40
  fi
  if has doctor && [ -f scripts/doctor_flashinfer.py ]; then
    python3 -m piecegraph.cli doctor scripts/doctor_flashinfer.py:target --device cuda \
      --json "$OUT/doctor_before$suffix.json" 2>&1 | tee "$OUT/doctor$suffix.log"
    python3 -m piecegraph.cli doctor scripts/doctor_flashinfer.py:target --device cuda --fix \
      --json "$OUT/doctor_after$suffix.json" 2>&1 | tee -a "$OUT/doctor$suffix.log"
    # The reference decoder with FlashInfer attention on the paged cache: nothing may block.
    python3 -m piecegraph.cli doctor scripts/doctor_flashinfer.py:reference --device cuda \
      --json "$OUT/doctor_reference$suffix.json" 2>&1 | tee -a "$OUT/doctor$suffix.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
}
newer=() tarballs=()
has flashinfer-new && tarballs=(.whl/flashinfer*.tar.xz)
for tarball in "${tarballs[@]}"; do
  has tests || break
  ( newer_tests "$tarball" ) &
  newer+=($!)
done
if has tests; then
  python3 -m pytest ${TESTS:-tests/gpu} -m gpu -q -rs -p no:cacheprovider 2>&1 | grep -v "^DEBUG" | tee "$OUT/gpu_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
for pid in "${newer[@]}"; do
  wait "$pid" || status=1
done  # what follows is timed: alone on the GPU
timed_parts ""
for tarball in "${tarballs[@]}"; do
  ( newer_site "$tarball" && timed_parts "_$(basename "$tarball" .tar.xz)" )
done
if has bench; then
  bash scripts/gpu_bench.sh "$OUT" || status=1
fi
if has hf-bench; then  # the transformers model itself beside the reference decoder, on the same weights
  python3 scripts/hf_random_qwen2.py /tmp/pg-qwen2-hf >"$OUT/hf_bench.log" 2>&1
  for which in ${HF_WHICH:-hf ref}; do
    flag=$([ $which = hf ] && echo --hf || true)
    python3 -m piecegraph.cli bench --model /tmp/pg-qwen2-hf $flag --device cuda --attention flashinfer \
      --modes "${HF_MODES:-eager,full,piecewise}" --batches "${BATCHES:-1,10,256}" --prefill "${PREFILL:-128,2048}" \
      --profile "${PROFILE:-piecewise:1}" --json "$OUT/${which}_bench.json" >>"$OUT/hf_bench.log" 2>&1
    [ $? = 0 ] || status=1
    tail -40 "$OUT/hf_bench.log"
  done
fi
if has hf-latency; then  # issue 22: batch-1 latency, end to end through piecegraph.hf and one step per bench mode
  python3 scripts/hf_greedy_latency.py "$OUT/hf_latency.json" 2>&1 | tee "$OUT/hf_latency.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 scripts/hf_random_qwen2.py /tmp/pg-qwen2-hf >>"$OUT/hf_latency.log" 2>&1
  python3 -m piecegraph.cli bench --model /tmp/pg-qwen2-hf --hf --device cuda --attention flashinfer \
    --modes full,piecewise --batches 1,10 --prefill '' --json "$OUT/hf_batch1_bench.json" 2>&1 | tee -a "$OUT/hf_latency.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 -m piecegraph.cli bench --model qwen2.5-0.5b --device cuda --attention flashinfer \
    --modes "${HF_REF_MODES:-full-compiled,full-static,full-pieces,baked-graph}" --batches 1,10 --prefill '' --json "$OUT/ref_batch1_bench.json" 2>&1 \
    | tee -a "$OUT/hf_latency.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has static-bench; then  # static compiles per size (compile_sizes="auto") beside piecewise and the baked lower bound
  python3 -m piecegraph.cli bench --model qwen2.5-0.5b --device cuda --attention flashinfer \
    --modes "${STATIC_MODES:-piecewise,piecewise-static,baked-graph}" --batches "${BATCHES:-1,256}" \
    --prefill "${PREFILL:-16,128,512}" --profile "${PROFILE:-piecewise-static:1}" \
    --json "$OUT/static_bench.json" 2>&1 | tee "$OUT/static_bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d.get('modes', d), indent=1)[:4000])" \
    "$OUT/static_bench.json"
fi
if has fp8-block; then  # issue 21's FP8 block: eager, breakable, auto (automatic opaque), auto + static compiles
  python3 scripts/fp8_block_bench.py "$OUT/fp8_block_bench.json" dense ${FP8_MODES:-eager,breakable,auto,auto-static} \
    2>&1 | tee "$OUT/fp8_block_bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has fp8-moe; then  # the FP8 MoE block on FlashInfer's sm90 grouped GEMM (a method wrapped by automatic opaque)
  python3 scripts/fp8_block_bench.py "$OUT/fp8_moe_bench.json" moe 2>&1 | tee "$OUT/fp8_moe_bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has serve; then  # alone on the GPU: continuous batching, every mode, four concurrencies
  python3 -m piecegraph.cli serve-bench --model qwen2.5-0.5b --device cuda --attention flashinfer \
    --modes "${SERVE_MODES:-eager,breakable,piecewise,auto,auto-sync}" --concurrency "${SERVE_CONC:-1,10,256,1024}" \
    --requests "${SERVE_REQUESTS:-4,30,512,1024}" \
    --input-len 512 --output-len 128 --range-ratio 0.25 --max-batched-tokens 2048 --warmup 2 --repeats "${REPEATS:-1}" \
    --json "$OUT/serve_bench.json" --plot "$OUT/serve_bench.png" 2>&1 | tee "$OUT/serve_bench.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has moe; then  # issue 23: the FP8 MoE preset (A2.7B shape) benched per mode, then served in FP8 and bf16
  MOE_MODEL=${MOE_MODEL:-qwen1.5-moe-a2.7b}
  # One process per group of modes (space-separated groups, commas within): a mode that loses the CUDA context
  # (full-compiled did, in automatic opaque's probe after piecewise) cannot take the others with it. Each group
  # writes moe_fp8_bench_<group>.json (the default's first group has the eager rows).
  for group in ${MOE_MODES:-eager,breakable,piecewise full-compiled auto}; do
    python3 -m piecegraph.cli bench --model "$MOE_MODEL" --quant fp8 --device cuda --attention flashinfer \
      --modes "$group" --batches "${BATCHES:-1,10,256,1024}" --prefill "${PREFILL:-16,512,2048}" \
      --json "$OUT/moe_fp8_bench_${group//,/-}.json" 2>&1 | tee -a "$OUT/moe_bench.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
  for quant in ${MOE_QUANTS:-fp8 bf16}; do
    python3 -m piecegraph.cli serve-bench --model "$MOE_MODEL" --quant "$quant" --device cuda --attention flashinfer \
      --modes "${MOE_SERVE_MODES:-auto}" --concurrency "${SERVE_CONC:-256,1024}" --requests "${SERVE_REQUESTS:-512,1024}" \
      --input-len 512 --output-len 128 --range-ratio 0.25 --max-batched-tokens 2048 --warmup 2 ${MOE_SERVE_ARGS:-} \
      --json "$OUT/moe_${quant}_serve.json" 2>&1 | tee -a "$OUT/moe_serve.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
fi
if has moe-profile; then  # issue 23: an MoE decode step's GPU time by kernel kind, FP8 against bf16
  python3 scripts/moe_step_profile.py "$OUT/moe_step_profile.json" "${MOE_MODEL:-qwen1.5-moe-a2.7b}" \
    "${PROFILE_BATCHES:-1,16,256}" 2>&1 | grep -v "^USDT" | tee "$OUT/moe_step_profile.log" | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has pool-snapshot; then  # issue 24: which allocations a capture puts in the graph pool, against the estimate
  python3 scripts/pool_snapshot.py "$OUT/pool_snapshot.json" "${MOE_MODEL:-qwen1.5-moe-a2.7b}" "${POOL_QUANT:-fp8}" \
    "${POOL_SIZE:-2048}" 2>&1 | grep -v "^USDT" | tee "$OUT/pool_snapshot.log" | tail -30
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has api-profile; then  # issue 22: which CUDA runtime calls block the host, overlapped against synchronous
  python3 scripts/cuda_api_profile.py "$OUT/cuda_api_profile.json" ${PROFILE_MODE:-auto} 2>&1 \
    | tee "$OUT/cuda_api_profile.log" | tail -150
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has serve-profile; then  # where a serving step's host time goes (cProfile over the engine's steps)
  python3 scripts/profile_serve_step.py "$OUT/serve_profile.json" ${PROFILE_MODE:-auto} 2>&1 \
    | tee "$OUT/serve_profile.log" | grep -v "^ *$" | head -240
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has startup; then  # issue 24: first-JIT, cold and warm starts (fresh processes) and the graph memory estimate
  PIECEGRAPH_OUT="$OUT" python3 -m pytest tests/gpu/test_startup_gpu.py -q -rA -p no:cacheprovider 2>&1 \
    | tee "$OUT/startup_gpu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has startup-aot; then  # issue 24: starts from AOTInductor packages against Inductor's warm cache, side by side
  # the first start builds FlashInfer's kernels (workspace kept out of the caches) and is a cold start without
  # packages; then a cold start whose worker packages after it (waited for), two warm starts from the packages,
  # one warm start without them
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$HOME}
  one() {  # $1: name, $2: seconds allowed, $3: aot (0/1/""), $4: cache folder; WAIT=1: wait for the packaging worker
    PIECEGRAPH_START_AOT=$3 PIECEGRAPH_START_WAIT_PACKAGING=${WAIT:-0} PIECEGRAPH_START_FULL_COMPILE=${FULL:-whole} \
      timeout "$2" python3 scripts/start_once.py "$4" >"$OUT/start_$1.json" 2>"$OUT/start_$1.err"
    echo "$1 rc=$? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(round(r['ready_s'], 2), \
      r['compiler_imported'], {m: (s['cache'], s['trace'], s.get('aot'), round(s['compile_s'], 2), \
      round(s['capture_s'], 2)) for m, s in r['startup'].items()}, r['out_sum'], \
      {k[:8]: (s.get('state'), round(s.get('seconds') or 0, 1), s.get('why')) for k, s in r['packaging'].items()}, \
      r['packaging_wait_s'], r['swap'])" "$OUT/start_$1.json" 2>&1 | tail -1)"
    cat "$4"/packaging/*.log >"$OUT/start_$1_packaging.log" 2>/dev/null || true
  }
  one jit_first 240 0 /tmp/pg-start-inductor
  WAIT=1 one cold_aot 420 "" /tmp/pg-start-aot  # ready on Inductor's code; the worker packages after
  one warm_aot 90 "" /tmp/pg-start-aot
  one warm_aot_again 90 "" /tmp/pg-start-aot
  one warm_inductor 120 0 /tmp/pg-start-inductor
  # the decode module compiled by pieces (fast cold start), its whole graph packaged by the worker and swapped in
  WAIT=1 FULL=pieces one cold_pieces 420 "" /tmp/pg-start-pieces
  FULL=pieces one warm_pieces 90 "" /tmp/pg-start-pieces
  rm -rf /tmp/pg-start-inductor /tmp/pg-start-aot /tmp/pg-start-pieces
fi
if has startup-engine; then  # issue 24's targets, for the engine itself: one shared trace, decode compiled by pieces
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$HOME}
  engine() {  # $1: name, $2: cache folder; FULL / SHARE / AOT / BG: the engine's options (scripts/engine_start.py)
    PIECEGRAPH_START_FULL_COMPILE=${FULL:-auto} PIECEGRAPH_START_SHARE_TRACE=${SHARE:-1} PIECEGRAPH_START_AOT=${AOT:-} \
      PIECEGRAPH_START_AOT_BACKGROUND=${BG:-1} timeout 420 python3 scripts/engine_start.py "$2" \
      >"$OUT/engine_$1.json" 2>"$OUT/engine_$1.err"
    echo "engine $1 rc=$? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(round(r['ready_s'], 2), \
      {k: (m['startup']['cache'], m['startup']['trace'], m['startup'].get('aot'), round(m['setup_s'], 2)) \
      for k, m in r['modules'].items()}, r['tokens'][0][:6])" "$OUT/engine_$1.json" 2>&1 | tail -1)"
    cat "$2"/packaging/*.log >"$OUT/engine_$1_packaging.log" 2>/dev/null || true
  }
  # FlashInfer's kernels built here: the starts below do not build (ENGINE_NO_JIT_FIRST=1: the cold start builds
  # them, and its stats' jit_build_s says how long)
  [ -n "${ENGINE_NO_JIT_FIRST:-}" ] || AOT=0 FULL=pieces engine jit_first /tmp/pg-engine-first
  engine cold /tmp/pg-engine
  python3 -m piecegraph.cli cache wait --dir /tmp/pg-engine --timeout "${ENGINE_WAIT_S:-300}" >"$OUT/engine_wait.log" 2>&1
  engine warm /tmp/pg-engine
  [ -n "${ENGINE_NO_PLAIN:-}" ] || \
    AOT=0 FULL=whole SHARE=0 engine cold_plain /tmp/pg-engine-plain  # the engine's defaults before stop 49, no packages
  rm -rf /tmp/pg-engine-first /tmp/pg-engine /tmp/pg-engine-plain
fi
if has startup-hf; then  # issue 24's targets through piecegraph.hf: a transformers Qwen2, Session(capture=True)
  export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$HOME}
  hfstart() {  # $1: name, $2: cache folder; AOT: aot_package, FULL: full_compile (scripts/hf_start.py)
    PIECEGRAPH_START_AOT=${AOT:-} PIECEGRAPH_START_FULL_COMPILE=${FULL:-auto} timeout 420 python3 scripts/hf_start.py "$2" >"$OUT/hf_start_$1.json" \
      2>"$OUT/hf_start_$1.err"
    echo "hf start $1 rc=$? $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(round(r['ready_s'], 2), \
      {k: (m['startup']['cache'], m['startup']['trace'], m['startup'].get('pieces'), m['startup'].get('aot'), \
      round(m['startup']['ready_s'], 2)) for k, m in r['modules'].items()}, r['tokens_equal_transformers'])" \
      "$OUT/hf_start_$1.json" 2>&1 | tail -1)"
    cat "$2"/packaging/*.log >"$OUT/hf_start_$1_packaging.log" 2>/dev/null || true
  }
  # FlashInfer's kernels built here (by pieces: without packages "auto" compiles whole); HF_NO_JIT_FIRST=1 when
  # startup-engine ran before in this call (the same kernels)
  [ -n "${HF_NO_JIT_FIRST:-}" ] || AOT=0 FULL=pieces hfstart jit_first /tmp/pg-hf-first
  hfstart cold /tmp/pg-hf
  python3 -m piecegraph.cli cache wait --dir /tmp/pg-hf --timeout 300 >"$OUT/hf_start_wait.log" 2>&1
  hfstart warm /tmp/pg-hf
  rm -rf /tmp/pg-hf-first /tmp/pg-hf
fi
if has swap-bench; then  # issue 24: one engine's decode on the pieces' program, then on the whole graph's package
  rm -rf /tmp/pg-swap && timeout 900 python3 scripts/swap_bench.py "$OUT/swap_bench.json" /tmp/pg-swap \
    >"$OUT/swap_bench.log" 2>&1
  [ $? = 0 ] || status=1
  tail -1 "$OUT/swap_bench.log"
  cat /tmp/pg-swap/packaging/*.log >"$OUT/swap_bench_packaging.log" 2>/dev/null || true
  rm -rf /tmp/pg-swap
fi
if has loader-imports; then  # which import a package load needs (stop 48: FlashInfer's), on one small package
  python3 scripts/package_load_probe.py tiny /tmp/pg-tiny.pt2 >"$OUT/tiny_build.log" 2>&1
  echo "small package built: rc=$?"
  for mods in "" tvm_ffi flashinfer.jit flashinfer; do
    timeout 120 python3 scripts/package_load_probe.py load "$mods" /tmp/pg-tiny.pt2 >"$OUT/load_${mods:-none}.log" 2>&1
    echo "load after importing torch and [${mods:-nothing}]: rc=$? $(tail -1 "$OUT/load_${mods:-none}.log")"
  done
  for mods in torch "tvm_ffi, torch" "torch, flashinfer"; do
    echo "libstdc++ mapped after import $mods: $(python3 -c "import $mods; print(open('/proc/self/maps').read())" \
      | grep -o '/[^ ]*libstdc[^ ]*' | sort -u | tr '\n' ' ')"
  done
  echo "g++: $(which g++) $(g++ -dumpfullversion); libstdc++ it links: $(g++ -print-file-name=libstdc++.so.6)"
fi
if has loader-probe; then  # issue 24: why the worker's packages crash torch's package loader (stop 46)
  # PROBE_BUDGET_S: the probe skips its remaining steps past it (one device call holds at most 600 s)
  FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$HOME} PROBE_BUDGET_S=${PROBE_BUDGET_S:-420} timeout 560 \
    python3 scripts/package_load_probe.py /tmp/pg-loader-probe >"$OUT/loader_probe.log" 2>&1
  mkdir -p "$OUT/loader_probe" && cp /tmp/pg-loader-probe/probe.json /tmp/pg-loader-probe/diff_*.txt \
    "$OUT/loader_probe/" 2>/dev/null
  cat /tmp/pg-loader-probe/*/packaging/*.log >"$OUT/loader_probe/worker_logs.txt" 2>/dev/null
  tail -c 3000 "$OUT/loader_probe.log"
  rm -rf /tmp/pg-loader-probe
fi
if has aoti-probe; then  # issue 24: a packaged piece loaded and run (and graph-replayed) without Dynamo or Inductor
  python3 scripts/aoti_warm_probe.py "$OUT/aoti" cuda 2>&1 | grep -v "Warning\|return cls" | tee "$OUT/aoti_warm_probe.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  rm -f "$OUT/aoti/block.pt2" "$OUT/aoti/cases.pt"  # only the JSON comes back
fi
if has startup-profile; then  # issue 24: where a start's seconds go (cProfile of the setup), warm and cold
  first="$OUT/start_cache_first" cold="$OUT/start_cache_cold"
  run_start() { python3 scripts/start_once.py "$@" 2>>"$OUT/startup_profile.log" | tail -1; }
  run_start "$first" >"$OUT/start_first.json"  # FlashInfer's first JIT build and a cold start
  run_start "$first" "$OUT/start_warm.prof" >"$OUT/start_warm_profiled.json"
  TORCHINDUCTOR_COMPILE_THREADS=1 run_start "$first" >"$OUT/start_warm_threads1.json"
  run_start "$cold" "$OUT/start_cold.prof" >"$OUT/start_cold_profiled.json"
  rm -rf "$first" "$cold"
  for f in "$OUT"/start_*.json; do echo "$f: $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); \
    print(round(r['ready_s'], 2), {m: {k: round(v, 2) for k, v in s.items() if k.endswith('_s')} \
    for m, s in r['startup'].items()})" "$f")"; done
fi
if has http; then  # issue 25: the 0.5B shape behind `piecegraph serve`, one closed loop in process and over HTTP
  # Needs fastapi and uvicorn (and their dependencies) as Python 3.12 wheels in .whl/. HTTP_ENGINES="process" or
  # "thread" splits the part over two calls (the in-process reference runs once per OUTDIR). HTTP_API_SERVERS: the
  # server's front-end processes (default 0: serve's own default, up to 4 on a GPU machine).
  HTTP_MODEL=${HTTP_MODEL:-qwen2.5-0.5b} HTTP_CONC=${HTTP_CONC:-1,10,256,1024}
  HTTP_REQ=${HTTP_REQ:-${SERVE_REQUESTS:-4,30,512,1024}} HTTP_SEQS=${HTTP_CONC##*,}
  common=(--input-len 512 --output-len 128 --range-ratio 0.25 --concurrency "$HTTP_CONC" --requests "$HTTP_REQ"
          --warmup 2 --device cuda --repeats "${REPEATS:-1}")
  if ! python3 -c "import fastapi, uvicorn" 2>"$OUT/http_missing.log"; then
    echo "http: fastapi/uvicorn are not importable (carry their wheels in .whl/)" | tee -a "$OUT/http_missing.log"
    status=1
  else
    if [ ! -f "$OUT/http_inprocess.json" ] && [ -z "${HTTP_TOKENS_ONLY:-}${HTTP_NO_INPROCESS:-}" ]; then
      python3 -m piecegraph.cli serve-bench --model "$HTTP_MODEL" --attention flashinfer --modes auto \
        --max-batched-tokens 2048 "${common[@]}" --json "$OUT/http_inprocess.json" 2>&1 | tee "$OUT/http_inprocess.log"
      [ "${PIPESTATUS[0]}" = 0 ] || status=1
    fi
    # HTTP_PINS: --engine-cpus values to serve with in turn (default none); a pinned server's load generator keeps
    # off the engine's CPUs too (on another machine it would), and its files are named http_process_<pins>.
    # HTTP_SPINS: --engine-idle-spin-ms values to serve with in turn (default: serve's own); files http_process_spinN.
    for run in ${HTTP_ENGINES:-process thread}; do for pins in ${HTTP_PINS:-none}; do for spin in ${HTTP_SPINS:-default}; do
      engine=$run client=() spin_args=()
      if [ "$spin" != default ]; then
        engine=${engine}_spin${spin//[^0-9]/_} spin_args=(--engine-idle-spin-ms "$spin")
      fi
      if [ "$pins" != none ]; then
        engine=${engine}_${pins//[^0-9a-z]/_}
        rest=$(python3 -c "import sys; from piecegraph.server.affinity import *; s = split_cpus(sys.argv[1], \
          available_cpus()); print(format_cpus(s[1]) if s else '')" "$pins")
        [ -n "$rest" ] && client=(taskset -c "$rest")
      fi
      port=$((8400 + RANDOM % 500))
      setsid python3 -m piecegraph.cli serve "$HTTP_MODEL" --device cuda --attention flashinfer --mode auto \
        --max-num-seqs "$HTTP_SEQS" --max-batched-tokens 2048 --max-seq-len 832 --port "$port" \
        --engine-$run --api-servers "${HTTP_API_SERVERS:-0}" --engine-cpus "$pins" "${spin_args[@]}" ${HTTP_SERVE_ARGS:-} \
        --log-level warning >"$OUT/http_server_$engine.log" 2>&1 &
      spid=$!
      # a timeout must not leave the server (its own process group: engine and front ends too) on the GPU
      trap 'kill -KILL -- -$spid 2>/dev/null; exit 124' TERM
      for _ in $(seq 900); do  # start-up traces, compiles and captures every size
        python3 -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
          "http://127.0.0.1:$port/health" 2>/dev/null && break
        kill -0 $spid 2>/dev/null || break
        sleep 1
      done
      # the server's tokens against an in-process engine of the same preset and settings (built once per OUTDIR),
      # on the fresh server and again after the load; one request alone each
      check_tokens() {
        [ -n "${HTTP_NO_TOKENS:-}" ] && return 0
        python3 scripts/http_token_check.py "http://127.0.0.1:$port" "$HTTP_MODEL" --json "$OUT/http_tokens_$1.json" \
          --max-num-seqs "$HTTP_SEQS" --reference "${HTTP_REFERENCE:-$OUT/http_tokens_reference.json}" 2>&1 | tail -3 \
          | tee -a "$OUT/http_$engine.log"
      }
      check_tokens "${engine}_fresh"
      if [ -z "${HTTP_TOKENS_ONLY:-}" ]; then
        "${client[@]}" python3 -m piecegraph.cli serve-bench --url "http://127.0.0.1:$port" "${common[@]}" \
          --json "$OUT/http_$engine.json" 2>&1 | tee -a "$OUT/http_$engine.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        check_tokens "${engine}_after_load"
      fi
      kill -INT $spid; wait $spid
      trap - TERM
    done; done; done
  fi
fi
if has tp; then  # two GPUs (nvidia-h200-x2): TP=2 against TP=1, then the bench at TP 1 and 2 on two shapes
  python3 -m pytest tests/gpu/test_tp_gpu.py -m gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/tp_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  for model in qwen2.5-0.5b llama-7b-shape; do
    for tp in 1 2; do
      NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} python3 -m piecegraph.cli bench --model $model --tp $tp --device cuda \
        --attention flashinfer --modes eager,full,piecewise --batches "${BATCHES:-1,10,256}" \
        --prefill "${PREFILL:-128,2048}" --json "$OUT/tp${tp}_${model}_bench.json" >>"$OUT/tp_bench.log" 2>&1
      [ $? = 0 ] || status=1
    done
  done
  tail -60 "$OUT/tp_bench.log"
fi
if has fused-moe-build; then  # issue 23: FlashInfer's sm90 cutlass_fused_moe JIT build, timed for PROBE_S seconds
  python3 scripts/fused_moe_build_probe.py "$OUT/fused_moe_build.json" "${PROBE_S:-60}" 2>&1 | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ -n "${JIT_SAVE:-}" ]; then  # the kernels FlashInfer built here, for a later call's .whl/flashinfer_jit.tgz
  ops=$(python3 -c "import flashinfer.jit.env as e; print(e.FLASHINFER_JIT_DIR)" 2>/dev/null)
  [ -d "$ops" ] && (cd "$ops" && find . -mindepth 2 -maxdepth 2 -name "*.so" -print0 | tar -czf "$OUT/flashinfer_jit.tgz" --null -T -)
fi
if [ -n "${BUNDLE:-}" ]; then  # one archive instead of many files: the device tool brings back at most 8
  tar -czf /tmp/pg-results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/pg-results.tgz "$OUT/$BUNDLE"
fi
exit $status
