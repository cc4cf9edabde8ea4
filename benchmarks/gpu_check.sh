#!/usr/bin/env bash
# One command for a GPU machine (H100/H200, no network, a CUDA torch, no pydantic): the CUDA
# tests, the parity fixtures on CUDA (eager and compiled), bench_gpu.py's timings and peak
# memory against NeMo-RL's loss, and bench_packing.py's cost per call under sequence packing.
# See docs/performance.md#on-a-gpu.
#
#   bash benchmarks/gpu_check.sh            # from the repository root, < 10 minutes
#   bash benchmarks/gpu_check.sh --dry-run  # any machine: skips the CUDA parts, proves it starts
#   STEPS=tests,packing bash benchmarks/gpu_check.sh   # only some steps (always in the order below)
#
# Steps (STEPS, comma-separated; default all five, run in this order):
#   tests             the CUDA tests (GPU_TESTS overrides the files): one host sync per call,
#                     the parity fixtures on CUDA, compiled equal to eager
#   bench_gpu         bench_gpu.py: 8 x 32k and 4 x 64k, CUDA events and peak memory vs NeMo-RL
#   packing           bench_packing.py --device cuda --large: the calls NeMo-RL makes under
#                     sequence packing (a lone B = 1 call, its per-sequence wrapper over 32
#                     sequences, 8 x 32k), host time, GPU span, kernel time and kernels per call
#   packing_compiled  the lone B = 1 call with compile: true, for the configurations whose label
#                     contains one of PACKING_COMPILED_ONLY's parts (each compiles: ~1 min)
#   logprob_memory    bench_logprob_memory.py --device cuda: log-probs from a bf16 logits shard
#                     [1, 16384, 37984] (the 64k recipe's per rank), peak memory
#                     (max_memory_allocated) and time vs NeMo-RL's chunked and unchunked paths
#
# Before (where pip works): bash benchmarks/gpu_wheels.sh fills .whl/; optionally
#   mkdir -p .nemo-rl && tar -xzf ../shared/nemo-rl/nemo-rl-main.tar.gz -C .nemo-rl
# Environment: OUT (output folder, default ./gpu-check-out), NEMO_RL (NeMo-RL checkout,
# default .nemo-rl/nemo-rl-main), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUT=${OUT:-$REPO/gpu-check-out}
NEMO_RL=${NEMO_RL:-$REPO/.nemo-rl/nemo-rl-main}
PY=${PYTHON:-python3}
STEPS=",${STEPS:-tests,bench_gpu,packing,packing_compiled,logprob_memory},"
PACKING_COMPILED_ONLY=${PACKING_COMPILED_ONLY:-token TIS,async-tokentis}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee "$LOG") 2>&1
START=$SECONDS
FAILED=()
for name in ${STEPS//,/ }; do  # a misspelt step would otherwise run nothing, silently
  case $name in
    tests | bench_gpu | packing | packing_compiled | logprob_memory) ;;
    *) echo "gpu_check: unknown step '$name' in STEPS (allowed: tests, bench_gpu, packing, packing_compiled, logprob_memory)"; exit 2 ;;
  esac
done

step() {  # step NAME TIMEOUT_S CMD...: run, report rc and seconds, remember failures
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name"
  timeout "$limit" "$@"
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  [[ $rc -ne 0 ]] && FAILED+=("$name (rc=$rc)")
  return 0
}

echo "gpu_check: $(date -u +%FT%TZ), dry-run=$DRY, out=$OUT"
# --- dependencies: every wheel in .whl/ (the plugin's and the tests' packages, and what NeMo-RL's
# loss module needs beyond the image: pyzmq, a transformers below NeMo-RL's 5.12 cap with its
# tokenizers), installed into /tmp/site ahead of the image's own packages
if [[ $DRY -eq 0 ]] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  echo "deps: installed $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site"
elif $PY -c "import pydantic, yaml, pytest, hypothesis" 2>/dev/null; then
  echo "deps: importable, nothing installed"
else
  echo "deps: missing and no wheels in .whl/ (run benchmarks/gpu_wheels.sh where pip works)"; exit 2
fi
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
$PY - <<'PY'
import sys, torch, pydantic
cuda = torch.cuda.is_available()
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"pydantic {pydantic.VERSION}, device: {torch.cuda.get_device_name() if cuda else 'no CUDA'}")
PY
if [[ -d "$NEMO_RL/nemo_rl" ]]; then echo "NeMo-RL: $NEMO_RL"; else echo "NeMo-RL: no checkout at $NEMO_RL; its comparison will be skipped"; fi
PYTEST=($PY -m pytest -q -p no:cacheprovider -rs)
# shellcheck disable=SC2206  # GPU_TESTS: a space-separated list of test files
TESTS=(${GPU_TESTS:-tests/core/test_cuda_sync.py tests/core/test_peer_modes_prime_rl_ms_swift.py tests/core/test_parity.py tests/core/test_compile.py})
wanted() { [[ $STEPS == *",$1,"* ]]; }
# bench_packing imports NeMo-RL's SequencePackingLossWrapper: the checkout goes on PYTHONPATH.
PACKING=(env "PYTHONPATH=$NEMO_RL:$PYTHONPATH" PYTHONUNBUFFERED=1 $PY benchmarks/bench_packing.py)
LOGPROB_MEMORY=(env PYTHONUNBUFFERED=1 $PY benchmarks/bench_logprob_memory.py --nemo-rl "$NEMO_RL" --tp 1 --dtype bf16
  --variants plugin,nemo-rl-chunked,nemo-rl,plugin-unchunked)

if [[ $DRY -eq 1 ]]; then
  # Everything but CUDA: the GPU tests import and collect; the benchmarks run on CPU, briefly,
  # bench_gpu's compiled rows with the eager backend (dynamo's trace of the same code, no AOT
  # graph, no kernels: the script's compiled path runs in seconds; whether the traced graph
  # equals eager is tests/core/test_compile.py's, under aot_eager, and on the GPU under inductor).
  wanted tests && step "collect the GPU tests" 120 "${PYTEST[@]}" --collect-only "${TESTS[@]}"
  wanted bench_gpu && step "bench_gpu on CPU (dry run)" 180 \
    $PY benchmarks/bench_gpu.py --device cpu --sizes 2x1024 --repeats 2 --nemo-rl "$NEMO_RL" --compile-backend eager \
    --json "$OUT/bench_gpu.json"
  if [[ -d "$NEMO_RL/nemo_rl" ]]; then
    wanted packing && step "bench_packing on CPU (dry run)" 180 \
      "${PACKING[@]}" --only "plain, GSPO" --rounds 2 --packed-rounds 1 --sequences 4
    wanted logprob_memory && step "bench_logprob_memory on CPU (dry run)" 120 \
      "${LOGPROB_MEMORY[@]}" --shapes 256x512 --repeats 1
  else
    wanted packing && echo "bench_packing skipped: it needs NeMo-RL's checkout"
    wanted logprob_memory && echo "bench_logprob_memory skipped: it needs NeMo-RL's checkout"
  fi
else
  # CUDA tests: sync count (fp32/bf16, eager/compiled), 120 parity fixtures on CUDA, and the
  # compiled core vs eager with inductor (slow-marked cases included).
  wanted tests && step "CUDA tests (sync count, parity on cuda, compiled vs eager)" 300 \
    env NEMO_RS_TEST_DEVICE=cuda "${PYTEST[@]}" -m "slow or not slow" "${TESTS[@]}"
  wanted bench_gpu && step "bench_gpu (CUDA events, peak memory, 8x32k and 4x64k)" 240 \
    $PY benchmarks/bench_gpu.py --device cuda --sizes 8x32768,4x65536 --repeats 20 \
    --nemo-rl "$NEMO_RL" --json "$OUT/bench_gpu.json"
  wanted packing && step "bench_packing on CUDA (B = 1, the per-sequence wrapper, 8 x 32k)" 240 \
    "${PACKING[@]}" --device cuda --large
  wanted packing_compiled && step "bench_packing on CUDA, compiled B = 1 ($PACKING_COMPILED_ONLY)" 240 \
    "${PACKING[@]}" --device cuda --compiled --only "$PACKING_COMPILED_ONLY"
  wanted logprob_memory && step "bench_logprob_memory on CUDA (T 16384, V/tp 37984, bf16)" 240 \
    "${LOGPROB_MEMORY[@]}" --device cuda --shapes 16384x37984 --repeats 5
fi
echo "gpu_check: $((SECONDS - START)) s; failed steps: ${#FAILED[@]}${FAILED:+ (${FAILED[*]})}"
[[ ${#FAILED[@]} -eq 0 ]] && echo "gpu_check: done" && exit 0
exit 1
