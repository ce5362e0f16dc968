#!/usr/bin/env bash
# On a GPU machine: build the extension with CUDA, then run the GPU tests or the benchmarks; logs and JSON go
# to OUTDIR. Usage: scripts/gpu_check.sh tests|bench [OUTDIR]   (JAXHQ_CUDA_ARCHS=90a by default; 100a: Blackwell;
# CUTLASS's headers from JAXHQ_CUTLASS_DIR, or unpacked from CUTLASS_WHEEL or .whl/nvidia_cutlass-*.whl)
#   tests: the kernel tests (-m gpu; the quantize and activation-gradient tests once per kernel variant in VARIANTS,
#          default: the default one) and the dense-op, layer and quantize-path tests on the GPU backend, side by side
#   multi: (>= 2 GPUs) the sharding tests, then benchmarks/fsdp.py --gpu (FSDP_ARGS): what only a multi-GPU machine runs
#   recheck: only the tests selected by RECHECK (a pytest -k expression over the FFI and dense-op tests)
#   bench: (RECHECK first when set) the benchmarks named by BENCH (default "train peer gemm quantize"; also
#          "quick": train_step.py --preset quick, QUICK_ARGS; "fsdp": benchmarks/fsdp.py --gpu over all local
#          GPUs, FSDP_ARGS; "moe": benchmarks/moe_step.py, MOE_ARGS; "counters": the quantize kernels' hardware
#          counters under ncu, benchmarks/kernel_counters.py, COUNTERS_ARGS):
#          train_step.py (every recipe against bf16; TRAIN_ARGS adds options, e.g. --paths), peer_fp8.py,
#          (train, quick and gemm time their variants in ROUNDS alternating rounds, default 3)
#          gemm.py (GEMM_ARGS) and quantize.py once per kernel variant in VARIANTS (default: the default one)
set -uo pipefail
MODE=${1:-tests}
OUTDIR=${2:-${OUT:-/tmp/jaxhq_gpu}}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log() { echo "=== $* ($(date -u +%T))"; }

log "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import jax, jaxlib, nanobind; print('jax', jax.__version__, 'nanobind', nanobind.__version__, jax.devices())"

log "build (CUDA ${JAXHQ_CUDA_ARCHS:-90a})"
# CUTLASS's headers (the grouped FP8 kernel) from an nvidia-cutlass wheel: CUTLASS_WHEEL, else one in .whl/
WHEEL=${CUTLASS_WHEEL:-$(ls .whl/nvidia_cutlass-*.whl 2>/dev/null | head -1)}
if [ -z "${JAXHQ_CUTLASS_DIR:-}" ] && [ -n "$WHEEL" ]; then
  rm -rf /tmp/jaxhq_cutlass && $PY -m zipfile -e "$WHEEL" /tmp/jaxhq_cutlass \
    && export JAXHQ_CUTLASS_DIR=/tmp/jaxhq_cutlass/cutlass_library/source/include
fi
echo "CUTLASS headers: ${JAXHQ_CUTLASS_DIR:-none}"
rm -rf /tmp/jaxhq_site
JAXHQ_CUDA=ON JAXHQ_CUDA_ARCHS=${JAXHQ_CUDA_ARCHS:-90a} CMAKE_BUILD_PARALLEL_LEVEL=16 \
  $PY -m pip install --no-build-isolation --no-deps --no-index -v --target /tmp/jaxhq_site . \
  >"$OUTDIR/build.log" 2>&1 || { tail -40 "$OUTDIR/build.log"; exit 1; }
cp /tmp/jaxhq_site/jaxhq/ffi/_jaxhq_ffi*.so jaxhq/ffi/  # the built extension with this tree's Python sources
$PY -c "import jaxhq.ffi as f; print('cuda_built', f.load().cuda_built, 'gpu kernels', f.available('gpu'))"

summary() { grep -E "^(FAILED|ERROR)|passed|failed" "$1" | cut -c1-250 | tail -${2:-12}; }
# the 2-GPU equality tests and the sharded-step benchmark (multi mode, tests mode on >= 2 GPUs, BENCH=fsdp)
sharding_tests() { XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-240} $PY -m pytest -q -m gpu \
  tests/test_sharding_gpu.py --tb=short -p no:cacheprovider >"$OUTDIR/sharding_gpu.log" 2>&1; }
fsdp_bench() { log "fsdp ${FSDP_ARGS:-}"; timeout ${FSDP_TIMEOUT:-400} $PY benchmarks/fsdp.py --gpu ${FSDP_ARGS:-} \
  --out "$OUTDIR/fsdp_gpu.json" 2>&1 | tee "$OUTDIR/fsdp_gpu.log" | tail -30; }

if [ "$MODE" = multi ]; then
  log "sharding tests on $(nvidia-smi -L | wc -l) GPUs"
  sharding_tests
  summary "$OUTDIR/sharding_gpu.log" 20
  fsdp_bench
elif [ "$MODE" = tests ]; then
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  T=${TEST_TIMEOUT:-330}
  log "tests, in parallel (timeout ${T}s each)"
  for v in ${VARIANTS:-default}; do  # each variant of the quantize kernel named (read once per process)
    ( [ "$v" = default ] || export JAXHQ_QUANTIZE_VARIANT=$v
      timeout $T $PY -m pytest -q -m gpu tests/test_ffi_gpu.py tests/test_activation.py --tb=short -p no:cacheprovider >"$OUTDIR/ffi_gpu_$v.log" 2>&1 ) &
  done
  timeout $T $PY -m pytest -q -m gpu tests/test_gemm_gpu.py --tb=short -p no:cacheprovider >"$OUTDIR/gemm_gpu.log" 2>&1 &
  timeout $T $PY -m pytest -q tests/test_dense.py tests/test_layers.py tests/test_layers_more.py --tb=short -p no:cacheprovider \
    >"$OUTDIR/dense_layers_on_gpu.log" 2>&1 &
  timeout $T $PY -m pytest -q tests/test_train_state.py tests/test_train_remat.py --tb=short -p no:cacheprovider \
    >"$OUTDIR/train_on_gpu.log" 2>&1 &
  timeout $T $PY -m pytest -q tests/test_quantize_paths.py --tb=short -p no:cacheprovider \
    >"$OUTDIR/quantize_paths_on_gpu.log" 2>&1 &
  wait
  NGPU=$(nvidia-smi -L | wc -l)
  [ "$NGPU" -ge 2 ] && { log "sharding on $NGPU GPUs"; TEST_TIMEOUT=$T sharding_tests; }
  for f in $(for v in ${VARIANTS:-default}; do echo ffi_gpu_$v; done) gemm_gpu dense_layers_on_gpu train_on_gpu \
      quantize_paths_on_gpu \
      $([ "$NGPU" -ge 2 ] && echo sharding_gpu); do
    log "$f"; summary "$OUTDIR/$f.log"
  done
  log "train_step smoke"
  timeout 90 $PY benchmarks/train_step.py --preset quick --steps 3 --warmup 1 --no-split \
    --recipes bf16,fp8_current,mxfp8,nvfp4 --out "$OUTDIR/train_step_smoke.json" 2>&1 | tail -8
else
  if [ -n "${RECHECK:-}" ]; then  # a quick look at selected tests before the benchmarks (pytest -k expression)
    log "recheck: $RECHECK"
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${RECHECK_TIMEOUT:-150} $PY -m pytest -q tests/test_ffi_gpu.py tests/test_dense.py \
      -k "$RECHECK" --tb=line -p no:cacheprovider >"$OUTDIR/recheck.log" 2>&1
    summary "$OUTDIR/recheck.log" 20
  fi
  [ "$MODE" = recheck ] && { log "done"; exit 0; }
  for b in ${BENCH:-train peer gemm quantize}; do
    case $b in
      train) log "train_step ${TRAIN_ARGS:-}"
        timeout ${TRAIN_TIMEOUT:-480} $PY benchmarks/train_step.py --budget-s ${TRAIN_BUDGET:-300} --steps 10 \
          --rounds ${ROUNDS:-3} ${TRAIN_ARGS:-} --out "$OUTDIR/train_step.json" 2>&1 | tee "$OUTDIR/train_step.log" \
          | grep -v "top ops\|kernels by origin" | tail -22 ;;
      quick) log "train_step --preset quick ${QUICK_ARGS:-}"
        timeout ${QUICK_TIMEOUT:-200} $PY benchmarks/train_step.py --preset quick --steps 10 --rounds ${ROUNDS:-3} \
          ${QUICK_ARGS:-} --out "$OUTDIR/train_step_quick.json" 2>&1 | tee "$OUTDIR/train_step_quick.log" \
          | grep -v "top ops\|kernels by origin" | tail -22 ;;
      peer) log "peer_fp8"
        timeout ${PEER_TIMEOUT:-260} $PY benchmarks/peer_fp8.py ${PEER_ARGS:-} --out "$OUTDIR/peer_fp8.json" 2>&1 | tail -18 ;;
      counters) log "kernel_counters ${COUNTERS_ARGS:-}"  # why each quantize kernel runs at its speed (ncu)
        timeout ${COUNTERS_TIMEOUT:-300} $PY benchmarks/kernel_counters.py ${COUNTERS_ARGS:-} \
          --out "$OUTDIR/kernel_counters.json" 2>&1 | tail -40 ;;
      fsdp) fsdp_bench ;;  # sharded steps (FSDP, TP, SP) over all local GPUs
      moe) log "moe_step ${MOE_ARGS:-}"  # one MoE layer per recipe and token dispatch
        timeout ${MOE_TIMEOUT:-300} $PY benchmarks/moe_step.py ${MOE_ARGS:-} --out "$OUTDIR/moe_step.json" 2>&1 | tail -14 ;;
      gemm) log "gemm"
        timeout ${GEMM_TIMEOUT:-420} $PY benchmarks/gemm.py --rounds ${ROUNDS:-3} ${GEMM_ARGS:-} --out "$OUTDIR/gemm.json" \
          2>&1 | grep -v "compiled in" | tail -24 ;;
      quantize) for variant in ${VARIANTS:-default}; do
          log "quantize ($variant)"
          [ "$variant" = default ] && unset JAXHQ_QUANTIZE_VARIANT || export JAXHQ_QUANTIZE_VARIANT=$variant
          timeout 150 $PY benchmarks/quantize.py ${QUANTIZE_ARGS:-} --out "$OUTDIR/quantize_$variant.json" 2>&1 | tail -20
        done; unset JAXHQ_QUANTIZE_VARIANT ;;
    esac
  done
fi
log "done"
