#!/usr/bin/env bash
# One device call that runs every GPU test and benchmark of attncomm and leaves the results under
# $OUT (run from the repo root on a device machine through the device tool):
#
#   [ATTNCOMM_WORLD_SIZE=W ATTNCOMM_MACHINE=kind] bash scripts/gpu_check.sh [steps...]
#   steps: env smoke tests faults soak dcp gather demo ulysses ulysses-layer dp-sync demo-bf16
#          (default all)
#
# On a machine with fewer GPUs than W (one H200), the multi-rank steps run as W processes
# sharing the GPU (CUDA IPC peers, a gloo group): right for correctness and faults, never speed
# (the benches say so on every table).
#
# Writes $OUT/gpu-check.log (everything printed) and $OUT/results.tgz (JSON, PNG, Markdown, junit),
# to unpack into benchmarks/results/ (file names carry the date and the machine).
# Each step has its own time limit (GPU_TESTS_LIMIT, DEMO_LIMIT, BENCH_LIMIT override three) and a
# failing step does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
RES=$(mktemp -d)
MACHINE=${ATTNCOMM_MACHINE:-nvidia-h200}
WS=${ATTNCOMM_WORLD_SIZE:-2}  # ranks for the benches and the demo (the GPU tests use W=2)
DAY=$(date -u +%F)
export ATTNCOMM_MACHINE=$MACHINE PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off (HARDWARE.md), also in every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/attncomm-triton}
export ATTNCOMM_TIMEOUT_S=${ATTNCOMM_TIMEOUT_S:-30}
mkdir -p "$OUT"
LOG=$OUT/gpu-check.log
STEPS=${*:-env smoke tests faults soak dcp gather demo ulysses ulysses-layer dp-sync demo-bf16}
PY=python3
AC="$PY -m attncomm.cli"
status=0

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "===== [$name] $(date -u +%T) (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --signal=TERM --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "===== [$name] rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  [ $rc -eq 0 ] || status=1
  cp "$LOG" "$RES/gpu-check-$DAY-$MACHINE.log"
  tar czf "$OUT/results.tgz" -C "$RES" .  # after every step: a call cut short keeps what ran
}

want() { [[ " $STEPS " == *" $1 "* ]]; }

if want env; then
  step versions 40 bash -c "nvidia-smi; nvidia-smi topo -m; $PY -c 'import torch, triton, sys; \
print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", \
torch.cuda.nccl.version()); print(\"triton\", triton.__version__); \
print(\"gpus\", torch.cuda.device_count())'"
  step attncomm-env 60 $AC env --json "$RES/env-$DAY-$MACHINE.json"
  step attncomm-env-group 90 $AC env --world-size "$WS" --device cuda \
    --json "$RES/env-group-$DAY-$MACHINE.json"
fi
if want smoke; then
  step shared-gpu-smoke 240 $PY scripts/shared_gpu_smoke.py --world 2 3 \
    --json "$RES/shared-gpu-smoke-$DAY-$MACHINE.json"
fi
if want tests; then
  # GPU_TEST_SHARDS=N runs tests/gpu as N pytest processes side by side, the files dealt out
  # largest first; each shard writes its own junit, so a shard that ends inside the limit keeps
  # its record when another is cut off. Ranks of every shard share the GPU: more waits per
  # round, the same answers. GPU_TEST_FILES (a glob or a list) narrows the files.
  SHARDS=${GPU_TEST_SHARDS:-1}
  if [ "$SHARDS" -le 1 ]; then
    step gpu-tests ${GPU_TESTS_LIMIT:-560} $PY -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
      -rs --junitxml="$RES/gpu-tests-$DAY-$MACHINE.xml"
  else
    shard_files() {  # shard_files K: the files of shard K (0-based)
      ls -S ${GPU_TEST_FILES:-tests/gpu/test_*.py} | awk -v n="$SHARDS" -v k="$1" '(NR - 1) % n == k'
    }
    run_shards() {
      local k pids=() rc=0
      for ((k = 0; k < SHARDS; k++)); do
        $PY -m pytest -v -m gpu $(shard_files $k) -p no:cacheprovider -rs --durations=15 $TIMEOUT \
          --junitxml="$RES/gpu-tests-$k-$DAY-$MACHINE.xml" >"$RES/gpu-tests-$k-$DAY-$MACHINE.log" 2>&1 &
        pids+=($!)
      done
      for k in "${!pids[@]}"; do wait "${pids[$k]}" || rc=1; tail -3 "$RES/gpu-tests-$k-$DAY-$MACHINE.log"; done
      return $rc
    }
    # With pytest-timeout installed, a test that hangs prints every thread's stack and ends its
    # shard instead of holding the step to its limit.
    TIMEOUT=""
    $PY -c "import pytest_timeout" 2>/dev/null && TIMEOUT="--timeout=${GPU_TEST_TIMEOUT:-240}"
    export -f shard_files run_shards; export SHARDS PY RES DAY MACHINE TIMEOUT GPU_TEST_FILES
    step gpu-tests ${GPU_TESTS_LIMIT:-560} bash -c run_shards
  fi
fi
if want faults; then
  step gpu-faults 300 $PY -m attncomm.testing.gpu_faults --timeout 4 --jobs 4 --world 2 3 \
    --json "$RES/gpu-faults-$DAY-$MACHINE.json"
fi
if want soak; then
  step soak 240 $PY -m attncomm.testing.soak --merges 5000 --layers 500 \
    --json "$RES/soak-$DAY-$MACHINE.json"
fi
if want dcp; then
  step bench-dcp ${BENCH_LIMIT:-120} $AC bench dcp --device cuda --world-size "$WS" --no-progress \
    --json "$RES/dcp-$DAY-$MACHINE.json" --plot "$RES/dcp-$DAY-$MACHINE.png" \
    --markdown "$RES/dcp-$DAY-$MACHINE.md"
fi
if want gather; then
  step gather-one-gpu 150 $PY scripts/dcp_gather_one_gpu.py \
    --json "$RES/gather-one-gpu-$DAY-$MACHINE.json"
  step gather-one-gpu-fp8 150 $PY scripts/dcp_gather_one_gpu.py --fp8 --tokens 1 8 64 128 \
    --replays 50 --json "$RES/gather-one-gpu-fp8-$DAY-$MACHINE.json"
  for op in gather layer; do
    step bench-$op 150 $AC bench dcp --op $op --device cuda --world-size "$WS" --no-progress \
      --json "$RES/$op-$DAY-$MACHINE.json" --plot "$RES/$op-$DAY-$MACHINE.png" \
      --markdown "$RES/$op-$DAY-$MACHINE.md"
  done
fi
if want demo; then
  MODEL_DIR=${ATTNCOMM_MODEL_DIR:-.models/minilm-fp16}
  step demo ${DEMO_LIMIT:-120} $AC demo --device cuda --world-size "$WS" --model-dir "$MODEL_DIR" \
    --json "$RES/demo-$DAY-$MACHINE.json"
fi
if want ulysses; then
  step bench-ulysses 150 $AC bench ulysses --device cuda --world-size "$WS" --no-progress \
    --json "$RES/ulysses-$DAY-$MACHINE.json" --plot "$RES/ulysses-$DAY-$MACHINE.png" \
    --markdown "$RES/ulysses-$DAY-$MACHINE.md"
fi
if want ulysses-layer; then
  step bench-ulysses-layer 120 $AC bench ulysses --device cuda --world-size "$WS" --no-progress \
    --layer-only --json "$RES/ulysses-layer-$DAY-$MACHINE.json" \
    --markdown "$RES/ulysses-layer-$DAY-$MACHINE.md"
fi
if want dp-sync; then
  step bench-dp-sync 60 $AC bench dp-sync --device cuda --world-size "$WS" --no-progress \
    --json "$RES/dp-sync-$DAY-$MACHINE.json" --markdown "$RES/dp-sync-$DAY-$MACHINE.md" \
    --plot "$RES/dp-sync-$DAY-$MACHINE.png"
fi
if want demo-bf16; then
  MODEL_DIR=${ATTNCOMM_MODEL_DIR:-.models/minilm-fp16}
  step demo-bf16 90 $AC demo --device cuda --world-size "$WS" --dtype bf16 --model-dir "$MODEL_DIR" \
    --json "$RES/demo-bf16-$DAY-$MACHINE.json"
fi
cp "$LOG" "$RES/gpu-check-$DAY-$MACHINE.log"
tar czf "$OUT/results.tgz" -C "$RES" .
echo "results: $(ls "$RES" | tr '\n' ' ')" | tee -a "$LOG"
exit $status
